"""The OpenAI logprobs blocks on non-ASCII text: chat `bytes` are each token's own bytes (joined,
the text's UTF-8), completion `text_offset` points at each token's place in the text (also
across streamed chunks that split a character), and completion `top_logprobs` hold the sampled
token, as OpenAI's legacy completions do. Tokenizers: the byte-level fallback, a byte-level BPE
trained here (characters it never saw are split into byte tokens) and a byte-fallback vocabulary.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models

from launch.completions import _Choices
from launch.openai.render import TextOffsets, chat_logprobs, completion_logprobs
from moe_runtime.engine.outputs import CompletionOutput, RequestOutput
from moe_runtime.tokenizer import ByteTokenizer, HFTokenizer
from tests.checkpoints import write_byte_level_bpe, write_sentencepiece_like

TEXT = "héllo wörld 日本 ñ€x"


def _byte_level_bpe(directory) -> HFTokenizer:
    """Trained on ASCII words only: é, ö, 日, 本, ñ and € become one token a byte."""
    write_byte_level_bpe(directory, "hello world hllo wrld x")
    return HFTokenizer(directory, bos_token_id=None, eos_token_id=None)


def _byte_fallback(directory) -> tuple[HFTokenizer, list[int]]:
    """A vocabulary of "caf" and the byte pieces of é (<0xC3>, <0xA9>): "café" is 3 tokens."""
    vocab = {"[UNK]": 0, "caf": 1, "<0xC3>": 2, "<0xA9>": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.ByteFallback()
    tokenizer.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory, bos_token_id=None, eos_token_id=None), [1, 2, 3]


@pytest.fixture(params=["bytes", "byte_level_bpe"])
def tokenized(request, tmp_path):
    if request.param == "bytes":
        tokenizer = ByteTokenizer(vocab_size=260)
    else:
        tokenizer = _byte_level_bpe(tmp_path)
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    split = [i for i in ids if tokenizer.decode([i]) == "\ufffd"]
    assert len(split) >= 10, "engagement: characters split over tokens"
    return tokenizer, ids


def _output(ids: list[int]) -> CompletionOutput:
    return CompletionOutput(
        index=0,
        text=TEXT,
        token_ids=ids,
        logprobs=[-1.0] * len(ids),
        top_logprobs=[{} for _ in ids],
        finish_reason="length",
        seed=0,
    )


def test_chat_bytes_are_the_tokens_own(tokenized):
    """Joined, the entries' bytes are the text's UTF-8 (decode's "\ufffd" gave EF BF BD for
    every piece of a character)."""
    tokenizer, ids = tokenized
    entries = chat_logprobs(_output(ids), tokenizer)["content"]
    assert bytes(b for entry in entries for b in entry["bytes"]) == TEXT.encode("utf-8")


def test_byte_fallback_pieces_are_their_bytes(tmp_path):
    tokenizer, ids = _byte_fallback(tmp_path)
    assert tokenizer.decode(ids) == "café"
    assert [tokenizer.token_bytes(i) for i in ids] == [b"caf", b"\xc3", b"\xa9"]


def test_sentencepiece_tokens_joined_give_the_text(tmp_path):
    """Each token decoded alone lost the space of its sentencepiece piece (decode strips it
    at the text's start): tokens joined read "isafox", chat bytes joined were not the
    text's UTF-8, and text_offset drifted one a word."""
    space = "\u2581"
    vocab = write_sentencepiece_like(tmp_path, tuple(space + w for w in ("hello", "is", "fox", "")))
    tokenizer = HFTokenizer(tmp_path, bos_token_id=1, eos_token_id=2)
    prompt = [1, vocab[space + "hello"]]
    pieces = [space + "is", "a", space, space + "fox", "<0x21>", "<0xC3>", "<0xA9>"]
    ids = [vocab[p] for p in pieces]
    text = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
    assert text == " isa  fox!é"
    block = completion_logprobs(ids, [-1.0] * 7, [{}] * 7, tokenizer, TextOffsets())
    assert block["tokens"] == [" is", "a", " ", " fox", "!", "\ufffd", "\ufffd"]
    assert block["text_offset"] == [0, 3, 4, 5, 9, 10, 10]
    entries = chat_logprobs(dataclasses.replace(_output(ids), text=text), tokenizer)["content"]
    assert bytes(b for entry in entries for b in entry["bytes"]) == text.encode("utf-8")


def test_echoed_sentencepiece_prompt_offsets_start_where_its_text_does(tmp_path):
    """An echoed prompt's text drops its first piece's space; its tokens' bytes have it, and
    every offset after it pointed one character late (" Paris" at 15 of "The capital is
    Paris")."""
    space = "\u2581"
    words = tuple(space + w for w in ("The", "capital", "is", "Paris"))
    vocab = write_sentencepiece_like(tmp_path, words)
    tokenizer = HFTokenizer(tmp_path, bos_token_id=1, eos_token_id=2)
    prompt = [1, *(vocab[w] for w in words[:3])]
    body = SimpleNamespace(echo=True, n=1, logprobs=0)
    choices = _Choices(body, ["The capital is"], tokenizer, [None])
    out = dataclasses.replace(_output([vocab[space + "Paris"]]), text=" Paris", top_logprobs=[{}])
    whole = RequestOutput("r", prompt, [out], True)
    (choice,) = choices(0, whole)
    assert choice["text"] == "The capital is Paris"
    starts = [choice["text"].index(w) for w in ("The", "capital", "is P", "Paris")]
    assert choice["logprobs"]["text_offset"] == [0, 0, starts[1] - 1, starts[2] - 1, starts[3] - 1]


def _first_offsets(tokenizer, ids: list[int]) -> dict[int, int]:
    """Token index -> where its text starts, for tokens that start a character (or several)."""
    offsets, position = {}, 0
    for k, token_id in enumerate(ids):
        piece = tokenizer.token_bytes(token_id)
        if piece and (piece[0] & 0xC0) != 0x80:  # not a continuation byte: a char starts here
            offsets[k] = len(TEXT.encode("utf-8")[:position].decode("utf-8"))
        position += len(piece)
    return offsets


@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_text_offsets_point_into_the_text(tokenized, chunk):
    """Every token starting a character has that character's offset; a character's later
    pieces share its start; no offset passes the text's end. Streamed in chunks of 1 or 3
    tokens (characters split between chunks) the offsets are the whole response's."""
    tokenizer, ids = tokenized
    offsets = TextOffsets()
    if chunk is None:
        got = offsets.take(ids, tokenizer)
    else:
        got = [
            o
            for i in range(0, len(ids), chunk)
            for o in offsets.take(ids[i : i + chunk], tokenizer)
        ]
    for k, start in _first_offsets(tokenizer, ids).items():
        assert got[k] == start, (k, got[k], start)
    assert got == sorted(got) and got[-1] < len(TEXT)
    assert got[-1] == TEXT.index("x")


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([0xE4, 0xB8, 0x61, 0x67], [0, 0, 1, 2]),  # "\ufffdag": the start of a character, cut
        ([0xF0, 0x9F, 0x78], [0, 0, 1]),
        ([0xE4, 0xE4, 0xE4, 0xF0, 0x9F, 0x98, 0x80, 0x21], [0, 1, 2, 3, 3, 3, 3, 4]),
        ([0xF0, 0x80, 0x41], [0, 1, 2]),  # each byte invalid: a U+FFFD each
        ([0xE4, 0xB8, 0xAD, 0x61], [0, 0, 0, 1]),  # "中a"
        ([0xED, 0xA0, 0x61], [0, 1, 2]),  # a surrogate's start: Python's decoder holds it
    ],
)
def test_a_token_after_invalid_bytes_points_past_their_replacement_characters(ids, expected):
    """The U+FFFD of bytes that a token shows invalid comes before the token in the text: the
    token's offset was taken before its first byte released it (the 'a' of "\ufffdag" at 0)."""
    assert TextOffsets().take(ids, ByteTokenizer(vocab_size=260)) == expected


