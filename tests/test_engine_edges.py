"""Edge cases of the engine's bookkeeping found by an outside audit of the scheduler: a waiting
request's prefix match (held while it heads the queue) must neither cost a running sequence a
preemption nor count as hits once aborted; a stop string completed by the last allowed token is
a stop; one prompt of numpy or torch integer ids is one prompt."""

from __future__ import annotations

import dataclasses
import threading
import time
import types

import numpy as np
import pytest
import torch

from moe_runtime import LLM, SamplingParams
from moe_runtime.config import load_config
from moe_runtime.engine.balancer import HISTORY_LEN, ExpertBalancer, initial_placement
from moe_runtime.engine.request_checks import ContextLengthError, PromptTooLongError
from tests.counting import CountingSamples
from tests.invariance import TINY_CONFIG, fingerprint, interrupt_at_call, mixed_prompts

# 16 blocks of 4: a 44-token request with 12 generated needs 14, leaving 2.
CRAMPED = {"cache.block_size": 4, "cache.num_blocks": 16, "scheduler.max_model_len": 64}
CACHED = list(range(10, 22))  # 12 tokens: 3 full blocks, cached once run
LONG = list(range(100, 144))
BEHIND = CACHED + list(range(30, 38))  # 3 cached blocks + 2 more: cannot be admitted beside LONG


def _long_run(waiting: bool, abort: bool = False):
    llm = LLM(TINY_CONFIG, **CRAMPED)
    engine = llm.engine
    llm.generate([CACHED], SamplingParams(max_tokens=1, seed=1))
    hits_before = engine.stats().num_prefix_hit_blocks
    long = engine.add_request(LONG, SamplingParams(max_tokens=12, seed=2, ignore_eos=True))
    engine.step()
    if waiting:
        behind = engine.add_request(BEHIND, SamplingParams(max_tokens=4, seed=3, ignore_eos=True))
        engine.step()
        assert len(behind.samples[0].block_table) == 3  # engagement: it holds its match
        if abort:
            engine.abort(behind.request_id)
            assert engine.stats().num_prefix_hit_blocks == hits_before
    while engine.has_unfinished():
        engine.step()
    free = [b.num_free_blocks for b in engine.block_managers]
    return fingerprint(engine.output(long)), engine.stats(), free


def test_a_waiting_match_gives_way_before_a_running_sequence_is_preempted():
    """The waiting head's matched blocks are cache (it cannot run yet): the running sequence
    that needs them took a preemption and a recompute instead (0 -> 1)."""
    alone, alone_stats, _ = _long_run(waiting=False)
    assert alone_stats.num_preemptions == 0
    with_waiting, stats, free = _long_run(waiting=True)
    assert stats.num_preemptions == 0, stats
    assert with_waiting == alone
    assert free == [16]  # every block back


def test_an_aborted_waiting_match_is_not_counted_as_hits():
    _, stats, free = _long_run(waiting=True, abort=True)
    assert stats.num_preemptions == 0 and free == [16]


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_CONFIG)


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm):
    prompt = [72, 101, 108, 108, 111]
    free_run = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0]
    decode = llm.tokenizer.decode
    # The first generated token whose text is new to the text before it: a stop string there.
    k, stop = next(
        (k, text)
        for k, t in enumerate(free_run.token_ids)
        if (text := decode([t])).strip()
        and text.isprintable()
        and text != "\ufffd"
        and text not in decode(free_run.token_ids[:k])
    )
    for max_tokens in (k + 1, k + 2):  # the stop string on the last allowed token, and before
        out = llm.generate(
            [prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[stop])
        )[0]
        assert out.token_ids == free_run.token_ids[: k + 1] and stop not in out.text
        assert out.finish_reason == "stop", (max_tokens, out.finish_reason)
    control = llm.generate([prompt], SamplingParams(max_tokens=k + 1, temperature=0.0))[0]
    assert control.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt",
    [
        [np.int64(3), np.int64(4)],
        [torch.tensor(3), torch.tensor(4)],
        np.array([3, 4]),
        torch.tensor([3, 4]),
    ],
    ids=["numpy scalars", "torch scalars", "numpy array", "torch tensor"],
)
def test_one_prompt_of_numpy_or_torch_ids_is_one_prompt(llm, prompt):
    params = SamplingParams(max_tokens=3, seed=4)
    (out,) = llm.generate(prompt, params)
    assert fingerprint(out) == fingerprint(llm.generate([3, 4], params)[0])


