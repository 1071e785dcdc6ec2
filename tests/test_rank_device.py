"""Which CUDA device a rank runs on, and the caller's current device at world size 1.

Worker.init called torch.cuda.set_device(0): right for a Ray rank (its one visible GPU is
device 0) but, for a rank in the caller's process, it moved a trainer on GPU k to GPU 0 for
good and built the model there. And Triton launches kernels, torch records events and CUDA
graphs capture on the current device, so a caller that made its own GPU current again had the
rank's kernels launched on the wrong device. Checked on CPU with torch.cuda's device calls
stood in for: the rank takes the current device and sets none; every call into a world-size-1
rank runs with the rank's device current and gives the caller's back.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from moe_runtime.config import load_config
from moe_runtime.executor.local import LocalExecutor
from moe_runtime.worker import worker as worker_module
from moe_runtime.worker.worker import Worker
from tests.invariance import TINY_CONFIG


class _FakeCuda:
    """torch.cuda's current device, per the calls made: set_device and the device context."""

    def __init__(self, current: int) -> None:
        self.current, self.set_calls = current, []

    def set_device(self, index) -> None:
        self.set_calls.append(index)
        self.current = torch.device(index).index if not isinstance(index, int) else index

    def current_device(self) -> int:
        return self.current

    @contextlib.contextmanager
    def device(self, device):
        before, self.current = self.current, torch.device(device).index
        try:
            yield
        finally:
            self.current = before


@pytest.fixture
def fake_cuda(monkeypatch) -> _FakeCuda:
    fake = _FakeCuda(current=3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("set_device", "current_device", "device"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


class _Built(Exception):
    """Raised where the worker would build its op table: init got that far."""


def test_a_rank_takes_the_current_device_and_sets_none(monkeypatch, fake_cuda):
    chosen = []

    def build_op_table(kernels, device):
        chosen.append(device)
        raise _Built

    monkeypatch.setattr(worker_module, "build_op_table", build_op_table)
    monkeypatch.setattr(worker_module, "pin_threads", lambda kernels: None)
    config = load_config(TINY_CONFIG, {"parallel.device": "cuda"})
    with pytest.raises(_Built):
        Worker(config, rank=0).init("127.0.0.1", 0, _placement(config))
    assert chosen == [torch.device("cuda", 3)], chosen
    assert fake_cuda.set_calls == [] and fake_cuda.current == 3


def _placement(config) -> list[list[int]]:
    num_experts = config.model.n_routed_experts
    return [list(range(num_experts)) for _ in range(config.model.num_moe_layers)]


class _RecordingWorker:
    """A rank's stand-in: records the current device of every call."""

    def __init__(self, fake: _FakeCuda) -> None:
        self.fake, self.seen = fake, []

    def execute(self, step):
        self.seen.append(("execute", self.fake.current))
        return step

    def stats(self):
        self.seen.append(("stats", self.fake.current))
        return {}


def test_every_call_runs_on_the_rank_s_device_and_gives_the_caller_s_back(fake_cuda):
    executor = LocalExecutor.__new__(LocalExecutor)
    executor.config = load_config(TINY_CONFIG, {"parallel.device": "cuda"})
    executor.worker = worker = _RecordingWorker(fake_cuda)
    executor.device = torch.device("cuda", 1)  # the rank's GPU; the caller's is 3
    executor.execute(["step"])
    executor.call_all("stats")
    assert worker.seen == [("execute", 1), ("stats", 1)], worker.seen
    assert fake_cuda.current == 3  # the caller's device after each call


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_world_size_1_serves_on_the_caller_s_gpu_whatever_it_makes_current():
    """A caller on GPU 1 builds an LLM (graphs and lookaheads on): the model lives on GPU 1,
    the caller stays on GPU 1; with GPU 0 made current afterwards the rank still runs on GPU
    1 (Triton launches, events, graph captures there) and gives GPU 1's bits."""
    from pathlib import Path

    from moe_runtime import LLM, SamplingParams

    tiny_gpu = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_gpu.yaml"
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, logprobs=3, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 42], [72, 101, 108]]
    torch.cuda.set_device(1)
    try:
        llm = LLM(tiny_gpu, **{"kernels.cuda_graphs": True})
        try:
            assert torch.cuda.current_device() == 1, "building the LLM moved the caller"
            runner = llm.engine.executor.worker.runner
            assert runner.device == torch.device("cuda", 1), runner.device
            on_1 = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
            torch.cuda.set_device(0)
            on_0 = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
            assert torch.cuda.current_device() == 0, "a step moved the caller"
            assert on_0 == on_1
            assert runner.graphs.num_replays > 0  # engagement: graphs ran
        finally:
            llm.shutdown()
    finally:
        torch.cuda.set_device(0)


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_two_llms_on_two_gpus_of_one_process_capture_their_own_graphs():
    """torch.cuda.graph's default capture stream is made once per process on the device then
    current: an LLM on GPU 0 built after one on GPU 1 captured on GPU 1's stream. Each
    DecodeGraphRunner now captures on a stream of its own device: both serve, with graphs."""
    from pathlib import Path

    from moe_runtime import LLM, SamplingParams

    tiny_gpu = Path(__file__).resolve().parent.parent / "launch" / "configs" / "tiny_gpu.yaml"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llms = []
    try:
        for index in (1, 0):
            torch.cuda.set_device(index)
            llm = LLM(tiny_gpu, **{"kernels.cuda_graphs": True})
            llms.append(llm)
            outputs = llm.generate([[5, 17, 99, 3]], params)
            assert len(outputs[0].token_ids) == 8
            assert llm.engine.executor.worker.runner.graphs.num_replays > 0, index
    finally:
        for llm in llms:
            llm.shutdown()
        torch.cuda.set_device(0)


class _FakeRank:
    """A world-size-1 rank's stand-in for WorkerGroup: built on the current device."""

    def __init__(self, fake: _FakeCuda) -> None:
        self.fake = fake

    def init(self, master_addr, master_port, physical_to_logical) -> None:
        self.runner = SimpleNamespace(device=torch.device("cuda", self.fake.current))

    def num_kv_blocks(self) -> int:
        return 1 << 20

    def shutdown(self) -> None:
        pass


def test_a_rebuilt_rank_stays_on_the_device_of_the_rank_it_replaces(monkeypatch, fake_cuda):
    """A rebuild (LLM.restart, the server's after a fault) ran on whichever device the thread
    calling it had current: AsyncEngine's loop thread, CUDA's device 0; a caller that made
    another GPU current since. The rank built on GPU 1 came back on GPU 0 (or 3), beside
    another process's memory. Now it is rebuilt on its own device."""
    from eplb.placement import ExpertPlacement
    from moe_runtime.engine.worker_group import WorkerGroup
    from moe_runtime.executor import local as local_module

    monkeypatch.setattr(local_module, "Worker", lambda *args: _FakeRank(fake_cuda))
    config = load_config(TINY_CONFIG, {"parallel.device": "cuda"})
    model = config.model
    placement = ExpertPlacement.default(model.num_moe_layers, model.n_routed_experts, 0, 1)
    fake_cuda.current = 1  # the caller's GPU when it built the LLM
    group = WorkerGroup(config, placement)
    assert group.executor.worker.runner.device == torch.device("cuda", 1)
    fake_cuda.current = 0  # the loop thread's device, or the caller moved on
    group.rebuild(placement, "rank 0 died", is_counted=True)
    assert group.executor.worker.runner.device == torch.device("cuda", 1)
    assert fake_cuda.current == 0  # the rebuilding thread's device is given back
