"""What ends a sample, end to end on the tiny model: `stop_reason` names the stop string or
stop token id that ended it (None for EOS and length)."""

from __future__ import annotations

import pytest

from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG

PROMPT = [72, 101, 108, 108, 111]
GREEDY = {"temperature": 0.0, "max_tokens": 20}


@pytest.fixture(scope="module")
def llm():
    llm = LLM(TINY_CONFIG)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def free_run(llm) -> list[int]:
    """The prompt's greedy tokens with nothing ending them but the length."""
    return llm.generate([PROMPT], SamplingParams(ignore_eos=True, **GREEDY))[0].token_ids


def _first_new_char(llm, token_ids: list[int]) -> tuple[int, str]:
    """(k, c): the first token k > 0 whose text is one printable character not in the text
    before it, so a stop on it (string or id) ends the sample at token k."""
    decode = llm.tokenizer.decode
    return next(
        (k, text)
        for k, t in enumerate(token_ids)
        if k > 0
        and len(text := decode([t])) == 1
        and text.isprintable()
        and text not in decode(token_ids[:k])
    )


def test_stop_reason_names_the_stop_string_or_token_id(llm, free_run):
    k, char = _first_new_char(llm, free_run)
    by_string = llm.generate([PROMPT], SamplingParams(stop=["never", char], **GREEDY))[0]
    assert by_string.token_ids == free_run[: k + 1]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", char)
    by_id = llm.generate([PROMPT], SamplingParams(stop_token_ids=[free_run[k]], **GREEDY))[0]
    assert by_id.token_ids == free_run[: k + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", free_run[k])
    assert type(by_id.stop_reason) is int
    # The last allowed token completing a stop string: a stop by that string.
    last = llm.generate([PROMPT], SamplingParams(stop=[char], temperature=0.0, max_tokens=k + 1))
    assert (last[0].finish_reason, last[0].stop_reason) == ("stop", char)
    length = llm.generate([PROMPT], SamplingParams(**GREEDY))[0]
    assert (length.finish_reason, length.stop_reason) == ("length", None)


def test_eos_has_no_stop_reason_even_when_also_a_stop_token_id(free_run):
    eos = free_run[4]
    llm = LLM(TINY_CONFIG, **{"model.eos_token_id": eos})
    try:
        for stop_ids in ((), (eos,)):
            out = llm.generate([PROMPT], SamplingParams(stop_token_ids=stop_ids, **GREEDY))[0]
            assert out.token_ids == free_run[: free_run.index(eos) + 1]
            assert (out.finish_reason, out.stop_reason) == ("stop", None)
    finally:
        llm.shutdown()
