"""LocalExecutor: the single rank, in this process (parallel.world_size 1)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from moe_kernels import pin_threads
from moe_kernels.op_table import is_pinned, process_state, restore_process_state
from moe_runtime.config import RuntimeConfig
from moe_runtime.worker.step_input import StepInput, StepOutput, WorkerError
from moe_runtime.worker.worker import Worker


class LocalExecutor:
    def __init__(
        self,
        config: RuntimeConfig,
        physical_to_logical: list[list[int]],
        device: torch.device | None = None,
        sampled_vocab_size: int | None = None,
    ) -> None:
        """device: the CUDA device to build the rank on (a rebuild's: the old rank's, whatever
        the rebuilding thread has current); None: the current one, the caller's.
        sampled_vocab_size: the Worker's."""
        if config.parallel.world_size != 1:
            raise ValueError(
                f"LocalExecutor runs one rank, parallel.world_size is {config.parallel.world_size}"
            )
        self.config = config
        with self._own_threads(), _current_device(device):
            self.worker: Worker | None = Worker(config, 0, sampled_vocab_size)
            self.worker.init("127.0.0.1", 0, physical_to_logical)
        self.device = self.worker.runner.device  # the rank's, current during every call

    @contextlib.contextmanager
    def _on_rank(self) -> Iterator[None]:
        """_own_threads, and the rank's CUDA device current for the block (the caller's back
        after it). Why: Triton launches its kernels, torch records events and CUDA graphs
        capture on the current device, so a caller that made another GPU current after
        building the LLM had the rank's kernels launched there on this device's memory."""
        with self._own_threads(), _current_device(self.device):
            yield

    @contextlib.contextmanager
    def _own_threads(self) -> Iterator[None]:
        """The rank's kernels.num_threads (and torch's default fp32 matmul precision and
        dtype: pin_threads) for the block, the caller's settings back after it.

        Why: torch's intra-op thread count is the process's, and this rank runs in the
        caller's. Pinned once at init, it cut a caller's count (a trainer's 8 threads) to the
        rank's for good, and a second LLM of another count changed the first one's steps. Two
        such LLMs called from two threads at once still share the one count meanwhile. The
        caller's `torch.set_float32_matmul_precision("medium")` (bf16 oneDNN matmuls) or
        `torch.set_default_dtype(torch.bfloat16)` changed this rank's bits likewise, unlike a
        Ray rank's, the CLI's or the server's (tests/test_process_state.py)."""
        caller = process_state()
        if is_pinned(caller, self.config.kernels):  # the usual case: nothing to switch
            yield
            return
        pin_threads(self.config.kernels)
        try:
            yield
        finally:
            restore_process_state(caller)

    def _rank(self) -> Worker:
        if self.worker is None:
            raise WorkerError("rank 0 is shut down")
        return self.worker

    def execute(self, per_rank_inputs: list[StepInput]) -> list[StepOutput]:
        with self._on_rank():
            return [self._rank().execute(per_rank_inputs[0])]

    def call(
        self,
        method: str,
        per_rank_args: list[tuple],
        timeout_s: float | None = None,
        timeout_key: str | None = None,
    ) -> list:
        """Run Worker.<method> on every rank with its own arguments; results in rank order.
        timeout_s (and timeout_key) is the Ray executor's bound; a call in this process has
        none to keep."""
        with self._on_rank():
            return [getattr(self._rank(), method)(*per_rank_args[0])]

    def call_all(
        self,
        method: str,
        *args,
        timeout_s: float | None = None,
        timeout_key: str | None = None,
    ) -> list:
        return self.call(method, [args], timeout_s, timeout_key)

    def silent_ranks(self, timeout_s: float) -> list[int]:
        """[]: the one rank runs in this process, beside whatever asks: nothing to ping."""
        return []

    def dead_ranks(self) -> list[int]:
        """[]: the one rank is this process."""
        return []

    def kill_ranks(self, ranks: list[int], why: str) -> None:
        """Nothing: the one rank is this process, and silent_ranks never names it."""

    def shutdown(self) -> None:
        """Shut the rank down and let go of it: its model, KV cache and graphs are freed here,
        so a rebuild's new rank sizes its cache (cache.num_blocks 0) from memory they no longer
        hold. Later calls raise WorkerError."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        worker.shutdown()
        del worker
        gc.collect()  # the model's reference cycles (modules, graphs)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # free to mem_get_info, not only to this allocator


def _current_device(device: torch.device | None) -> contextlib.AbstractContextManager:
    """torch.cuda.device(device) for a CUDA device, else nothing to switch."""
    is_cuda = device is not None and device.type == "cuda"
    return torch.cuda.device(device) if is_cuda else contextlib.nullcontext()
