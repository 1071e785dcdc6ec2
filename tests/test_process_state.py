"""World size 1 runs its rank in the caller's process: torch's process-wide settings other than
the thread count (the fp32 matmul precision, the default dtype) must change no bit either.

A trainer that calls `torch.set_float32_matmul_precision("medium")` (or `"high"`; Lightning
suggests it) or `torch.set_default_dtype(torch.bfloat16)` and then builds an `LLM` of world size
1 for its rollouts got other bits than the same request served by a Ray rank, the CLI or the
HTTP server (fresh processes, at torch's defaults): "medium" lets oneDNN run fp32 matmuls in
bf16 (on a CPU with bf16 support), and a bf16 default dtype turned the sampler's per-row
temperatures into bf16 (0.7 became 0.69921875: other processed logprobs), a float64 one failed
the step outright.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_runtime import LLM, SamplingParams
from tests.invariance import TINY_CONFIG, fingerprint

PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11], [72, 101, 108, 108, 111]]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True),
    SamplingParams(
        max_tokens=6,
        temperature=0.7,
        top_k=10,
        seed=3,
        logprobs=3,
        ignore_eos=True,
        logprobs_mode="processed",
    ),
]


def _state() -> tuple:
    return (
        torch.get_default_dtype(),
        torch.get_float32_matmul_precision(),
        torch.backends.mkldnn.matmul.fp32_precision,
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.fp32_precision,
    )


@pytest.fixture
def restore_process_state(restore_num_threads):
    state = _state()
    yield
    torch.set_default_dtype(state[0])
    # The legacy setting first: it sets the per-backend ones too, which then get theirs back
    # (the new ones alone left the legacy one behind, a mix torch refuses to read).
    torch.set_float32_matmul_precision(state[1])
    torch.backends.mkldnn.matmul.fp32_precision = state[2]
    torch.backends.cuda.matmul.fp32_precision = state[3]
    torch.backends.fp32_precision = state[4]


def _run(config: Path = TINY_CONFIG) -> tuple:
    llm = LLM(str(config))
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        seqs = [o.prompt_token_ids + o.token_ids for o in outs]
        scored = llm.score(seqs, [len(p) for p in PROMPTS], use_tqdm=False)
    finally:
        llm.shutdown()
    return [fingerprint(o) for o in outs], [[float.hex(x) for x in s] for s in scored]


@pytest.fixture(scope="module")
def baseline() -> tuple:
    return _run()


def test_caller_fp32_matmul_precision_is_pinned_in_calls_and_given_back(
    restore_process_state, monkeypatch
):
    """A caller at "medium" (oneDNN's fp32 matmuls in bf16): each rank call runs at "highest"
    (oneDNN in IEEE fp32) and the caller's settings come back after it. Checked on every CPU:
    these assertions were behind the skip of the bits test below, which skips on CPUs where
    "medium" changes no product (the CI machines), so there they never ran."""
    from moe_runtime.worker.worker import Worker

    seen = []
    execute = Worker.execute

    def recording(self, step):
        seen.append(
            (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision)
        )
        return execute(self, step)

    torch.set_float32_matmul_precision("medium")
    caller = (torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision)
    assert caller == ("medium", "bf16")  # the negative control: the caller's setting shows
    monkeypatch.setattr(Worker, "execute", recording)
    _generate_once()
    assert seen and set(seen) == {("highest", "ieee")}, set(seen)  # engagement: pinned
    assert torch.get_float32_matmul_precision() == "medium"  # the caller's, given back
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"


def test_caller_fp32_matmul_precision_changes_no_bit(baseline, restore_process_state):
    a = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    b = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    exact = a @ b
    torch.set_float32_matmul_precision("medium")
    if torch.equal(a @ b, exact):  # the negative control: the setting must bite on this CPU
        pytest.skip("this CPU runs fp32 matmuls in fp32 under 'medium' precision")
    assert _run() == baseline
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # the caller's, given back
    assert torch.get_float32_matmul_precision() == "medium"


def _legacy_tf32_state() -> tuple:
    """What torch's legacy API reads now: its fp32 matmul precision and whether cuBLAS may use
    TF32 (the C++ allowTF32CuBLAS), or the RuntimeError torch raises for a mix of the legacy
    and the new API's settings."""
    try:
        return torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    except RuntimeError as exc:
        return ("RuntimeError", str(exc)[:60])


@pytest.mark.parametrize("legacy", ["set_float32_matmul_precision", "allow_tf32"])
def test_a_caller_on_the_legacy_tf32_api_gets_no_mixed_state(
    restore_process_state, monkeypatch, legacy
):
    """A caller that asked for TF32 through torch's legacy API (`set_float32_matmul_precision(
    "high")`, as Lightning suggests, or `torch.backends.cuda.matmul.allow_tf32 = True`): the
    rank pinned IEEE through the new per-backend API alone, so during each call the legacy
    setting still said "high" while the new one said "ieee", a mix torch refuses to read:
    `torch.backends.cuda.matmul.allow_tf32` (C++ allowTF32CuBLAS, which torch code and CUDA
    extensions consult) raised RuntimeError inside the rank, and the legacy precision read
    "high" while the rank computed in IEEE. Now the call runs at "highest" by both APIs, and
    the caller's settings come back by both."""
    from moe_runtime.worker.worker import Worker

    seen = []
    execute = Worker.execute

    def recording(self, step):
        seen.append(_legacy_tf32_state())
        return execute(self, step)

    if legacy == "allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_float32_matmul_precision("high")
    caller = _legacy_tf32_state()
    assert caller == ("high", True)  # the negative control: the caller's TF32 shows
    monkeypatch.setattr(Worker, "execute", recording)
    llm = LLM(str(TINY_CONFIG))
    try:
        llm.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)
    finally:
        llm.shutdown()
    assert seen and set(seen) == {("highest", False)}, set(seen)
    assert _legacy_tf32_state() == caller  # the caller's, given back
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