def test_a_batch_as_a_2d_array_is_one_prompt_a_row(llm):
    params = SamplingParams(max_tokens=2, seed=4)
    outs = llm.generate(np.array([[3, 4], [5, 6]]), params)
    assert [fingerprint(o) for o in outs] == [
        fingerprint(o) for o in llm.generate([[3, 4], [5, 6]], params)
    ]


def test_stop_token_ids_outside_the_vocabulary_are_refused_by_name(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 1000000000 is outside"):
        llm.generate([3, 4], SamplingParams(max_tokens=2, stop_token_ids=[5, 10**9]))


def test_a_scored_sequence_of_one_token_is_refused_saying_why(llm):
    with pytest.raises(ValueError, match="a scored sequence needs 2 tokens at least"):
        llm.score([[1]], [1])


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda llm: llm.score([[1, 2, 3]], 2), "prompt_lens must be a list, got int"),
        (lambda llm: llm.score_outputs([[1, 2]], None), "prompt_lens must be a list, got NoneType"),
        (lambda llm: llm.score(7, [1]), "sequences must be a list, got int"),
    ],
)
def test_a_score_call_without_lists_is_refused_naming_the_argument(llm, call, named):
    """score(seqs, 2) (one length where a list of them belongs) met len() and raised a bare
    TypeError, "object of type 'int' has no len()", naming nothing."""
    with pytest.raises(ValueError, match=named):
        call(llm)
    assert llm.score([[1, 2, 3]], [2]) == llm.score([(1, 2, 3)], (2,))  # any sized sequences


@pytest.mark.parametrize("mode", ["invariant", "fast"])  # fast: the negative control
def test_a_requests_samples_compute_its_prompt_once(mode):
    """n samples admitted in one step each computed the whole prompt (n times the prefill);
    the later ones now wait until the first has its prompt's full blocks cached and hit them,
    with the bits of samples that each computed it all (prefix caching off). Fast kernels sum
    a prompt computed in pieces otherwise than whole: there the bits must differ."""
    prompt = list(range(1, 101))  # 100 tokens: 6 full blocks of 16 a sample can hit
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=9, logprobs=2)
    roomy = {"scheduler.max_num_batched_tokens": 1024, "kernels.mode": mode}
    llm = LLM(TINY_CONFIG, **roomy)
    (shared,) = llm.generate([prompt], params)
    assert llm.engine.stats().num_prefix_hit_blocks == 3 * 6  # engagement: 3 siblings hit 6
    alone = LLM(TINY_CONFIG, **roomy, **{"cache.enable_prefix_caching": False})
    (whole,) = alone.generate([prompt], params)
    got = [fingerprint_sample(s) for s in shared.outputs]
    expected = [fingerprint_sample(s) for s in whole.outputs]
    if mode == "invariant":
        assert got == expected
    else:
        assert got[1:] != expected[1:], "fast kernels gave the same bits: the test could not fail"


def fingerprint_sample(sample) -> tuple:
    return sample.index, sample.token_ids, sample.logprobs, sample.top_logprobs


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"parallel.device is 'cuda' but rank 0 sees no CUDA"):
        LLM(TINY_CONFIG, **{"parallel.device": "cuda"})


def test_a_sample_waiting_for_its_siblings_prompt_wastes_no_lookahead():
    """With overlap_decode (invariant mode), a step may launch the next decode ahead while
    sequences wait, if nothing but a sequence's end could admit them. A sample waiting for its
    sibling's prompt is admitted as soon as that is in: 3 lookaheads were launched and dropped."""
    prompts = mixed_prompts(4, 40, 90, seed=3)
    params = [SamplingParams(n=5, max_tokens=8, temperature=1.0, seed=i) for i in range(4)]
    overrides = {
        "scheduler.overlap_decode": True,
        "scheduler.max_num_seqs": 6,
        "cache.num_blocks": 40,
        "scheduler.max_model_len": 256,
    }
    llm = LLM(TINY_CONFIG, **overrides)
    llm.generate(prompts, params)
    stats = llm.engine.worker_stats()[0]
    assert llm.engine.stats().num_prefix_hit_blocks > 0  # engagement: samples waited and hit
    assert stats["num_lookahead_hits"] > 0 and stats["num_lookahead_misses"] == 0, stats


