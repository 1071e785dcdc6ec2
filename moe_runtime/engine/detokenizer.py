"""IncrementalDetokenizer: one sample's text, grown a token at a time, and its stop strings.

Each new token decodes a short window of recent tokens, never the whole output, so a step's
cost does not grow with the sample's length; an incomplete UTF-8 character ("\ufffd") waits for
up to 4 tokens. Stop strings are searched only where a new match can start. `delta()` hands out
unsent text, holding back a tail that may still grow into a stop string.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
_MAX_CHAR_TOKENS = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 byte tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
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
            searched_from = max(0, len(self._text) - self._max_stop_len + 1)
            self._text += new
            self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
            hits = [i for i in (self._text.find(s, searched_from) for s in self._stop) if i >= 0]
            if hits:
                self.stop_index = min(hits)
        return self.stop_index is not None

    def delta(self, is_final: bool) -> str:
        """Text not handed out yet; before the end, a possible stop-string start is held."""
        text = self.text
        if not is_final and self.stop_index is None:
            text = text[: len(text) - _partial_stop_len(text, self._stop)]
        if len(text) <= self._num_sent_chars:
            return ""
        delta, self._num_sent_chars = text[self._num_sent_chars :], len(text)
        return delta


def _partial_stop_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest tail of text that begins some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