def _generate_once() -> None:
    llm = LLM(str(TINY_CONFIG))
    try:
        llm.generate(PROMPTS[:1], PARAMS[0], use_tqdm=False)
    finally:
        llm.shutdown()


def test_a_callers_matmuls_still_follow_its_global_fp32_precision_after_a_call(
    restore_process_state,
):
    """A caller that set torch's global fp32 precision (`torch.backends.fp32_precision`,
    which transformers' enable_tf32 sets) has matmul settings of "none" that defer to it.
    torch's getters answer the value they defer to, so the rank read "tf32" and wrote it back
    as the matmuls' own setting after each call: from then on they no longer followed the
    caller's global knob, and its later `torch.backends.fp32_precision = "ieee"` left its
    matmuls in TF32 (bf16 oneDNN matmuls likewise on the CPU). A matmul setting the caller made
    itself, equal to the global one, is still its own after the call."""
    # From torch's defaults: an earlier test's pin_threads (a worker built in this process)
    # leaves the matmuls' own precisions set, which then do not defer.
    torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.mkldnn.matmul.fp32_precision = "none"
    torch.backends.fp32_precision = "tf32"
    torch.backends.mkldnn.matmul.fp32_precision = "tf32"  # its own, equal to the global one
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # deferring to it
    _generate_once()
    torch.backends.fp32_precision = "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"  # follows the global one
    assert torch.backends.mkldnn.matmul.fp32_precision == "tf32"  # the caller's own setting


def _without_pinning(monkeypatch) -> None:
    """The negative controls' rank: it pins none of torch's process-wide settings, neither at
    init (Worker.init's pin_threads) nor around each call (LocalExecutor._own_threads)."""
    import moe_runtime.executor.local as local
    import moe_runtime.worker.worker as worker

    monkeypatch.setattr(local, "is_pinned", lambda state, config: True)
    monkeypatch.setattr(worker, "pin_threads", lambda kernels: None)


def test_without_the_pinning_a_callers_default_dtype_changes_bits(
    baseline, restore_process_state, monkeypatch
):
    """The negative control of the tests above and of the GPU one below: the pinning is what
    keeps the bits. Turning off only the per-call switch (is_pinned) left Worker.init pinning
    the process for good, so the control ran pinned and found no difference."""
    _without_pinning(monkeypatch)
    torch.set_default_dtype(torch.bfloat16)
    assert _run() != baseline


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_caller_default_dtype_changes_no_bit(baseline, restore_process_state, dtype):
    torch.set_default_dtype(dtype)
    assert torch.tensor([0.7]).dtype == dtype  # the negative control: floats follow it
    assert _run() == baseline
    assert torch.get_default_dtype() == dtype  # the caller's, given back


def test_the_callers_random_stream_is_left_alone():
    """Building, calling and updating a world-size-1 LLM draws nothing from torch's global
    generator: a trainer's own random stream (dropout, shuffling) must not depend on whether
    its rollout engine runs in its process or over Ray. nn.Embedding's init drew vocab x hidden
    normals from it at every build (a rebuild after a fault too)."""
    torch.manual_seed(0)
    before = torch.get_rng_state()
    llm = LLM(str(TINY_CONFIG))
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.score([PROMPTS[0]], [1], use_tqdm=False)
    finally:
        llm.shutdown()
    assert torch.equal(torch.get_rng_state(), before)
    torch.rand(1)  # the negative control: a draw does show
    assert not torch.equal(torch.get_rng_state(), before)


TINY_GPU = TINY_CONFIG.parent / "tiny_gpu.yaml"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_caller_tf32_and_default_dtype_change_no_bit(restore_process_state, monkeypatch):
    """The same on the GPU, with torch's CUDA API: a caller with TF32 on through the legacy
    API and a bf16 default dtype gets the bits of a caller at torch's defaults, its settings
    come back readable by both APIs, and without the pinning its bits differ (the control)."""
    baseline = _run(TINY_GPU)
    a = torch.randn(256, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    exact = a @ a
    torch.set_float32_matmul_precision("high")
    assert not torch.equal(a @ a, exact)  # TF32 bites on this GPU
    torch.set_default_dtype(torch.bfloat16)
    assert _run(TINY_GPU) == baseline
    assert _legacy_tf32_state() == ("high", True)  # the caller's, given back, readable
    assert torch.get_default_dtype() == torch.bfloat16
    _without_pinning(monkeypatch)
    assert _run(TINY_GPU) != baseline