def test_every_ascii_token_points_at_its_own_character_among_random_bytes():
    tokenizer, rng = ByteTokenizer(vocab_size=260), random.Random(4)
    pool = [0x61, 0x20, 0xC3, 0xA9, 0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0xEF, 0xBF, 0xBD]
    for _ in range(2000):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 16))]
        text, offsets = tokenizer.decode(ids), TextOffsets().take(ids, tokenizer)
        assert offsets == sorted(offsets) and all(o <= len(text) for o in offsets)
        for token_id, offset in zip(ids, offsets, strict=True):
            if token_id < 0x80:
                assert text[offset] == chr(token_id), ([hex(i) for i in ids], offsets)


def test_completion_top_logprobs_hold_the_sampled_token():
    """OpenAI: the sampled token's logprob is always among top_logprobs (logprobs + 1 entries
    at most); top_logprob_ids stay the engine's exact top-k."""
    tokenizer = ByteTokenizer(vocab_size=260)
    ids = tokenizer.encode("ab")
    tops = [{ord("b"): -0.5}, {ord("b"): -0.1}]  # the first token's top-1 is not the sampled one
    block = completion_logprobs(ids, [-2.0, -0.1], tops, tokenizer, TextOffsets())
    assert block["top_logprobs"] == [{"b": -0.5, "a": -2.0}, {"b": -0.1}]
    assert block["top_logprob_ids"] == tops
    zero = completion_logprobs(ids, [-2.0, -0.1], [{}, {}], tokenizer, TextOffsets())
    assert zero["top_logprobs"] == [{"a": -2.0}, {"b": -0.1}]  # logprobs=0: the sampled alone


