"""What ends a sample, end to end on the tiny model: `stop_reason` names the stop string or
stop token id that ended it (None for EOS and length); `min_tokens` holds EOS, stop ids and
stop strings off until a sample has that many tokens, bit for bit alone or in any batch;
`include_stop_str_in_output` keeps the stop string (or stop id's text) in the text."""

from __future__ import annotations

import json

import pytest

from moe_runtime import LLM, SamplingParams
from moe_runtime.worker.sampler import Sampler
from tests.invariance import TINY_CONFIG, mixed_prompts, random_sub_batches, run_in_batches
from tests.serving import write_checkpoint

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


def test_generation_configs_eos_ids_end_a_sample_unless_ignore_eos(tmp_path):
    """transformers' generate stops on each eos_token_id of generation_config.json (an int or a
    list): a chat model's end-of-turn id there, not config.json's eos, ended no turn. EOS like
    config.json's: no stop_reason, run past with ignore_eos, held off before min_tokens."""
    pytest.importorskip("transformers")
    config = {
        "model": {"path": write_checkpoint(tmp_path, seed=0)},
        "scheduler": {"max_model_len": 64},
    }
    (tmp_path / "generation_config.json").unlink()
    llm = LLM(config)
    free_run = llm.generate([PROMPT], SamplingParams(ignore_eos=True, **GREEDY))[0].token_ids
    llm.shutdown()
    eos = llm.config.model.eos_token_id
    k = next(k for k in range(1, 20) if free_run[k] not in (eos, *free_run[:k]))
    assert eos not in free_run[:k]  # (else config.json's eos would end the sample first)
    for eos_ids in (free_run[k], [eos, free_run[k]]):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
        llm = LLM(config)
        try:
            out = llm.generate([PROMPT], SamplingParams(**GREEDY))[0]
            assert out.token_ids == free_run[: k + 1]
            assert (out.finish_reason, out.stop_reason) == ("stop", None)
            ignored = llm.generate([PROMPT], SamplingParams(ignore_eos=True, **GREEDY))[0]
            assert ignored.token_ids == free_run
            held = llm.generate([PROMPT], SamplingParams(min_tokens=k + 1, **GREEDY))[0]
            assert held.token_ids[:k] == free_run[:k] and held.token_ids[k] != free_run[k]
        finally:
            llm.shutdown()


def test_min_tokens_goes_on_past_eos_stop_ids_and_stop_strings(free_run):
    """Greedy, this prompt ends on EOS at token 4; with min_tokens 8 the EOS is held off there
    (the next best is taken) and the sample runs on, to EOS again once it may."""
    eos = free_run[4]
    llm = LLM(TINY_CONFIG, **{"model.eos_token_id": eos})
    try:
        ended = llm.generate([PROMPT], SamplingParams(**GREEDY))[0]
        assert ended.token_ids == free_run[:5] and ended.finish_reason == "stop"
        out = llm.generate([PROMPT], SamplingParams(min_tokens=8, logprobs=2, **GREEDY))[0]
        assert out.token_ids[:4] == free_run[:4] and eos not in out.token_ids[:8]
        assert len(out.token_ids) > 8
        assert out.finish_reason == ("stop" if out.token_ids[-1] == eos else "length")
        # Raw logprobs (the default mode): the model's own, EOS still among the tops.
        assert eos in out.top_logprobs[4] and out.top_logprobs[4][eos] > out.logprobs[4]
        # A stop id first taken at token k: a stop there with min_tokens k, held off with k + 1.
        k = next(k for k in range(1, 4) if out.token_ids[k] not in out.token_ids[:k])
        stop_id = out.token_ids[k]
        for min_tokens in (k, k + 1):
            by_id = SamplingParams(min_tokens=min_tokens, stop_token_ids=[stop_id], **GREEDY)
            again = llm.generate([PROMPT], by_id)[0]
            assert again.token_ids[:k] == out.token_ids[:k]
            assert (again.token_ids[k] == stop_id) == (min_tokens == k)
            assert (again.stop_reason == stop_id) == (min_tokens == k)
    finally:
        llm.shutdown()
    plain = LLM(TINY_CONFIG)
    try:
        k, char = _first_new_char(plain, free_run)
        stopped = plain.generate([PROMPT], SamplingParams(stop=[char], **GREEDY))[0]
        assert stopped.token_ids == free_run[: k + 1]
        held = plain.generate([PROMPT], SamplingParams(stop=[char], min_tokens=k + 1, **GREEDY))
        assert held[0].token_ids[: k + 2] == free_run[: k + 2]  # no stop at token k
        assert char in held[0].text
    finally:
        plain.shutdown()


