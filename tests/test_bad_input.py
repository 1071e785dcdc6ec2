"""Bad config values, bad token ids and over-long prompts: clear errors, nothing else lost."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_runtime import LLM, SamplingParams
from moe_runtime.config import load_config
from tests.invariance import TINY_CONFIG, fingerprint


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"kernels.mode": "fastest"}, "kernels.mode"),
        ({"cache.block_size": 0}, "cache.block_size"),
        ({"model.n_group": 3}, "model.n_group"),
        ({"model.topk_group": 9}, "model.topk_group"),
        ({"model.nonsense": 1}, "model.nonsense"),
        ({"parallel.world_size": -2}, "parallel.world_size"),
        ({"scheduler.max_model_len": 4096}, "scheduler.max_model_len"),
        ({"eplb.policy": "random"}, "eplb.policy"),
        ({"server.port": 70000}, "server.port"),
    ],
)
def test_bad_config_value_names_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(TINY_CONFIG, override)


def test_unknown_section_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown config section 'modle'"):
        load_config({"modle": {}})
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_vllm_spellings_of_off_are_off_and_an_empty_stop_string_is_refused():
    """top_k 0 is vLLM's off, as -1 (it was refused); stop_token_ids None is no stop ids, as
    stop None is no stop strings (it was refused); an empty stop string is refused naming
    the field, as the HTTP API and vLLM refuse it (it was dropped without a word)."""
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    for stop in ("", ["x", ""]):
        with pytest.raises(ValueError, match="stop must be non-empty strings"):
            SamplingParams(stop=stop)
    with pytest.raises(ValueError, match="top_k must be -1 or 0"):
        SamplingParams(top_k=-2)


def test_a_seed_past_63_bits_is_refused_before_it_reaches_a_step():
    """The sampler's noise takes a seed as an int64: 2**63 was accepted here and then failed
    the step it ran in, killing the engine and the requests beside it."""
    with pytest.raises(ValueError, match=r"seed must be None or an int in \[0, 2\*\*63 - 1\]"):
        SamplingParams(seed=2**63)
    with pytest.raises(ValueError, match="max_tokens must be an int"):
        SamplingParams(max_tokens=True)
    largest = SamplingParams(max_tokens=2, temperature=1.0, seed=2**63 - 1)
    (output,) = LLM(TINY_CONFIG).generate([[1, 2, 3]], largest)
    assert len(output.token_ids) == 2 and output.outputs[0].seed == 2**63 - 1


def test_bad_requests_fail_alone_while_others_finish():
    llm = LLM(TINY_CONFIG, **{"scheduler.max_model_len": 128})
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=9, logprobs=3, ignore_eos=True)
    good = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(40, 90))]
    expected = [fingerprint(o) for o in LLM(TINY_CONFIG).generate(good, params)]

    engine = llm.engine
    in_flight = [engine.add_request(p, params).samples[0] for p in good]
    engine.step()
    engine.step()
    with pytest.raises(ValueError, match="token id 512 is outside the vocabulary"):
        engine.add_request([1, 2, 512], params)
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary"):
        engine.add_request([-1], params)
    with pytest.raises(ValueError, match="more than scheduler.max_model_len=128"):
        engine.add_request(list(range(129)), params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], params)
    # Fits alone, but not with its max_tokens: refused up front, naming both numbers.
    with pytest.raises(ValueError, match=r"prompt has 120 tokens and max_tokens is 10 \(130 in"):
        engine.add_request(list(range(120)), params)
    # More top logprobs than the vocabulary has: it used to fail the step, killing the engine.
    with pytest.raises(ValueError, match="logprobs=513 asks for more top logprobs than the voc"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2, logprobs=513))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("", params)  # not the BOS token alone
    with pytest.raises(ValueError, match=r"token ids must be ints, got 1.5 \(float\)"):
        engine.add_request([1, 1.5], params)
    with pytest.raises(ValueError, match="sequence 1: token id 9999"):
        engine.add_score_requests([[1, 2, 3], [1, 9999]], [1, 1])  # all or none
    long = r"scored sequence \(prompt and scored tokens\) has 130 tokens, more than scheduler"
    with pytest.raises(ValueError, match=long):  # not "prompt has 130": its prompt has 20
        engine.add_score_request(list(range(130)), 20)
    for prompt_len in (True, 1.5, "2", 0, 3):
        with pytest.raises(ValueError, match=r"prompt_len must be an int in \[1, 2\]"):
            engine.add_score_request([1, 2, 3], prompt_len)
    while engine.has_unfinished():
        engine.step()
    assert [s.finish_reason for s in in_flight] == ["length", "length"]
    got = [
        (
            tuple(s.output_token_ids),
            tuple(map(float.hex, s.output_logprobs)),
            tuple(tuple((t, float.hex(v)) for t, v in d.items()) for d in s.output_top_logprobs),
        )
        for s in in_flight
    ]
    assert got == expected


def test_integer_scalars_of_numpy_and_torch_are_token_ids_and_a_vocabulary_of_logprobs_runs():
    llm = LLM(TINY_CONFIG, **{"server.max_logprobs": 512})
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=512)  # the whole vocabulary
    plain = fingerprint(llm.generate([[5, 6, 7]], params)[0])
    for prompt in (np.array([5, 6, 7]), list(torch.tensor([5, 6, 7]))):
        assert fingerprint(llm.generate([prompt], params)[0]) == plain
    assert all(len(top) == 512 for top in llm.generate([[5, 6, 7]], params)[0].top_logprobs)
    scored = llm.score([np.array([5, 6, 7, 8])], [np.int64(3)])
    assert scored == llm.score([[5, 6, 7, 8]], [3])


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("top_p", "0.5", "a finite number"),
        ("ignore_eos", "no", "true or false"),  # a word was truthy: EOS silently ignored
        ("return_routed_experts", "no", "true or false"),
        ("stop_token_ids", [1.7], "a list of token ids"),  # was truncated to 1
        ("stop_token_ids", [-1], "a list of token ids"),
        ("stop", 5, "a string or a list of strings"),
        ("n", True, "an int"),
    ],
)
def test_sampling_params_of_the_wrong_type_name_the_field(field, value, expected):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be {expected}"):
        SamplingParams(**{field: value})


def test_numpy_scalars_are_sampling_values_and_become_pythons():
    """A temperature from a numpy schedule, a seed from a numpy array: accepted as the Python
    values they stand for (the same bits), stored as Python's (they reach JSON and hashes)."""
    given = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.7), seed=np.int64(5))
    plain = SamplingParams(max_tokens=3, temperature=float(np.float32(0.7)), seed=5)
    assert given == plain and type(given.temperature) is float and type(given.seed) is int
    llm = LLM(TINY_CONFIG)
    assert fingerprint(llm.generate([[1, 2]], given)[0]) == fingerprint(
        llm.generate([[1, 2]], plain)[0]
    )


