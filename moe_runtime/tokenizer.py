"""ByteTokenizer: the fallback for models without a tokenizer file.

Ids 0-255 are the UTF-8 bytes of the text; ids >= 256 are special (bos, eos, padding of the
vocabulary) and decode to nothing. Needs a vocabulary of at least 256 ids.
"""

from __future__ import annotations


class ByteTokenizer:
    def __init__(
        self, vocab_size: int, bos_token_id: int | None = None, eos_token_id: int | None = None
    ) -> None:
        if vocab_size < 256:
            raise ValueError(
                f"the byte-level tokenizer needs model.vocab_size >= 256, got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")
