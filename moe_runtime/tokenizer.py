"""Tokenizers: a model directory's tokenizer.json, or bytes for models without one.

`load_tokenizer(model_config)` picks `HFTokenizer` when `model.path` holds a `tokenizer.json`
(the `tokenizers` library), refuses a directory with another tokenizer's files alone, and
picks `ByteTokenizer` otherwise: ids 0-255 are the UTF-8 bytes of the text; ids >= 256 are
special (bos, eos, padding of the vocabulary) and decode to nothing.
Encoding text puts `bos_token_id` (from the model config) first: always for bytes; for
tokenizer.json where the tokenizer itself would (`add_bos_token` in tokenizer_config.json, else
its post-processor's rule), as transformers encodes text. Both decode without special tokens and
build chat prompts with `apply_chat_template`. No model code here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from moe_runtime.chat_template import DEFAULT_CHAT_TEMPLATE, compile_chat_template, render_chat
from moe_runtime.model.hf_config import read_json_object
from moe_runtime.model_config import ModelConfig


class ByteTokenizer:
    is_byte_exact = True  # decode(ids) is the UTF-8 of their token_bytes joined

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
        self.chat_template = DEFAULT_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids if self.bos_token_id is None else [self.bos_token_id, *ids]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for in decoded text (special tokens: none)."""
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def is_byte_piece(self, token_id: int) -> bool:
        return 0 <= token_id < 256

    def apply_chat_template(self, messages: list[dict[str, str]], **options: bool) -> list[int]:
        """Token ids of the prompt for `messages`, with the default template (bos first);
        `options`: render_chat's add_generation_prompt and continue_final_message."""
        return self.encode(render_chat(self.chat_template, messages, **options))


