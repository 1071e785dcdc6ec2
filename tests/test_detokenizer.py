"""Stop strings in the incremental detokenizer: where a sample stops and what text it holds back,
against their definitions on the whole text, at any stop-string length."""

from __future__ import annotations

import random
import time

from moe_runtime.engine.detokenizer import IncrementalDetokenizer
from moe_runtime.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer(512)


def _held_back(text: str, stop: tuple[str, ...]) -> int:
    """The longest k < len(s), over the stop strings s, with text ending in s's first k chars."""
    return max(
        (k for s in stop for k in range(min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
        default=0,
    )


def _run(text: str, stop: tuple[str, ...], rng: random.Random) -> tuple[list[str], int | None]:
    """Feed text's bytes one to three tokens at a time; -> each update's delta, checked at
    every update against the definitions (before the first stop string appears in the whole
    text, every occurrence of one ends in the new characters: the first such start is where
    the text stops)."""
    detok, ids, deltas = IncrementalDetokenizer(TOKENIZER, stop), [], []
    while len(ids) < len(text):
        ids += [ord(c) for c in text[len(ids) : len(ids) + rng.randint(1, 3)]]
        is_stopped = detok.update(ids)
        seen = text[: len(ids)]
        starts = [i for i in (seen.find(s) for s in stop) if i >= 0]
        assert is_stopped == bool(starts) and detok.stop_index == min(starts, default=None)
        deltas.append(detok.delta(is_final=is_stopped))
        if is_stopped:
            assert "".join(deltas) == seen[: detok.stop_index]
            return deltas, detok.stop_index
        assert "".join(deltas) == seen[: len(seen) - _held_back(seen, stop)]
    return deltas, None


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


class _OneTokenAtATime(random.Random):
    def randint(self, a: int, b: int) -> int:
        return 1