NUM = 6


def _workload(llm) -> tuple[list[list[int]], list[SamplingParams]]:
    """Even prompts greedy, odd ones sampled with processed logprobs; the first four hold off,
    until token 4, a stop id each would otherwise take at token 1 (its free run's), the last
    two have no min_tokens (and stop there)."""
    prompts = mixed_prompts(NUM, 4, 40, seed=3)
    base = [
        {"temperature": 0.0}
        if i % 2 == 0
        else {"temperature": 0.9, "top_k": 50, "seed": 100 + i, "logprobs_mode": "processed"}
        for i in range(NUM)
    ]
    free = llm.generate(prompts, [SamplingParams(max_tokens=10, **b) for b in base])
    params = [
        SamplingParams(
            max_tokens=10,
            logprobs=3,
            stop_token_ids=[free[i].token_ids[1]],
            min_tokens=4 if i < 4 else 0,
            **base[i],
        )
        for i in range(NUM)
    ]
    return prompts, params


def _alone_and_batched(llm) -> tuple[dict, dict, dict, list[SamplingParams]]:
    prompts, params = _workload(llm)
    alone = run_in_batches(llm, prompts, params, [[i] for i in range(NUM)])
    together = run_in_batches(llm, prompts, params, [list(range(NUM))])
    mixed = run_in_batches(llm, prompts, params, random_sub_batches(NUM, seed=1, max_size=3))
    return alone, together, mixed, params


def test_min_tokens_is_batch_invariant():
    """A request's tokens and logprobs alone equal its own in a batch of requests with and
    without min_tokens (engagement: the held-off stop id would have ended the sample)."""
    llm = LLM(TINY_CONFIG)
    try:
        alone, together, mixed, params = _alone_and_batched(llm)
    finally:
        llm.shutdown()
    assert alone == together == mixed
    for i in range(4):  # held off at token 1 (another token sampled), went on past token 4
        assert alone[i][0][1] not in params[i].stop_token_ids and len(alone[i][0]) > 4
    assert all(len(alone[i][0]) <= 2 for i in range(4, NUM))  # stopped on it


def test_min_tokens_batch_invariance_negative_control(monkeypatch):
    """Every row of a step held off the ids any row holds off: a request without min_tokens
    gets other bits in the batch than alone, so the comparison above can fail."""
    per_row = Sampler._hold_off

    def step_wide(self, logits, params, positions):
        is_held = per_row(self, logits, params, positions).isinf().any(0)
        return logits.masked_fill(is_held, float("-inf"))

    monkeypatch.setattr(Sampler, "_hold_off", step_wide)
    llm = LLM(TINY_CONFIG)
    try:
        alone, together, _, _ = _alone_and_batched(llm)
    finally:
        llm.shutdown()
    assert alone != together


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"min_tokens": -1}, "min_tokens must be an int >= 0 and <= max_tokens (16), got -1"),
        ({"min_tokens": 17}, "min_tokens must be an int >= 0 and <= max_tokens (16), got 17"),
        (
            {"min_tokens": 5, "max_tokens": 4},
            "min_tokens must be an int >= 0 and <= max_tokens (4), got 5",
        ),
        ({"min_tokens": 1.0}, "min_tokens must be an int, got 1.0"),
        ({"min_tokens": True}, "min_tokens must be an int, got True"),
    ],
)
def test_min_tokens_is_an_int_within_max_tokens(kwargs, problem):
    with pytest.raises(ValueError) as refused:
        SamplingParams(**kwargs)
    assert str(refused.value) == f"SamplingParams.{problem}"


