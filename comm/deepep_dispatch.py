"""DeepEPDispatcher: the MoE exchange over DeepEP v2's ElasticBuffer, as transport only.

DeepEP's combine can't give AllToAllDispatcher's bits: it takes bf16 rows, never multiplies by
the top-k weights and rounds its fp32 slot sum to bf16, so the caller would have to round each
w * y to bf16 first. Here every (token, slot) pair travels as its own "virtual token" v = t*K + k
with one expert id; DeepEP's deterministic expand order is then (local slot, source rank, token,
slot), AllToAllDispatcher's order, and its combine returns each row home unreduced (one valid
slot per output row: a bf16 add of +0). The op table's moe_combine does the weighted fp32 sum.
Written from DeepEP's source (file:line below, paths under its repository root) and NOT yet
run on GPUs; `deep_ep` is imported only when a dispatcher is built.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from comm.dispatch import DispatchLayout, RankExchange, _check_routing
from comm.errors import collective_guard

# Combine's hidden size must be a multiple of 256 (deep_ep/include/deep_ep/impls/combine.cuh:109);
# this also covers dispatch's 16- and 32-byte row alignment for bf16.
HIDDEN_MULTIPLE = 256
# DeepEP's global source index src_rank * max_tokens + token is an int32
# (deep_ep/include/deep_ep/impls/dispatch.cuh:332).
MAX_GLOBAL_TOKENS = 2**31


def is_deepep_installed() -> bool:
    """Whether `deep_ep` can be found, without importing it (the import initialises CUDA)."""
    return importlib.util.find_spec("deep_ep") is not None


def check_deepep_shapes(
    hidden: int, max_tokens_per_rank: int, num_topk: int, world_size: int
) -> int:
    """Raise ValueError naming the value DeepEP can't take; -> its per-rank virtual-token bound
    max_tokens_per_rank * num_topk (one virtual token per (token, slot))."""
    if hidden % HIDDEN_MULTIPLE:
        raise ValueError(
            f"the DeepEP backend needs model.hidden_size to be a multiple of {HIDDEN_MULTIPLE} "
            f"(DeepEP's combine), got {hidden}"
        )
    max_virtual = max_tokens_per_rank * num_topk
    if world_size * max_virtual >= MAX_GLOBAL_TOKENS:
        raise ValueError(
            f"the DeepEP backend indexes world_size * scheduler.max_num_batched_tokens * top-k = "
            f"{world_size} * {max_tokens_per_rank} * {num_topk} tokens in int32; lower "
            "scheduler.max_num_batched_tokens"
        )
    return max_virtual


def virtual_tokens(
    x: torch.Tensor, topk_phys_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], physical ids [T, K] -> (xv [V, D], idv [V, 1] int64): virtual token v = t*K + k
    is x[t] bound for ids[t, k] alone. V = T*K, or 1 when T*K = 0: a dummy row with id -1 (no
    selection, elastic.py's dispatch docstring), because T = 0 is untested upstream
    (tests/elastic/test_ep.py:62 sends at least one token) and every rank must join each call."""
    num_topk = topk_phys_ids.shape[1]
    if topk_phys_ids.numel() == 0:
        dummy_ids = torch.full((1, 1), -1, dtype=torch.int64, device=topk_phys_ids.device)
        return x.new_zeros(1, x.shape[1]), dummy_ids
    xv = x.repeat_interleave(num_topk, dim=0)  # row copies only
    return xv, topk_phys_ids.reshape(-1, 1).contiguous()


def rows_in_slot_order(combined: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP combine's output [V, D] (row v = virtual token v's expert result) -> (its first
    num_rows = T*K rows, their flat (token * K + slot) ids [T*K]): the dummy row is dropped and
    each row's slot is its own index, ready for moe_combine."""
    rows = combined[:num_rows]
    return rows, torch.arange(num_rows, device=combined.device)


@dataclass(frozen=True)
class DeepEPHandle:
    """What combine needs: DeepEP's own handle (its EPHandle: recv_src_metadata, topk_idx and
    the per-rank prefix sums, elastic.py:1092-1106)."""

    deepep_handle: Any