def test_every_choice_carries_its_own_samples_weight_versions():
    """A choice (completion or chat, whole or streamed) says the weight versions of its own
    sample: the body's (and a streamed chunk's) are the newest and oldest over the request's
    samples, so with n = 2 across an update a sample run wholly on version 1 was sent as
    first_weight_version 0, and an RL client could not tell which sample mixed versions."""
    from launch.openai.render import chat_choice, completion_choice

    tokenizer = ByteTokenizer(vocab_size=300)
    out = CompletionOutput(
        index=1, token_ids=[104, 105], logprobs=[-0.5, -0.25], top_logprobs=[{}, {}],
        text="hi", finish_reason=None, seed=4, weight_version=1, first_weight_version=1,
    )  # fmt: skip
    for choice in (
        completion_choice(1, out, tokenizer, None),
        chat_choice("delta", {"content": "hi"}, out, tokenizer, False),
    ):
        assert (choice["weight_version"], choice["first_weight_version"]) == (1, 1)
    mixed = dataclasses.replace(out, first_weight_version=0)
    assert completion_choice(1, mixed, tokenizer, None)["first_weight_version"] == 0


@pytest.mark.parametrize("stop_reason", [None, "\n\n", 257])
def test_every_choice_carries_its_stop_reason(stop_reason):
    """vLLM's `stop_reason` (the stop string or token id that ended a "stop", else null) in
    every completion and chat choice, whole or streamed; it was no field of the response."""
    from launch.openai.render import chat_choice, completion_choice

    tokenizer = ByteTokenizer(vocab_size=300)
    out = CompletionOutput(
        index=0, token_ids=[104], logprobs=[-0.5], top_logprobs=[{}], text="h",
        finish_reason="stop", seed=4, stop_reason=stop_reason,
    )  # fmt: skip
    for choice in (
        completion_choice(0, out, tokenizer, None),
        chat_choice("message", {"content": "h"}, out, tokenizer, False),
        chat_choice("delta", {"content": "h"}, out, tokenizer, False),
    ):
        assert choice["stop_reason"] == stop_reason
