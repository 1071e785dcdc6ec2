"""The incremental detokenizer: its text is the tokenizer's decode of the whole output (invalid
and split UTF-8 bytes, byte-level BPE, sentencepiece spaces after the prompt), and stop strings:
where a sample stops and what text it holds back, against their definitions on the whole text,
at any stop-string length."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest

from moe_runtime.engine.detokenizer import IncrementalDetokenizer
from moe_runtime.tokenizer import ByteTokenizer, HFTokenizer
from tests.checkpoints import write_byte_level_bpe, write_sentencepiece_like

TOKENIZER = ByteTokenizer(512)


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """The longest k < len(s), over the stop strings s, with text ending in s's first k chars."""
    return max(
        (k for s in stop for k in range(min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
        default=0,
    )


def _run(text: str, stop: tuple[str, ...], rng: random.Random) -> tuple[list[str], int | None]:
    """Feed text's bytes one to three tokens at a time; -> each update's delta, checked at
    every update against the definitions (the text stops before the stop string that is whole
    first, reading the whole text a character at a time; of those whole at one character, the
    longest)."""
    detok, ids, deltas = IncrementalDetokenizer(TOKENIZER, stop), [], []
    while len(ids) < len(text):
        ids += [ord(c) for c in text[len(ids) : len(ids) + rng.randint(1, 3)]]
        is_stopped = detok.update(ids)
        seen = text[: len(ids)]
        assert is_stopped == any(s in seen for s in stop)
        assert detok.stop_index == _first_stop(seen, stop)
        deltas.append(detok.delta(is_final=is_stopped))
        if is_stopped:
            assert "".join(deltas) == seen[: detok.stop_index]
            return deltas, detok.stop_index
        assert "".join(deltas) == seen[: len(seen) - _held_back(seen, stop)]
    return deltas, None


def _first_stop(text: str, stop: tuple[str, ...]) -> int | None:
    """Where text stops: before the stop string whose first occurrence ends first (the longest
    of those ending there), or None."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stop if s in text]
    return sum(min(ends)) if ends else None


def test_stops_and_held_back_text_follow_their_definitions():
    rng = random.Random(0)
    num_stopped = 0
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 30)))
        stop = tuple(
            "".join(rng.choice("abc") for _ in range(rng.randint(1, 6)))
            for _ in range(rng.randint(1, 3))
        )
        num_stopped += _run(text, stop, rng)[1] is not None
    assert 500 < num_stopped < 2900  # both outcomes are exercised


def test_text_is_held_until_it_cannot_start_a_stop_string_then_cut_before_it():
    deltas, stop_index = _run("xyabcabcdz", ("abcd",), _OneTokenAtATime())
    assert deltas == ["x", "y", "", "", "", "abc", "", "", ""] and stop_index == 5


@pytest.mark.parametrize("tokens", [["abc", "d"], ["ab", "cd"], ["abcd"], list("abcd")])
def test_where_text_stops_does_not_depend_on_how_it_was_cut_into_tokens(tokens):
    """The earliest start of every stop string found in a token's new text was the cut: "abcd"
    against ("bc", "abcd") gave "a" read as "abc", "d" but "" read as one token ("bc" is whole
    first, at "c", where one character at a time stops)."""
    detok, ids = IncrementalDetokenizer(TOKENIZER, ("bc", "abcd")), []
    for token in tokens:
        ids += [ord(c) for c in token]  # a token of several characters
        if detok.update(ids):
            break
    assert detok.stop_index == 1 and detok.text == "a" and detok.delta(is_final=True) == "a"


def test_long_stop_strings_cost_time_linear_in_the_text():
    """32 stop strings of 1024 characters (the HTTP limits) whose every start the text almost
    matches: comparing each start of each string against the text's tail again on every
    token took 1.6 ms a token (4.8 s for these 3,069 on the development machine, against
    0.03 s now); the automata take each new character once."""
    stop = tuple("x" * 1022 + "y" + chr(ord("A") + i) for i in range(32))
    detok = IncrementalDetokenizer(TOKENIZER, stop)
    ids: list[int] = []
    started = time.perf_counter()
    for char in ("x" * 1022 + "y") * 3:
        ids.append(ord(char))
        assert not detok.update(ids)
        detok.delta(is_final=False)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("stop", [(), ("ab",)])
def test_a_token_copies_no_text_however_long_the_text(stop):
    """A token's update and delta allocate no copy of the text so far: `self._text += new` on
    an attribute copied all of it on every token (a 128k-character text took 5 us a token
    where a short one took 2.7), and a delta holding back a stop string's start copied it
    again. Measured in bytes (tracemalloc's peak), not time: a 200k-character text, then one
    token, with the text ending in a stop string's first character where there is one."""
    detok, ids = IncrementalDetokenizer(TOKENIZER, stop), [ord("x")] * 200_000
    detok.update(ids)
    detok.delta(is_final=False)
    ids.append(ord("a"))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        detok.update(ids)
        assert detok.delta(is_final=False) == ("" if stop else "a")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < 20_000, peak  # the text is 200 kB (its copy at least)
    assert detok.text == "x" * 200_000 + "a"


def _streamed(tokenizer, ids: list[int], rng: random.Random, prompt=()) -> tuple[str, str]:
    """ids fed one to three tokens at a time, the last update final; -> (text, deltas joined)."""
    detok, deltas, num_fed = IncrementalDetokenizer(tokenizer, (), prompt), [], 0
    while num_fed < len(ids):
        num_fed = min(len(ids), num_fed + rng.randint(1, 3))
        detok.update(ids[:num_fed], is_final=num_fed == len(ids))
        deltas.append(detok.delta(is_final=num_fed == len(ids)))
    return detok.text, "".join(deltas)


# Lead bytes of 2-, 3- and 4-byte characters, continuation bytes, ASCII, U+FFFD's own bytes
# (EF BF BD) and special ids: characters split over tokens, cut short, or invalid.
BYTE_POOL = [0x61, 0x20, 0xC3, 0xA9, 0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0xEF, 0xBF, 0xBD]


@pytest.mark.parametrize(
    "ids",
    [
        [0xE4, 0xE4, 0xE4, 0xF0, 0x9F, 0x98, 0x80, 0x21],  # "\ufffd" x 3, then an emoji
        [*"\ufffd中".encode(), *"x\ufffd😀y".encode()],  # the text's own U+FFFDs
    ],
)
def test_a_character_after_invalid_bytes_is_not_lost(ids):
    """The text waited up to 4 tokens for a U+FFFD to complete, then took it as is, and the
    character that completed later was dropped ("\ufffd\ufffd\ufffd\ufffd!" here)."""
    tokenizer = ByteTokenizer(512)
    assert _streamed(tokenizer, ids, _OneTokenAtATime()) == (tokenizer.decode(ids),) * 2


def test_byte_text_is_the_decode_of_the_whole_output():
    tokenizer, rng = ByteTokenizer(512), random.Random(1)
    for _ in range(3000):
        ids = [rng.choice([*BYTE_POOL, 300]) for _ in range(rng.randint(1, 24))]
        assert _streamed(tokenizer, ids, rng) == (tokenizer.decode(ids),) * 2, ids


def test_byte_level_bpe_text_is_the_decode_of_the_whole_output(tmp_path):
    """DeepSeek's kind of vocabulary, with special tokens (decode skips them): read from its
    tokens' bytes, the text is exactly the library's decode of the whole output."""
    write_byte_level_bpe(tmp_path, "hello world héllo 日本", special_tokens=("<eos>", "<pad>"))
    tokenizer = HFTokenizer(tmp_path, bos_token_id=None, eos_token_id=None)
    assert tokenizer.is_byte_exact
    rng = random.Random(2)
    for _ in range(1500):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 24))]
        assert _streamed(tokenizer, ids, rng) == (tokenizer.decode(ids),) * 2, ids