class DeepEPDispatcher(RankExchange):
    """Dispatch/combine over deep_ep.ElasticBuffer on `group` (NCCL, one GPU per rank, all
    ranks in one NVLink domain; the NCCL loaded into torch must be >= 2.30.4). Not capturable,
    so the graph runner keeps its MoE layers eager and never asks it to agree a bucket or count
    served rows (AllToAllDispatcher's surface).

    Construction is a collective (every rank, together). Every rank must call dispatch and
    combine the same number of times, in the same order, a rank with no tokens too: DeepEP's
    kernels barrier across ranks (impls/dispatch.cuh:74-76, impls/combine.cuh:78-80).
    deterministic=True and allow_multiple_reduction=False always: the received order is then
    AllToAllDispatcher's and every row comes home alone, so both kernel modes get its bits
    (fast mode differs only through the op table's moe_combine). Timeouts: DeepEP's host wait
    for counts raises after timeout_s (csrc/elastic/buffer.hpp:1060-1063); its device waits trap
    after timeout_s, which kills the CUDA context (the rank must restart).
    """

    # dispatch spins on the host for the counts (do_cpu_sync, buffer.hpp:1017-1064) and the
    # deterministic re-sort indexes with boolean masks (elastic.py:184, 192): host syncs.
    is_capturable = False

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        num_local_slots: int,
        hidden: int,
        max_tokens_per_rank: int,
        num_topk: int,
        device: torch.device | str,
        moe_combine: Callable,
        timeout_s: float,
    ) -> None:
        max_virtual = check_deepep_shapes(hidden, max_tokens_per_rank, num_topk, world_size)
        super().__init__(group, rank, world_size, num_local_slots, device, moe_combine)
        self.max_tokens_per_rank = max_tokens_per_rank
        self._num_remote = torch.zeros((), dtype=torch.int64, device=self.device)
        try:
            import deep_ep  # lazily: CI and CPU runs never need it
        except ImportError as exc:
            raise RuntimeError(
                "parallel.ep_backend 'deepep' needs the deep_ep package (see README: DeepEP)"
            ) from exc
        # Collective (all ranks, once, before the buffer): torch creates its NCCL communicator
        # lazily (init_process_group has no device_id), and DeepEP reuses that communicator's
        # pointer (deep_ep/utils/comm.py:61-64); one collective makes sure it exists.
        with collective_guard(rank, "DeepEP warm-up all_reduce"):
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
        # A torch dtype, int64 unless built with EP_NUM_TOPK_IDX_BITS=32 (csrc/python_api.cpp:29).
        self._topk_idx_dtype = deep_ep.topk_idx_t
        timeout = max(1, math.ceil(timeout_s))  # DeepEP takes whole seconds
        # Collective: the constructor registers an NCCL window and ends in a barrier
        # (deep_ep/buffers/elastic.py:301, 365-367). Sizes: one expert per virtual token.
        with collective_guard(rank, "DeepEP ElasticBuffer"):
            self._buffer = deep_ep.ElasticBuffer(
                group,
                num_max_tokens_per_rank=max_virtual,
                hidden=hidden,
                num_topk=1,
                deterministic=True,
                allow_hybrid_mode=False,
                allow_multiple_reduction=False,
                num_cpu_timeout_secs=timeout,
                num_gpu_timeout_secs=timeout,
                explicitly_destroy=True,
            )

    @property
    def num_rows_sent_remote(self) -> int:
        return int(self._num_remote)  # host sync: stats only, never inside a step

    def dispatch(
        self,
        x: torch.Tensor,
        topk_phys_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layout: DispatchLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DeepEPHandle]:
        """x [T, D] bf16 -> recv_x [N, D] sorted by (local slot, source rank, token, slot),
        group sizes [L] int64 on x's device, handle. `layout` is accepted and unused."""
        _check_routing(x, topk_phys_ids, topk_weights)
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the DeepEP backend moves bf16 rows only, got x {x.dtype}")
        if x.shape[0] > self.max_tokens_per_rank:
            # This rank's own count, refused by it alone (DeepEP's dispatch is one call, with no
            # agreement to carry a refusal): its peers wait out timeout_s, so the rank is named.
            raise ValueError(
                f"rank {self.rank}: {x.shape[0]} tokens exceed the DeepEP buffer's "
                f"scheduler.max_num_batched_tokens = {self.max_tokens_per_rank}"
            )
        xv, idv = virtual_tokens(x, topk_phys_ids)
        # Collective (all ranks, once per MoE layer): expand mode gives one row per (virtual
        # token, expert) grouped by local expert (buffer.hpp:1102-1110); expert_alignment 1
        # adds no padding; do_cpu_sync (the default) sizes recv_x exactly, a host sync; with
        # deterministic=True the rows are re-sorted by (local expert, source rank, v)
        # (elastic.py:161-192): v = t*K + k makes that the runtime's order.
        with collective_guard(self.rank, "DeepEP dispatch"):
            recv_x, _, _, handle, _ = self._buffer.dispatch(
                xv,
                topk_idx=idv.to(self._topk_idx_dtype),
                num_experts=self.world_size * self.num_local_slots,
                expert_alignment=1,
                do_cpu_sync=True,
                do_expand=True,
            )
        group_sizes = handle.num_unaligned_recv_tokens_per_expert.long()
        is_local = topk_phys_ids.reshape(-1) // self.num_local_slots == self.rank
        # Dispatch sends the non-local rows; combine will return the rows other ranks sent here.
        num_local = is_local.sum()
        self._num_remote += (topk_phys_ids.numel() - num_local) + (group_sizes.sum() - num_local)
        return recv_x, group_sizes, DeepEPHandle(handle)

    def combine(
        self, y: torch.Tensor, handle: DeepEPHandle, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """y [N, D] bf16 in recv_x's order -> out [T, D] fp32 on the source rank."""
        if y.dtype != torch.bfloat16:
            raise ValueError(f"the DeepEP backend moves bf16 rows only, got y {y.dtype}")
        # Collective (all ranks, once per dispatch): without weights (expand mode without
        # multiple reduction forbids them, impls/combine.cuh:67-69) each virtual token has one
        # valid slot, so the reduce epilogue adds the row to +0 in bf16
        # (impls/combine_utils.cuh:212-255): the row comes home unchanged except -0 as +0.
        # On CUDA the op table's combine starts its fp32 sum from +0
        # (moe_kernels/triton_combine.py), so -0 and +0 give the same bits there.
        with collective_guard(self.rank, "DeepEP combine"):
            combined, _, _ = self._buffer.combine(y.contiguous(), handle.deepep_handle)
        rows, slot_ids = rows_in_slot_order(combined, topk_weights.numel())
        return self.moe_combine(rows, slot_ids, topk_weights, row_of_slot=slot_ids)

    def close(self) -> None:
        """Free DeepEP's buffer (built with explicitly_destroy=True). Collective: DeepEP's
        destroy starts with a barrier (csrc/elastic/buffer.hpp:152-166), so every rank calls it,
        before the process group goes. The engine's Ray workers are killed with their process
        and never call it; tests that build dispatchers do."""
        self._buffer.destroy()