def test_min_tokens_up_to_max_tokens_or_any_without_one():
    assert SamplingParams(min_tokens=16).min_tokens == 16
    assert SamplingParams(max_tokens=None, min_tokens=10**6).min_tokens == 10**6


def test_include_stop_str_in_output_keeps_what_ended_the_text(llm, free_run):
    """Without it the text stops before the stop string (and leaves a stop id's text out);
    with it the text is the decode of every token, the stop string or id's last."""
    k, char = _first_new_char(llm, free_run)
    decode = llm.tokenizer.decode
    for stop in ({"stop": [char]}, {"stop_token_ids": [free_run[k]]}):
        cut, kept = (
            llm.generate(
                [PROMPT], SamplingParams(include_stop_str_in_output=keep, **stop, **GREEDY)
            )[0]
            for keep in (False, True)
        )
        assert cut.token_ids == kept.token_ids == free_run[: k + 1]
        assert cut.text == decode(free_run[:k]) and not cut.text.endswith(char)
        assert kept.text == decode(free_run[: k + 1]) and kept.text.endswith(char)
        assert kept.stop_reason == cut.stop_reason


def test_generate_cli_rows_carry_stop_reason_as_rollout_rows_do(llm, capsys):
    """launch/generate.py printed finish_reason but no stop_reason, which rollout rows and
    every HTTP choice carry: each row has it now, beside finish_reason, LLM.generate's."""
    import json

    from launch.generate import main

    free = llm.generate(["Hello"], SamplingParams(ignore_eos=True, **GREEDY))[0].token_ids
    eos = free[3]  # the text prompt's greedy run then ends on EOS at token 3
    argv = ["--config", str(TINY_CONFIG), "--prompt", "Hello", "--max-tokens", "20"]
    assert main([*argv, "--set", f"model.eos_token_id={eos}"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["token_ids"] == free[: free.index(eos) + 1]
    assert (row["finish_reason"], row["stop_reason"]) == ("stop", None)
    assert list(row)[-2:] == ["finish_reason", "stop_reason"]


def test_a_stop_string_that_cuts_the_text_names_the_stop_reason(llm, free_run):
    """With include_stop_str_in_output a stop id's text is read: where it completes a stop
    string, the text is cut at that string and stop_reason is the string, as vLLM's (its
    detokenizer's stop string overrides the id's reason). It named the id while the string
    cut the text. Without include_stop_str_in_output the id's text is never read: the id."""
    k, char = _first_new_char(llm, free_run)
    both = {"stop": ["never", char], "stop_token_ids": [free_run[k]], **GREEDY}
    for keep, reason in ((True, char), (False, free_run[k])):
        params = SamplingParams(include_stop_str_in_output=keep, **both)
        out = llm.generate([PROMPT], params)[0]
        assert out.token_ids == free_run[: k + 1] and out.finish_reason == "stop"
        assert out.stop_reason == reason
        assert out.text == llm.tokenizer.decode(free_run[: k + 1 if keep else k])


def test_readme_lists_every_sampling_params_field():
    """README's `SamplingParams(...)` line names each field (include_stop_str_in_output was
    missing from it), and its HTTP field list gives include_stop_str_in_output's default."""
    import dataclasses
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    listed = re.search(r"`SamplingParams\(([^)]*)\)`", readme).group(1)
    names = {name.strip() for name in listed.split(",")}
    assert names == {f.name for f in dataclasses.fields(SamplingParams)}
    assert "`include_stop_str_in_output` (false)" in readme