def test_sentencepiece_spaces_after_the_prompt_are_kept(tmp_path):
    """A sentencepiece vocabulary's decoder strips the space of the text's first piece; the
    output's first piece is not the text's first: its window starts in the prompt. Without
    the prompt the completion of "The capital is" was "Paris is the fox!", no space."""
    space = "\u2581"
    words = tuple(space + w for w in ("The", "capital", "is", "Paris", "the", "fox"))
    vocab = write_sentencepiece_like(tmp_path, words)
    tokenizer = HFTokenizer(tmp_path, bos_token_id=1, eos_token_id=2)
    assert not tokenizer.is_byte_exact
    prompt = [1, *(vocab[space + w] for w in ("The", "capital", "is"))]
    by_bytes = [vocab[f"<0x{b:02X}>"] for b in "! é 日本!".encode()]  # byte-fallback pieces
    pieces = [vocab[space + w] for w in ("Paris", "is", "the", "fox")]
    for ids in [pieces + by_bytes[:1], pieces[:1] + by_bytes]:
        whole = tokenizer.decode(prompt + ids)
        expected = whole[len(tokenizer.decode(prompt)) :]
        assert expected.startswith(" Paris")
        assert _streamed(tokenizer, ids, random.Random(3), prompt) == (expected, expected)