def test_score_is_all_or_none():
    llm = LLM(TINY_CONFIG)
    with pytest.raises(ValueError, match="sequence 1: token id 9999"):
        llm.score([[1, 2, 3], [1, 2, 9999]], [1, 1])
    assert not llm.engine.has_unfinished(), "a rejected batch must not leave scorings queued"


def test_generate_names_the_bad_prompt():
    llm = LLM(TINY_CONFIG)
    with pytest.raises(ValueError, match="prompt 1: token id 9999"):
        llm.generate([[1, 2, 3], [9999]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished(), "a rejected batch must not leave requests queued"


def test_generate_names_the_item_whose_params_are_not_sampling_params():
    llm = LLM(TINY_CONFIG)
    with pytest.raises(TypeError, match="prompt 1: params must be SamplingParams, got dict"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=2), {"max_tokens": 2}])
    assert not llm.engine.has_unfinished(), "a rejected batch must not leave requests queued"


def test_stop_tokens_and_eos_end_generation():
    llm = LLM(TINY_CONFIG)
    prompt = [10, 20, 30, 40]
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[
        0
    ]
    decode = llm.tokenizer.decode
    # A stop id past the first token whose own text is printable (so leaving it out shows).
    stop_at = next(t for t in free.token_ids[1:] if (c := decode([t]).strip()) and c.isprintable())
    stopped = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop_at])
    )[0]
    assert stopped.finish_reason == "stop"
    cut = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: cut + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 16
    # The stop token's text is left out of text, as vLLM leaves it (the id stays in
    # token_ids): the text is the decode of the tokens before it, and the free run's text
    # did hold more there.
    assert stopped.text == decode(free.token_ids[:cut])
    assert decode(free.token_ids[: cut + 1]) != stopped.text