def test_a_ctrl_c_mid_step_kills_the_engine_and_the_next_generate_rebuilds_it():
    """A KeyboardInterrupt after the rank ran a step the driver never recorded: the next step
    found the rank ahead ("scheduled from position 7, but 8 are computed here") and the
    interrupted call's requests stayed queued, their blocks counted in use. Now the engine
    dies saying so, frees its queues, and LLM's next call rebuilds it: the same bits as ever."""
    params = SamplingParams(max_tokens=8, seed=1, logprobs=2)
    expected = fingerprint(LLM(TINY_CONFIG).generate([[5, 6, 7]], params)[0])
    llm = LLM(TINY_CONFIG)
    engine = llm.engine
    interrupt_at_call(engine, 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[9, 10, 11]], SamplingParams(max_tokens=8, seed=2))
    assert engine.error == "a call to the ranks was interrupted (KeyboardInterrupt)"
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, (0.0,))
    assert fingerprint(llm.generate([[5, 6, 7]], params)[0]) == expected
    assert engine.error is None and engine.num_restarts == 1  # engagement: it was rebuilt


def test_a_ctrl_c_between_steps_aborts_the_calls_requests():
    llm = LLM(TINY_CONFIG)
    engine = llm.engine
    real_step, num_steps = engine.step, [0]

    def step_then_interrupt():
        outputs = real_step()
        num_steps[0] += 1
        if num_steps[0] == 2:
            raise KeyboardInterrupt  # after the step was recorded: the engine stays in step
        return outputs

    engine.step = step_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[9, 10, 11], [12, 13]], SamplingParams(max_tokens=8, seed=2))
    assert engine.error is None and not engine.has_unfinished()
    assert engine.stats().kv_cache_usage == (0.0,)
    del engine.step
    params = SamplingParams(max_tokens=4, seed=1)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == (
        LLM(TINY_CONFIG).generate([[5, 6, 7]], params)[0].token_ids
    )


@pytest.mark.parametrize("call", ("generate", "score"))
def test_a_ctrl_c_while_a_call_queues_its_prompts_queues_none(call):
    """A KeyboardInterrupt as the third request is queued (a Ctrl-C in the seconds a call of
    50k prompts spends queueing): the two queued before it stayed waiting (engine healthy,
    has_unfinished) and the next call ran them first, 5 steps for its 1. Now none stays."""
    llm = LLM(TINY_CONFIG)
    engine = llm.engine
    real_enqueue, num_calls = engine._enqueue, [0]

    def interrupted_enqueue(request):
        num_calls[0] += 1
        if num_calls[0] == 3:
            raise KeyboardInterrupt
        return real_enqueue(request)

    engine._enqueue = interrupted_enqueue
    with pytest.raises(KeyboardInterrupt):
        if call == "generate":
            llm.generate([[1, 2], [3, 4], [5, 6], [7, 8]], SamplingParams(max_tokens=5))
        else:
            llm.score([[1, 2, 3], [3, 4, 5], [5, 6, 7], [7, 8, 9]], [1, 1, 1, 1])
    assert num_calls[0] == 3  # engagement: two were queued before the interrupt
    assert engine.error is None and not engine.has_unfinished(), engine.stats()
    del engine._enqueue
    steps = engine.num_steps
    llm.generate([[9]], SamplingParams(max_tokens=1))
    assert engine.num_steps - steps == 1