def test_sentencepiece_window_keeps_context_after_a_special_token_and_holds_byte_runs(tmp_path):
    """A window started at the tokens just read: after a special token (decode skips it) the
    next piece came first in its window and lost its space (" theis"). A byte-fallback run is
    held until it ends: the library turns a whole run to U+FFFD once it is invalid, and text
    handed out before ("€") was kept and the run added again, so a stop string could fire on
    text the final decode never shows."""
    space = "\u2581"
    vocab = write_sentencepiece_like(tmp_path, tuple(space + w for w in ("The", "the", "is")))
    tokenizer = HFTokenizer(tmp_path, bos_token_id=1, eos_token_id=2)
    prompt = [1, vocab[space + "The"]]
    euro_then_bad = [vocab[f"<0x{b:02X}>"] for b in (0xE2, 0x82, 0xAC, 0x80)]
    cases = [
        [vocab[space + "the"], 2, vocab[space + "is"]],  # 2: </s>, special
        [vocab[space + "the"], *euro_then_bad, vocab[space + "is"]],
        # A special token inside a run: decode drops it, then joins the run ("A" turned U+FFFD).
        [vocab["<0x41>"], 2, vocab["<0xF0>"], vocab[space + "is"]],
    ]
    for ids in cases:
        expected = tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)) :]
        assert _streamed(tokenizer, ids, _OneTokenAtATime(), prompt) == (expected, expected)
        detok = IncrementalDetokenizer(tokenizer, ("€",), prompt)
        for k in range(1, len(ids) + 1):
            detok.update(ids[:k], is_final=k == len(ids))
        assert detok.stop_index is None and detok.text == expected


class _OneTokenAtATime(random.Random):
    def randint(self, a: int, b: int) -> int:
        return 1


def test_include_stop_str_keeps_the_stop_string_and_holds_nothing_back():
    """include_stop_str (vLLM's include_stop_str_in_output): the text ends after the stop
    string, whatever the tokens' boundaries, and each token's text goes out at once (no part
    of a stop string is ever cut, so none is held)."""
    detok = IncrementalDetokenizer(TOKENIZER, ("abcd",), include_stop_str=True)
    ids, deltas = [], []
    for char in "xyabcabcdz":
        ids.append(ord(char))
        is_stopped = detok.update(ids)
        deltas.append(detok.delta(is_final=is_stopped))
        if is_stopped:
            break
    assert deltas == list("xyabcabcd") and detok.text == "xyabcabcd"
    assert (detok.stop_index, detok.stop_string) == (5, "abcd")
    whole = IncrementalDetokenizer(TOKENIZER, ("bc", "abcd"), include_stop_str=True)
    assert whole.update([ord(c) for c in "xabcdz"], is_final=True)
    assert whole.text == whole.delta(is_final=True) == "xabc"  # "bc" is whole first