class HFTokenizer:
    """`tokenizers.Tokenizer` from `<model dir>/tokenizer.json`; chat template and special
    token strings from `tokenizer_config.json` when present."""

    def __init__(
        self, model_dir: str | Path, bos_token_id: int | None, eos_token_id: int | None
    ) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{tokenizer_file} is not a valid tokenizer file: {exc}") from exc
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        settings = _read_tokenizer_config(model_dir / "tokenizer_config.json")
        is_bos_added = bos_token_id is not None and _adds_bos(
            settings, self._tokenizer, bos_token_id
        )
        self._bos_ids = [bos_token_id] if is_bos_added else []
        template, source, self._template_problem = _chat_template(model_dir, settings)
        self.has_chat_template = bool(template)
        self.chat_template = template or DEFAULT_CHAT_TEMPLATE
        try:
            compile_chat_template(self.chat_template)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        self.bos_token = self._special_text(settings.get("bos_token"), bos_token_id)
        self.eos_token = self._special_text(settings.get("eos_token"), eos_token_id)
        # What transformers gives a template besides bos and eos: the other special strings.
        self._special_tokens = {
            key: text
            for key in _OTHER_SPECIAL_TOKENS
            if (text := self._special_text(settings.get(key), None))
        }
        additional = settings.get("additional_special_tokens")
        if isinstance(additional, list):
            self._special_tokens["additional_special_tokens"] = [
                self._special_text(t, None) for t in additional
            ]
        decoder = self._tokenizer.decoder  # its JSON spec is its pickled state
        spec = None if decoder is None else json.loads(decoder.__getstate__())
        self._is_byte_level = spec is not None and _is_byte_level(spec)
        # decode(ids) is the UTF-8 of their token_bytes joined (invalid bytes replaced) where
        # the decoder is byte-level BPE's alone: DeepSeek's vocabularies. The detokenizer then
        # reads the bytes (engine/detokenizer.py).
        self.is_byte_exact = spec is not None and _is_only_byte_level(spec)
        added = self._tokenizer.get_added_tokens_decoder()
        self._special_ids = {i for i, token in added.items() if token.special}
        self._bytes_of: dict[int, bytes] = {}
        self._context_id = self._pick_context_id()
        self._context_text = self.decode([self._context_id])

    def encode(self, text: str) -> list[int]:
        return [*self._bos_ids, *self._encode(text)]

    def has_token(self, token_id: int) -> bool:
        """Whether token_id is one of the tokenizer's ids (below vocab_size, with a token)."""
        return 0 <= token_id < self.vocab_size and self._tokenizer.id_to_token(token_id) is not None

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for in decoded text, also when they are part of a UTF-8
        character (decode gives "\ufffd" for those): a byte-level vocabulary's piece mapped
        back through the byte alphabet, a byte-fallback piece "<0xHH>" its byte, else the
        UTF-8 of its text after other text (a sentencepiece piece's leading space, which
        decode strips at the text's start). Special tokens (skipped by decode): none. Kept
        per id once found (at most one entry a vocabulary id)."""
        data = self._bytes_of.get(token_id)
        if data is None:
            data = self._bytes_of[token_id] = self._find_bytes(token_id)
        return data

    def is_byte_piece(self, token_id: int) -> bool:
        """Whether token_id is a byte-fallback piece "<0xHH>" (a byte of a character)."""
        return bool(_BYTE_PIECE.fullmatch(self._tokenizer.id_to_token(token_id) or ""))

    def _find_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_ids:
            return b""
        piece = self._tokenizer.id_to_token(token_id) or ""
        if self._is_byte_level and piece and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        text = self.decode([self._context_id, token_id])
        if text.startswith(self._context_text):
            return text[len(self._context_text) :].encode("utf-8")
        return self.decode([token_id]).encode("utf-8")

    def _pick_context_id(self) -> int:
        """A token that decodes to one letter or digit, twice to it twice: what token_bytes
        puts before a token to read its text mid-text (the first id, where none does)."""
        for token_id in range(min(self.vocab_size, 4096)):
            text = self.decode([token_id])
            if len(text) == 1 and text.isalnum() and self.decode([token_id] * 2) == text * 2:
                return token_id
        return 0

    def apply_chat_template(self, messages: list[dict[str, str]], **options: bool) -> list[int]:
        """Token ids of the prompt for `messages`; `options`: render_chat's add_generation_prompt
        and continue_final_message. The model's own template writes its special tokens itself
        (no bos added, as transformers and vLLM encode a chat: one `{{ bos_token }}` is one bos);
        the default template is encoded like any text (bos by the tokenizer's rule)."""
        if self._template_problem is not None:
            raise ValueError(f"messages: {self._template_problem}")
        if not self.has_chat_template:
            return self.encode(render_chat(self.chat_template, messages, **options))
        specials = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **self._special_tokens,
        }
        text = render_chat(self.chat_template, messages, **options, **specials)
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        """The text's ids. encode_batch, not encode: the library releases Python's lock only
        there, so a long prompt tokenized in a worker thread no longer holds up the event loop
        and the engine's thread for the whole encode (5 MB: 3.6 s)."""
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def _special_text(self, configured, token_id: int | None) -> str:
        if isinstance(configured, dict):
            configured = configured.get("content")
        if isinstance(configured, str):
            return configured
        return "" if token_id is None else self._tokenizer.id_to_token(token_id) or ""


def _byte_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet (GPT-2's, used by DeepSeek's
    tokenizers): printable Latin-1 bytes stand for themselves, the other 68 bytes for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {
        **{chr(b): b for b in printable},
        **{chr(256 + n): b for n, b in enumerate(others)},
    }


_BYTE_OF_CHAR = _byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _is_byte_level(decoder: dict) -> bool:
    """Whether a decoder's spec (tokenizer.json's "decoder") is ByteLevel or a sequence
    holding one."""
    parts = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts or ())


def _is_only_byte_level(decoder: dict) -> bool:
    """Whether a decoder's spec is ByteLevel, or a sequence of ByteLevel alone."""
    parts = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    return bool(parts) and all(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)


# The files of a model directory a tokenizer is read from (HFTokenizer, _chat_template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


# Files of a tokenizer this runtime does not read (a sentencepiece or tiktoken model, a
# vocabulary and its merges) or does not read without tokenizer.json (its config, its template).
_UNREAD_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "chat_template.jinja",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