def test_vllm_prompt_dicts_are_prompts_and_other_forms_are_refused(llm):
    """vLLM's {"prompt_token_ids": ids} and {"prompt": text} (alone or in a list; None-valued
    optional keys ignored) give the bits of the ids or text they hold: a dict alone ran as the
    text of its keys ("prompt_token_ids"), in a list it was refused as 'token ids must be
    ints'. Other keys, both keys, bytes (iterated as ids) and sets (no order) are refused
    naming what was given."""
    params = SamplingParams(max_tokens=3, seed=4)
    by_ids = fingerprint(llm.generate([5, 6, 7], params)[0])
    by_text = fingerprint(llm.generate("Hello", params)[0])
    assert fingerprint(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0]) == by_ids
    both = llm.generate(
        [{"prompt": "Hello", "multi_modal_data": None}, {"prompt_token_ids": [5, 6, 7]}], params
    )
    assert [fingerprint(o) for o in both] == [by_text, by_ids]
    refused = [
        ({"prompt": "Hello", "multi_modal_data": {"image": 1}}, "'multi_modal_data'"),
        ({"prompt": "Hello", "prompt_token_ids": [5]}, "exactly one"),
        ({}, "neither"),
        ({"prompt": [5, 6]}, "'prompt' must be text"),
        (b"Hello", "got bytes"),
        ({5, 6, 7}, "got a set"),
    ]
    for prompt, problem in refused:
        with pytest.raises(ValueError, match=problem):
            llm.generate(prompt, params)
    with pytest.raises(ValueError, match="prompt 1: .*'multi_modal_data'"):
        llm.generate([[5, 6], {"prompt": "x", "multi_modal_data": {"a": 1}}], params)
    assert not llm.engine.has_unfinished()


def test_sampling_params_is_vllms_name_for_params(llm):
    """llm.generate(prompts, sampling_params=...) (vLLM's keyword) was a TypeError."""
    params = SamplingParams(max_tokens=3, seed=4)
    expected = [fingerprint(o) for o in llm.generate([[5, 6, 7], "Hi"], params)]
    got = llm.generate([[5, 6, 7], "Hi"], sampling_params=params)
    assert [fingerprint(o) for o in got] == expected
    with pytest.raises(ValueError, match="not both"):
        llm.generate([5, 6], params, sampling_params=params)


def test_a_shut_down_llm_says_so():
    llm = LLM(TINY_CONFIG)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2))


def test_outputs_are_copies_a_caller_may_change(llm):
    params = SamplingParams(max_tokens=3, seed=1, logprobs=2)
    request = llm.engine.add_request([5, 6, 7], params)
    deltas = []
    while llm.engine.has_unfinished():
        deltas += llm.engine.step()
    deltas[0].outputs[0].top_logprobs[0].clear()
    assert len(llm.engine.output(request).top_logprobs[0]) == 2
    deltas[0].prompt_token_ids.append(10**9)  # an id the engine would die on
    assert request.prompt_token_ids == [5, 6, 7]
    whole = llm.engine.output(request)
    whole.prompt_token_ids.append(8)
    assert llm.engine.output(request).prompt_token_ids == [5, 6, 7]
    (scored,) = llm.score_outputs([[5, 6, 7, 8]], [2])
    scored.top_logprobs[0]["x"] = 1.0
    assert scored.top_logprobs[1] == {}


def test_stop_token_ids_may_be_numpy_or_torch_integer_scalars():
    params = SamplingParams(stop_token_ids=[np.int64(257), torch.tensor(3), 4])
    assert params.stop_token_ids == (257, 3, 4)
    assert all(type(t) is int for t in params.stop_token_ids)
    for bad in ([True], [np.float32(3)], [torch.tensor(3.0)], [-1]):
        with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids"):
            SamplingParams(stop_token_ids=bad)


def test_a_prompt_past_the_context_is_refused_before_its_ids_are_read(llm):
    """Length first: a huge prompt was checked id by id (seconds on the engine's thread for
    50 MB) before being refused as too long."""
    too_long = [10**9] * (llm.config.scheduler.max_model_len + 1)  # and no id in the vocabulary
    with pytest.raises(PromptTooLongError, match="more than scheduler.max_model_len"):
        llm.generate([too_long], SamplingParams(max_tokens=1))


