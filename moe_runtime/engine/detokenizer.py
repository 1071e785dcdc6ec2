"""IncrementalDetokenizer: one sample's text, grown a token at a time, and its stop strings.

The text is the tokenizer's decode of the output so far, found without decoding the whole
output on each token:
- byte-exact vocabularies (the byte tokenizer, byte-level BPE: DeepSeek's) join each new
  token's bytes into one incremental UTF-8 decoder, which holds a character split over tokens
  until its last byte comes and replaces invalid bytes (U+FFFD) as soon as they are known to
  be invalid, as decode does: the same text, at a constant cost a token;
- other vocabularies (sentencepiece's "▁" pieces, byte fallback) decode a short window of
  recent tokens, started in the prompt's last tokens (a piece's leading space depends on what
  comes before it): the new text is what the window adds to its start's; a window that ends in
  U+FFFD (a character not complete yet) waits, up to _MAX_WAIT tokens.
Each stop string is matched by an automaton fed every new character once
(Knuth-Morris-Pratt), so neither its length nor the text's makes a token dearer; its state is
also the tail that may still grow into it, which `delta()` holds back when it hands out unsent
text. The text grows in a buffer and deltas come from its unsent tail: neither copies the text.
"""

from __future__ import annotations

import codecs
import io
import os

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens a window starts in
_MAX_WAIT = 64  # tokens a window waits for a character; past that its text is taken as is


class IncrementalDetokenizer:
    """include_stop_str: the text keeps the stop string that ends it (vLLM's
    include_stop_str_in_output), and nothing is held back, since no stop string is cut."""

    def __init__(
        self,
        tokenizer,
        stop: tuple[str, ...] = (),
        prompt_token_ids=(),
        include_stop_str: bool = False,
    ) -> None:
        if tokenizer.is_byte_exact:
            self._decoder: _ByteDecoder | _WindowDecoder = _ByteDecoder(tokenizer)
        else:
            self._decoder = _WindowDecoder(tokenizer, prompt_token_ids)
        self._stop = [_StopMatcher(s) for s in stop]
        # Why a buffer: `str +=` on an attribute copies the whole text, O(text) a token.
        self._text = io.StringIO()
        self._num_chars = 0
        self._unsent = ""  # the text's tail that delta() has not handed out
        self.stop_index: int | None = None  # where the first stop string starts
        self.stop_string: str | None = None  # which one: a sample's stop_reason
        self._include_stop_str = include_stop_str

    @property
    def text(self) -> str:
        """The text so far, cut before a stop string (after it with include_stop_str; a new
        string, O(text): whole outputs)."""
        return self._text.getvalue()[: self._end()]

    def _end(self) -> int:
        """Where the text ends: where a stop string cuts it, else all of it."""
        if self.stop_index is None:
            return self._num_chars
        if self._include_stop_str:
            return self.stop_index + len(self.stop_string)
        return self.stop_index

    def update(self, token_ids: list[int], is_final: bool = False, may_stop: bool = True) -> bool:
        """token_ids: every output token so far (new ones at the end). -> whether a stop
        string has appeared. With is_final, an incomplete last character is kept as decode
        gives it (U+FFFD). may_stop False (before the sample's min_tokens): the new text is
        read, and a stop string it completes does not stop it (vLLM's rule)."""
        if self.stop_index is not None:
            return True
        new = self._decoder.take(token_ids, is_final)
        for end, char in enumerate(new):
            # The text stops at the first character that completes a stop string (of those
            # completing there, the longest): where a reader of one character at a time
            # stops. Why not the earliest start of any found in the new text: that cut
            # depended on how the text was split into tokens (stop ("bc", "abcd") cut
            # "abcd" to "a" read as "abc", "d" and to "" read as one token).
            whole = [m.stop for m in self._stop if m.feed(char)]  # every matcher fed
            if whole and may_stop:
                self.stop_string = max(whole, key=len)
                self.stop_index = self._num_chars + end + 1 - len(self.stop_string)
                break
        self._text.write(new)
        self._num_chars += len(new)
        self._unsent += new
        return self.stop_index is not None

    def delta(self, is_final: bool) -> str:
        """Text not handed out yet; before the end, a possible stop-string start is held."""
        end = self._end()
        if not is_final and self.stop_index is None and not self._include_stop_str:
            end -= max((m.num_matched for m in self._stop), default=0)
        num_sent = self._num_chars - len(self._unsent)
        if end <= num_sent:
            return ""
        delta, self._unsent = self._unsent[: end - num_sent], self._unsent[end - num_sent :]
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


class _ByteDecoder:
    """The text of a vocabulary whose decode is its tokens' bytes (`token_bytes`) joined and
    read as UTF-8 with invalid bytes replaced."""

    def __init__(self, tokenizer) -> None:
        self._token_bytes = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_read = 0

    def take(self, token_ids: list[int], is_final: bool) -> str:
        """The text the tokens after the last call add (all of it when is_final)."""
        data = b"".join(self._token_bytes(t) for t in token_ids[self._num_read :])
        self._num_read = len(token_ids)
        return self._utf8.decode(data, final=is_final)


class _WindowDecoder:
    """The text of any vocabulary, from decodes of a window of recent tokens."""

    def __init__(self, tokenizer, prompt_token_ids) -> None:
        self._decode = tokenizer.decode
        self._is_byte_piece = tokenizer.is_byte_piece
        self._token_bytes = tokenizer.token_bytes  # b"" for the special tokens decode skips
        self._window = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # from the window's start
        self._num_read = len(self._window)  # of the window: tokens whose text is taken
        self._num_seen = 0  # output tokens in the window so far

    def take(self, token_ids: list[int], is_final: bool) -> str:
        self._window += token_ids[self._num_seen :]
        self._num_seen = len(token_ids)
        num_unread = len(self._window) - self._num_read
        if num_unread == 0:
            return ""
        window = self._decode(self._window)
        # Wait while the last character may still complete, and while a run of byte pieces
        # goes on: a byte-fallback decoder turns a whole run to U+FFFD once it is invalid.
        # Special tokens do not end a run: decode drops them before it joins the bytes.
        last = next((t for t in reversed(self._window) if self._token_bytes(t)), None)
        may_grow = window.endswith(_REPLACEMENT) or (last is not None and self._is_byte_piece(last))
        if may_grow and num_unread < _MAX_WAIT and not is_final:
            return ""
        prefix = self._decode(self._window[: self._num_read])
        # Its start's text is a start of its own but where later tokens rewrote the text
        # before them (a byte run cut by _MAX_WAIT): then what follows the common start is
        # new, and nothing already given is lost.
        start = (
            len(prefix)
            if window.startswith(prefix)
            else len(os.path.commonprefix([prefix, window]))
        )
        # The next window starts in the last tokens read, so that a piece's leading space
        # sees the text before it (also after tokens that decode to nothing, special ones),
        # and never grows with the output.
        self._window = self._window[-_CONTEXT_TOKENS:]
        self._num_read = len(self._window)
        return window[start:]