def load_tokenizer(model_config: ModelConfig) -> ByteTokenizer | HFTokenizer:
    """HFTokenizer for a model directory with tokenizer.json, else the byte-level fallback;
    ValueError for a directory with another tokenizer's files alone: the model's tokenizer is
    there, and bytes in its place would feed it ids it never learned, without a word."""
    bos, eos = model_config.bos_token_id, model_config.eos_token_id
    directory = Path(model_config.path) if model_config.path else None
    if directory is not None and (directory / "tokenizer.json").is_file():
        tokenizer = HFTokenizer(directory, bos, eos)
        if tokenizer.vocab_size > model_config.vocab_size:
            raise ValueError(
                f"{model_config.path}/tokenizer.json has {tokenizer.vocab_size} tokens, more "
                f"than model.vocab_size={model_config.vocab_size}"
            )
        _check_special_ids(tokenizer, model_config, directory)
        return tokenizer
    unread = (
        []
        if directory is None
        else [name for name in _UNREAD_TOKENIZER_FILES if (directory / name).is_file()]
    )
    if unread:
        raise ValueError(
            f"model.path={model_config.path} holds {', '.join(unread)} but no tokenizer.json, "
            "the one tokenizer file the runtime reads; write it with transformers: "
            "AutoTokenizer.from_pretrained(path).save_pretrained(path)"
        )
    return ByteTokenizer(model_config.vocab_size, bos, eos)


def _check_special_ids(tokenizer: HFTokenizer, model_config: ModelConfig, directory: Path) -> None:
    """Every bos and eos id the model directory's configs give is a token of tokenizer.json,
    else a ValueError naming the file, the key and the id, never clamped: an id the tokenizer
    lacks has no text (a chat template's bos_token/eos_token came out empty, an encoded text's
    bos was one the tokenizer never wrote), so the configs are another tokenizer's."""
    generation_file = directory / "generation_config.json"
    config_file = directory / "config.json"
    # generation_eos_token_ids: generation_config.json's, or config.json's list without it
    generation_source = generation_file if generation_file.is_file() else config_file
    named = [
        (config_file, "bos_token_id", model_config.bos_token_id),
        (config_file, "eos_token_id", model_config.eos_token_id),
        *((generation_source, "eos_token_id", i) for i in model_config.generation_eos_token_ids),
    ]
    for file, key, token_id in named:
        if token_id is not None and not tokenizer.has_token(token_id):
            raise ValueError(
                f"{file}: {key} {token_id} is refused: {directory / 'tokenizer.json'} has no "
                f"token {token_id} (its {tokenizer.vocab_size} tokens), so the two files are "
                "not of one model"
            )


_OTHER_SPECIAL_TOKENS = ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _read_tokenizer_config(path: Path) -> dict:
    return read_json_object(path) if path.is_file() else {}


def _adds_bos(settings: dict, tokenizer, bos_token_id: int) -> bool:
    """Whether encoding text puts bos first, as transformers encodes it: tokenizer_config.json's
    `add_bos_token` where it is a bool, else whether the tokenizer's post-processor adds it
    (what it makes of no text: its special tokens alone)."""
    configured = settings.get("add_bos_token")
    if isinstance(configured, bool):
        return configured
    return tokenizer.encode("", add_special_tokens=True).ids[:1] == [bos_token_id]


def _chat_template(model_dir: Path, settings: dict) -> tuple[str | None, str, str | None]:
    """(the model's chat template or None, the file it came from, why chat cannot be served
    or None). `chat_template.jinja` (where transformers saves it now), else tokenizer_config.json's
    `chat_template` (a string, or a list of named templates: the one named "default"). The file
    wins where both are there, as in transformers, so that both build the same prompt."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file), None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{jinja_file} is not UTF-8 text: {exc}") from None
    config_file = str(model_dir / "tokenizer_config.json")
    template = settings.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:  # transformers refuses to guess too
            names = sorted(map(str, named))
            problem = f"{config_file} holds chat templates {names} and none named 'default'"
            return None, config_file, problem
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(
            f"{config_file}: chat_template must be a string or a list of named templates, "
            f"got {type(template).__name__}"
        )
    return template or None, config_file, None
