"""IncrementalDetokenizer: one sample's text, grown a token at a time, and its stop strings.

Each new token decodes a short window of recent tokens, never the whole output, so a step's
cost does not grow with the sample's length; an incomplete UTF-8 character ("\ufffd") waits for
up to 4 tokens. Each stop string is matched by an automaton fed every new character once
(Knuth-Morris-Pratt), so neither its length nor the text's makes a token dearer; its state is
also the tail that may still grow into it, which `delta()` holds back when it hands out unsent
text.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
_MAX_CHAR_TOKENS = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 byte tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = [_StopMatcher(s) for s in stop]
        self._prefix_offset = 0  # window start: context for tokenizers whose pieces merge
        self._read_offset = 0  # tokens whose text is in self._text
        self._text = ""
        self._num_sent_chars = 0
        self.stop_index: int | None = None  # where the first stop string starts

    @property
    def text(self) -> str:
        """The text so far, cut before a stop string."""
        return self._text if self.stop_index is None else self._text[: self.stop_index]

    def update(self, token_ids: list[int], is_final: bool = False) -> bool:
        """token_ids: every output token so far (new ones at the end). -> whether a stop
        string has appeared. With is_final, an incomplete last character is kept as is."""
        if self.stop_index is not None or len(token_ids) == self._read_offset:
            return self.stop_index is not None
        decode = self._tokenizer.decode
        prefix = decode(token_ids[self._prefix_offset : self._read_offset])
        window = decode(token_ids[self._prefix_offset :])
        num_unread = len(token_ids) - self._read_offset
        if is_final or not window.endswith(_REPLACEMENT) or num_unread >= _MAX_CHAR_TOKENS:
            # The window moves on even when it added no text (special tokens decode to
            # nothing) or its "\ufffd" can no longer complete (invalid bytes), so it never
            # grows with the output.
            new = window[len(prefix) :] if len(window) > len(prefix) else ""
            # Where each stop string found whole in the new text starts; the first is kept.
            hits = [
                len(self._text) + end + 1 - len(matcher.stop)
                for end, char in enumerate(new)
                for matcher in self._stop
                if matcher.feed(char)
            ]
            self._text += new
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
            if hits:
                self.stop_index = min(hits)
        return self.stop_index is not None

    def delta(self, is_final: bool) -> str:
        """Text not handed out yet; before the end, a possible stop-string start is held."""
        text = self.text
        if not is_final and self.stop_index is None:
            text = text[: len(text) - max((m.num_matched for m in self._stop), default=0)]
        if len(text) <= self._num_sent_chars:
            return ""
        delta, self._num_sent_chars = text[self._num_sent_chars :], len(text)
        return delta


class _StopMatcher:
    """One stop string's Knuth-Morris-Pratt automaton over a text fed a character at a time:
    `num_matched` is the length of the longest start of the string the text now ends with."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        # fallback[k]: the longest proper start of stop[:k + 1] that also ends it.
        self._fallback = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fallback[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._fallback[i] = k
        self.num_matched = 0

    def feed(self, char: str) -> bool:
        """Take the text's next character; -> whether the whole stop string ends with it."""
        k, stop = self.num_matched, self.stop
        while k and stop[k] != char:
            k = self._fallback[k - 1]
        if stop[k] == char:
            k += 1
        is_whole = k == len(stop)
        self.num_matched = self._fallback[k - 1] if is_whole else k
        return is_whole