def test_cache_too_small_for_the_context_fails_at_start():
    with pytest.raises(
        ValueError, match=r"max_model_len=512 needs 32 KV blocks.*cache\.num_blocks"
    ):
        LLM(TINY_CONFIG, **{"cache.num_blocks": 8, "scheduler.max_model_len": 512})


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_serve_ep_refuses_a_drain_timeout_that_is_not_a_finite_duration(value, capsys):
    """Before any model load or port bind: exit 2 naming the flag (-1 served, then a SIGTERM
    'drained for up to -1s')."""
    from launch.serve_ep import main

    config = str(Path(__file__).resolve().parent.parent / "launch/configs/tiny_cpu.yaml")
    assert main(["--config", config, "--drain-timeout-s", value]) == 2
    assert "--drain-timeout-s must be a finite number >= 0" in capsys.readouterr().err


def test_serve_ep_refuses_a_log_level_uvicorn_does_not_know(capsys):
    """A usage error (exit 2) naming the choices, before anything loads: it was a KeyError
    traceback out of uvicorn.Config."""
    from launch.serve_ep import parse_args

    config = str(Path(__file__).resolve().parent.parent / "launch/configs/tiny_cpu.yaml")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", config, "--log-level", "verbose"])
    assert exit_info.value.code == 2
    assert "--log-level: invalid choice: 'verbose'" in capsys.readouterr().err
    assert parse_args(["--config", config, "--log-level", "INFO"]).log_level == "info"


@pytest.mark.parametrize(
    ("flag", "value", "error"),
    [
        ("--max-tokens", "-1", "--max-tokens must be an int >= 1, got -1"),
        ("--temperature", "nan", "--temperature must be a finite number, got nan"),
        ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
        ("--seed", "-1", "--seed must be an int in [0, 2**63 - 1], got -1"),
    ],
)
def test_generate_names_a_bad_flag_as_typed(flag, value, error, capsys):
    """Exit 2 naming the flag, as rollout.py does; it named SamplingParams' field instead
    ('SamplingParams.max_tokens must be ...' for --max-tokens)."""
    from launch.generate import main

    config = str(Path(__file__).resolve().parent.parent / "launch/configs/tiny_cpu.yaml")
    assert main(["--config", config, flag, value]) == 2
    assert f"error: {error}\n" in capsys.readouterr().err


def test_generate_ends_on_ctrl_c_with_one_line_and_exit_130():
    """A Ctrl-C during generation printed a KeyboardInterrupt traceback from inside a kernel
    (rollout.py and serve_ep.py end on it with one line)."""
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "launch/generate.py", "--config", str(TINY_CONFIG)]
    cmd += ["--max-tokens", "1000", "--prompt", "a"]
    proc = subprocess.Popen(cmd, cwd=root, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # once the model has loaded: the generation runs for seconds
            if line.startswith("loaded "):
                break
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "generate: interrupted (SIGINT); nothing was printed"


def test_top_logprobs_are_bounded_by_server_max_logprobs():
    """Top logprobs were bounded by the vocabulary alone outside HTTP (a request of 102400 a
    token: a table and a list of dicts that large each step); now server.max_logprobs (20,
    OpenAI's bound, by default) bounds generate and score too, naming the field and the key."""
    llm = LLM(TINY_CONFIG)
    bound = r"SamplingParams.logprobs=21 is more than server.max_logprobs=20"
    with pytest.raises(ValueError, match=bound):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=21))
    with pytest.raises(ValueError, match=r"logprobs=21 is more than server.max_logprobs=20"):
        llm.score_outputs([[1, 2, 3]], [1], logprobs=21)
    (output,) = llm.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=20))
    assert all(len(top) == 20 for top in output.top_logprobs)
    llm.shutdown()
    wider = LLM(TINY_CONFIG, **{"server.max_logprobs": 30})
    (output,) = wider.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=30))
    assert all(len(top) == 30 for top in output.top_logprobs)
    wider.shutdown()
    with pytest.raises(ValueError, match=r"server.max_logprobs must be an int >= 0, got -1"):
        load_config(TINY_CONFIG, {"server.max_logprobs": -1})