def test_max_tokens_none_generates_to_the_contexts_end():
    """vLLM's max_tokens=None: up to the context's end (it was refused as not an int). The
    samples are those of the equal explicit budget; a prompt that leaves no room is refused
    naming max_tokens."""
    llm = LLM(TINY_CONFIG, **{"scheduler.max_model_len": 40})
    to_end = SamplingParams(max_tokens=None, temperature=0.8, seed=3, ignore_eos=True, logprobs=2)
    prompts = [list(range(1, 11)), list(range(1, 40))]
    outputs = llm.generate(prompts, to_end)
    assert [len(o.token_ids) for o in outputs] == [30, 1]
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    for prompt, output in zip(prompts, outputs, strict=True):
        budget = dataclasses.replace(to_end, max_tokens=40 - len(prompt))
        assert fingerprint(output) == fingerprint(llm.generate([prompt], budget)[0])
    with pytest.raises(ContextLengthError, match=r"max_tokens \(None: one token at least\)"):
        llm.generate([list(range(1, 41))], to_end)


def test_use_tqdm_is_vllms_progress_bar_of_finished_prompts(llm, capsys):
    """generate / score take vLLM's use_tqdm (it was a TypeError): a bar on stderr counts the
    finished prompts and the tokens generated; off, nothing is written."""
    params = SamplingParams(max_tokens=4, seed=2, ignore_eos=True)
    shown = llm.generate([[5, 6, 7], [8, 9]], params)
    bar = capsys.readouterr().err
    assert "generate: 100%" in bar and "2/2" in bar and "tokens=8" in bar
    quiet = llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert [fingerprint(o) for o in quiet] == [fingerprint(o) for o in shown]
    assert llm.score([[5, 6, 7]], [1], use_tqdm=False) and capsys.readouterr().err == ""
    llm.score_outputs([[5, 6, 7]], [1])
    assert "score: 100%" in capsys.readouterr().err


def test_an_n_past_the_sequence_cap_is_refused_before_any_sample_is_made(llm):
    """SamplingParams(n=2**40) hung, then ran out of memory, making the samples' seeds one by
    one (the HTTP API and rollout rows cap n at server.max_sequences_per_request; the Python
    API did not). Now it is refused at once, naming n and the key; nothing was queued."""
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"n=1099511627776 .*server\.max_sequences_per_request"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, n=2**40))
    assert time.monotonic() - started < 5 and not llm.engine.has_unfinished()
    small = LLM(TINY_CONFIG, **{"server.max_sequences_per_request": 3})
    (output,) = small.generate([[1, 2]], SamplingParams(max_tokens=2, n=3, seed=1))
    assert len(output.outputs) == 3
    with pytest.raises(ValueError, match="n=4 is more samples"):
        small.generate([[1, 2]], SamplingParams(max_tokens=2, n=4))


def test_a_sample_with_no_tokens_has_routed_experts_of_the_rows_shape(llm):
    """An output's routed experts are [T, MoE layers, K] at every T: a request aborted before
    its first token has [0, L, K] (it had shape (0,), which a caller concatenating samples' rows
    cannot stack)."""
    engine, model = llm.engine, llm.engine.config.model
    params = SamplingParams(max_tokens=3, seed=5, return_routed_experts=True)
    ran = engine.add_request([5, 6, 7], params)
    while engine.has_unfinished():
        engine.step()
    width = (model.num_moe_layers, model.num_experts_per_tok)
    assert model.num_moe_layers > 0
    assert np.asarray(engine.output(ran).routed_experts).shape == (3, *width)  # engagement
    aborted = engine.add_request([5, 6, 7], params)
    engine.abort(aborted.request_id)
    out = engine.output(aborted)
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert out.routed_experts.shape == (0, *width)
    assert out.routed_experts.dtype == np.int32


def test_the_rebalance_history_keeps_the_newest_reports_only():
    """Each eplb.interval_steps steps adds a report, skipped ones too: a list grew without end
    on a server under load for days. A balancer whose ranks report no load skips every call."""
    config = load_config(TINY_CONFIG)
    placement = initial_placement(config)
    slots = [[0] * placement.num_physical for _ in range(config.model.num_moe_layers)]
    ranks = types.SimpleNamespace(call_all=lambda method, timeout_s=None: [slots])
    balancer = ExpertBalancer(config, ranks, placement)
    for _ in range(HISTORY_LEN + 5):
        assert balancer.rebalance()["skipped"]
    assert len(balancer.history) == HISTORY_LEN
    assert balancer.history[-1]["reason"].startswith("no expert load")


def test_calls_from_several_threads_run_one_at_a_time_and_give_each_its_bits(llm):
    """Three threads calling generate at once on one LLM: each gets the bits of the same call
    alone. Before, each call stepped the others' requests from its own thread: the engine died
    ("scheduled from position 0, but 4 are computed here") and some calls got other bits."""
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(16)]
    params = SamplingParams(max_tokens=24, seed=3, ignore_eos=True, logprobs=2)
    alone = [fingerprint(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    results, errors = [], []

    def call() -> None:
        try:
            for _ in range(3):
                outs = llm.generate(prompts, params, use_tqdm=False)
                results.append([fingerprint(o) for o in outs])
        except Exception as exc:  # raised in the thread: reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 9
    assert all(got == alone for got in results)
    assert llm.engine.error is None and not llm.engine.has_unfinished()


def test_prompts_may_come_from_a_generator_and_params_as_a_tuple(llm):
    """A generator of prompts was read once by the one-prompt check (its first prompt lost)
    and then refused ("object of type 'generator' has no len()"); a tuple of params was
    refused as not a SamplingParams."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = SamplingParams(max_tokens=3, seed=4, ignore_eos=True)
    expected = [fingerprint(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    from_generator = llm.generate((p for p in prompts), params, use_tqdm=False)
    assert [fingerprint(o) for o in from_generator] == expected
    as_tuple = llm.generate(prompts, (params,) * 3, use_tqdm=False)
    assert [fingerprint(o) for o in as_tuple] == expected
    one = llm.generate(iter(prompts[0]), params, use_tqdm=False)  # one prompt's ids
    assert [fingerprint(o) for o in one] == expected[:1]


def test_the_tokenizer_outlives_shutdown_to_decode_what_was_generated():
    llm = LLM(TINY_CONFIG)
    out = llm.generate([[72, 101, 108]], SamplingParams(max_tokens=4, seed=2), use_tqdm=False)[0]
    llm.shutdown()
    assert llm.tokenizer.decode(out.token_ids) == out.text
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[72, 101, 108]], use_tqdm=False)


def test_a_step_reads_the_samples_it_ran_not_every_sample_of_the_request():
    """A request of n = 2000 samples, 4 running at a time. Each step's delta walked all n
    samples (their weight versions, then which had new tokens) and asked whether the request
    had finished by walking its finished ones: O(n) a step, 15 ms at n = 50,000, for every step
    of the request's life. Counted, not timed: a step reads about the samples it ran. The
    deltas are those of the samples that got a token, and their versions the request's."""
    llm = LLM(TINY_CONFIG, **{"scheduler.max_num_seqs": 4})
    engine = llm.engine
    params = SamplingParams(n=2000, max_tokens=2, seed=3, ignore_eos=True)
    request = engine.add_request(list(range(1, 5)), params)
    request.samples = samples = CountingSamples(request.samples)
    deltas = []
    for _ in range(6):
        deltas += engine.step()
    num_reads = samples.num_reads  # (not in the assert: its report would print it)
    assert num_reads <= 6 * 8, num_reads
    reported = [(out.index, tuple(out.token_ids)) for delta in deltas for out in delta.outputs]
    whole = engine.output(request).outputs  # 4 samples a prefill and a decode step: 12 ran
    expected = [(out.index, (token,)) for out in whole for token in out.token_ids]
    assert sorted(reported) == sorted(expected) and len(reported) == 24
    assert all(
        [out.index for out in d.outputs] == list(range(4 * (i // 2), 4 * (i // 2) + 4))
        for i, d in enumerate(deltas)
    )  # in sample order, as the whole output is
    assert all(not delta.is_finished and delta.weight_version == 0 for delta in deltas)
    assert [out.finish_reason for out in whole[:13]] == ["length"] * 12 + [None]
    llm.shutdown()
