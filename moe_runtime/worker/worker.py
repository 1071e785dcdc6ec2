"""Worker: one rank of the runtime — its share of the experts, a full copy of the rest, a KV cache.

The driver creates one per rank (in-process for a single rank, a Ray actor otherwise), calls
`init` on all of them at once (the process-group rendezvous is a collective) with the expert
placement it owns, then `execute` on all of them every step, in lockstep: every MoE layer is a
collective, so a rank with no requests still runs the step on zero tokens. Each step arrives as
a `StepInput` (the wire format): the worker keeps its own copy of every sequence it serves and
applies the step's deltas to it; it never sees the driver's objects. `rearrange` and a weight
update's `prepare_weights` / `commit_weights` (or `discard_weights`) run between steps, on all
ranks together. This module never imports ray.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections import deque
from pathlib import Path

import numpy as np
import torch

from comm.capacity_dispatch import FixedCapacityDispatcher
from comm.deepep_dispatch import DeepEPDispatcher
from comm.dispatch import AllToAllDispatcher, LocalDispatcher
from comm.groups import destroy_process_groups, init_process_groups, open_rendezvous
from eplb.placement import ExpertPlacement
from eplb.rearrange import rearrange_experts
from moe_kernels import build_op_table, pin_threads
from moe_runtime.config import RuntimeConfig
from moe_runtime.heap import freeze
from moe_runtime.model.deepseek import TORCH_DTYPES
from moe_runtime.model.loader import build_model, read_checkpoint
from moe_runtime.model.tensor_parallel import TensorParallel
from moe_runtime.model.weight_checks import assign_weights, check_weights
from moe_runtime.worker.model_runner import ModelRunner
from moe_runtime.worker.sequence_state import Chunk, SequenceState
from moe_runtime.worker.step_input import StepInput, StepOutput

log = logging.getLogger("moe_runtime.eplb")


def kv_cache_blocks(config: RuntimeConfig, device: torch.device) -> int:
    """cache.num_blocks, or when it is 0 the blocks that fit in gpu_memory_utilization of the
    device memory free now (after the weights) less the largest step's fp32 logits, over all
    layers' latent caches. Why the logits first: a scoring step's every row has them
    (max_num_batched_tokens x the vocabulary, whole on every TP rank), 3.1 GiB at V2-Lite's
    8192 x 102400, while 0.9 of the free memory left 4.8 GiB on an H100 for every activation:
    a score of 8000 tokens ran out of memory there (BENCHMARKS.md, fiftieth session: the
    scoring step's logits; tests/test_gpu_golden.py, the full-budget scoring)."""
    cache, model = config.cache, config.model
    if not cache.is_sized_from_memory:
        return cache.num_blocks
    if device.type != "cuda":
        raise ValueError(
            f"cache.num_blocks: 0 sizes the cache from free GPU memory; device {device} has "
            "none to measure, set cache.num_blocks >= 1"
        )
    free_bytes, _ = torch.cuda.mem_get_info(device)
    elem_bytes = torch.finfo(TORCH_DTYPES[model.dtype]).bits // 8
    block_bytes = model.num_hidden_layers * cache.block_size * model.latent_dim * elem_bytes
    logits_bytes = config.scheduler.max_num_batched_tokens * model.vocab_size * 4
    num_blocks = int((free_bytes - logits_bytes) * cache.gpu_memory_utilization) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"no KV block fits: {free_bytes / 2**30:.2f} GiB free on {device} after the weights, "
            f"{logits_bytes / 2**30:.2f} GiB of it kept for a step's logits "
            f"(scheduler.max_num_batched_tokens {config.scheduler.max_num_batched_tokens} x "
            f"model.vocab_size {model.vocab_size} x 4 bytes), "
            f"cache.gpu_memory_utilization={cache.gpu_memory_utilization}"
        )
    return num_blocks


def device_identity(device: torch.device) -> dict[str, str]:
    """What of this rank's hardware and libraries a row's bits may depend on: the device kind
    (CUDA: its name and compute capability, and the CUDA torch was built for; CPU: the
    instruction set torch's kernels dispatch to) and the bits of a fixed probe product (a
    seeded fp32 and bf16 matmul on the device), which tells apart BLAS code paths the names
    do not (e.g. MKL told to use AVX2 alone on an AVX-512 host)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        identity = {
            "device": "cuda",
            "name": torch.cuda.get_device_name(device),
            "capability": f"{major}.{minor}",
            "cuda": str(torch.version.cuda),
        }
    else:
        capability = torch.backends.cpu.get_cpu_capability()
        identity = {"device": device.type, "cpu_capability": capability}
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(33, 515, generator=generator), torch.randn(515, 67, generator=generator)
    probe = hashlib.sha256()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks of one machine may hold different thread counts
    try:
        for dtype in (torch.float32, torch.bfloat16):
            product = torch.matmul(a.to(device, dtype), b.to(device, dtype))
            probe.update(product.float().cpu().numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
    return identity | {"matmul_probe": probe.hexdigest()[:16]}


class Worker:
    def __init__(
        self, config: RuntimeConfig, rank: int, sampled_vocab_size: int | None = None
    ) -> None:
        """sampled_vocab_size: the driver's tokenizer's size; ids at or past it (the padding
        of model.vocab_size) are never sampled (Sampler). None: any id."""
        self.config, self.rank = config, rank
        self.sampled_vocab_size = sampled_vocab_size
        self.world_size = config.parallel.world_size
        self.runner: ModelRunner | None = None
        self.dispatcher = None
        self.group = None
        self.placement: ExpertPlacement | None = None  # the driver's, given at init
        self.seqs: dict[int, SequenceState] = {}
        self.staged_weights: dict[str, torch.Tensor] | None = None
        self.rendezvous_store = None  # rank 0's between open_rendezvous and init
        self.num_steps = 0
        self.load_window: deque[np.ndarray] = deque(maxlen=config.eplb.window_steps)
        self.total_load: np.ndarray | None = None

    def pid(self) -> int:
        """This worker's process id (fault-injection tests signal it)."""
        return os.getpid()

    def freeze_heap(self) -> int:
        """Keep this process's start-up objects out of the cyclic collector (moe_runtime/heap.py):
        for a worker in a process of its own (a Ray actor), after init; -> objects frozen."""
        return freeze()

    def configure_logging(self, level: int) -> None:
        """For a worker in a process of its own (a Ray actor): the runtime's records from
        `level` up (the driver's threshold: loading progress, timings) on this process's
        stderr, which Ray forwards to the driver's, prefixed with this rank. Without it Python's
        default drops everything below WARNING there."""
        logger = logging.getLogger("moe_runtime")
        logger.setLevel(level)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            fmt = f"%(asctime)s %(levelname)s %(name)s (rank {self.rank}): %(message)s"
            handler.setFormatter(logging.Formatter(fmt))
            logger.addHandler(handler)

    def ping(self) -> int:
        """This worker's rank: the cheap call the engine makes to check an idle worker lives."""
        return self.rank

    def hold(self) -> None:
        """Never returns. The Ray driver keeps one call of it running on each rank (beside the
        ping, in the liveness concurrency group), so a rank's death fails that call at once and
        the driver sees it without asking (RayExecutor.dead_ranks)."""
        threading.Event().wait()

    def open_rendezvous(self) -> int:
        """Rank 0, before init: the rendezvous store listening on this node, held until init
        joins it (comm.groups.open_rendezvous says why) -> its port. (The node's address is
        Ray's for it, which the driver knows: the one this host's name resolves to may be
        loopback, or nothing.)"""
        self.rendezvous_store = open_rendezvous(self.config.parallel)
        return self.rendezvous_store.port

    def init(
        self, master_addr: str, master_port: int, physical_to_logical: list[list[int]]
    ) -> None:
        """Collective: joins the process groups, builds the model with this rank's experts of
        the driver's placement ([layer][physical slot] -> logical expert)."""
        cfg, parallel = self.config, self.config.parallel
        self.placement = ExpertPlacement.from_physical_to_logical(
            torch.tensor(physical_to_logical, dtype=torch.int64), cfg.model.n_routed_experts
        )
        pin_threads(cfg.kernels)
        device = torch.device(parallel.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"parallel.device is 'cuda' but rank {self.rank} sees no CUDA device "
                    f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
                )
            # The current device, never set here: a Ray rank's is its one visible GPU (device
            # 0), and a rank in the caller's process (world size 1) runs on the caller's GPU
            # and leaves its current device alone (set_device(0) moved a trainer's on GPU k
            # to GPU 0, and its model with it).
            device = torch.device("cuda", torch.cuda.current_device())
        ops = build_op_table(cfg.kernels, device)
        slots = self.placement.num_physical // self.world_size
        tp = TensorParallel()
        if self.world_size > 1:
            store, self.rendezvous_store = self.rendezvous_store, None  # the group holds it
            groups = init_process_groups(parallel, self.rank, master_addr, master_port, store)
            tp = TensorParallel(groups.tp_size, groups.tp_rank, groups.tp_group)
            self.group = groups.ep_group
            # Experts are parallel over the whole world; the TP ranks of one DP group hold the
            # same tokens after every all-reduce and each dispatches its own share. With CUDA
            # graphs over NCCL the exchange has fixed shapes so the MoE layers are captured too;
            # every dispatcher gives the same bits.
            self.dispatcher = self._ep_dispatcher(groups.ep_group, slots, device, ops.moe_combine)
        else:
            self.dispatcher = LocalDispatcher(slots, ops.moe_combine)
        model = build_model(cfg.model, ops, device, self._local_experts(), tp)
        self.runner = ModelRunner(
            model,
            ops,
            kv_cache_blocks(cfg, device),
            cfg.cache.block_size,
            device,
            must_join=self.world_size > 1,
            graph_batch_sizes=cfg.kernels.cuda_graph_batch_sizes if cfg.kernels.cuda_graphs else (),
            max_blocks_per_seq=cfg.max_blocks_per_seq,
            overlap=bool(cfg.scheduler.overlap_decode),
            max_model_len=cfg.scheduler.max_model_len,
            sampled_vocab_size=self.sampled_vocab_size,
        )
        self._bind_placement()

    def _ep_dispatcher(self, group, slots: int, device: torch.device, moe_combine):
        """Collective (DeepEP's buffer is built by all ranks together): this rank's dispatcher."""
        cfg, parallel = self.config, self.config.parallel
        if cfg.uses_deepep:
            return DeepEPDispatcher(
                group,
                self.rank,
                self.world_size,
                slots,
                cfg.model.hidden_size,
                cfg.scheduler.max_num_batched_tokens,  # the most tokens a rank holds in a step
                cfg.model.num_experts_per_tok,
                device,
                moe_combine,
                parallel.timeout_s,
            )
        dispatcher_cls = (
            FixedCapacityDispatcher if cfg.uses_capacity_dispatch else AllToAllDispatcher
        )
        return dispatcher_cls(
            group,
            self.rank,
            self.world_size,
            slots,
            parallel.allow_multiple_reduction,
            device,
            moe_combine,
        )

    def device_identity(self) -> dict[str, str]:
        """This rank's `device_identity` (the device its model runs on)."""
        return device_identity(self.runner.device)

    def num_kv_blocks(self) -> int:
        """KV blocks this rank's cache holds (found at start-up when cache.num_blocks is 0)."""
        return self.runner.num_blocks

    def _local_experts(self) -> list[list[int]]:
        num_moe = self.config.model.num_moe_layers
        return self.placement.local_experts(self.rank, self.world_size)[:num_moe].tolist()

    def _bind_placement(self) -> None:
        model = self.runner.model
        if model.moe_layers:
            table = self.placement.replica_table(self.world_size)[:, self.rank]
            model.bind_expert_parallel(self.dispatcher, table)

    def execute(self, step: StepInput) -> StepOutput:
        self.num_steps += 1
        chunks = self._apply(step)
        out = self.runner.step(chunks, lookahead=step.lookahead)
        step_load = self.runner.slot_counts()  # read back with the step's samples
        if step_load is not None:
            self.load_window.append(step_load)
            self.total_load = step_load if self.total_load is None else self.total_load + step_load
        return out

    def _apply(self, step: StepInput) -> list[Chunk]:
        """Bring the sequences up to date with the step's deltas; -> the step's chunks."""
        for seq_id in step.released_seq_ids:
            del self.seqs[seq_id]
        for new in step.new_seqs:
            self.seqs[new.seq_id] = SequenceState.of(new)
        chunks = []
        for item in step.scheduled:
            seq = self.seqs[item.seq_id]
            seq.token_ids.extend(item.new_token_ids)
            seq.block_table.extend(item.new_block_ids)
            if item.start != seq.num_computed_tokens:
                raise RuntimeError(
                    f"rank {self.rank}: sequence {item.seq_id} scheduled from position "
                    f"{item.start}, but {seq.num_computed_tokens} are computed here"
                )
            seq.num_computed_tokens += item.num_tokens
            chunks.append(Chunk(seq, item.start, item.num_tokens))
        return chunks

    def window_load(self) -> list[list[int]]:
        """[MoE layer][local slot] rows served over the last eplb.window_steps steps."""
        num_moe = self.config.model.num_moe_layers
        slots = self.placement.num_physical // self.world_size
        if not self.load_window:
            return [[0] * slots for _ in range(num_moe)]
        return np.sum(np.stack(self.load_window), axis=0).tolist()

    def rearrange(
        self, new_physical_to_logical: list[list[int]], fail_at_layer: int | None = None
    ) -> dict:
        """Collective: move experts to the new placement, committed on all ranks or on none.

        The plan is checked first (it must be a placement of the current shape): a bad one
        raises ValueError with nothing changed, on every rank alike since all get the same plan,
        before any collective. A local failure while staging (rearrange_experts) is a refusal:
        "ok" False on every rank, the old placement serving."""
        layers = self.runner.model.moe_layers
        new_placement = self._checked_plan(new_physical_to_logical)
        new_p2l = new_placement.physical_to_logical
        old_p2l = self.placement.physical_to_logical[: len(layers)]
        self.runner.lookahead.drop()  # launched with the old placement
        experts = [(moe.experts.gate_up_proj.data, moe.experts.down_proj.data) for moe in layers]
        result = rearrange_experts(
            experts, old_p2l, new_p2l, self.rank, self.world_size, self.group, fail_at_layer
        )
        if result.error is not None:  # this rank's own failure: every rank keeps the old placement
            log.warning("rank %d: rebalance refused, %s", self.rank, result.error)
        if result.ok:
            for moe, (gate_up, down) in zip(layers, result.weights, strict=True):
                moe.experts.gate_up_proj.data, moe.experts.down_proj.data = gate_up, down
            self.placement = new_placement
            self._bind_placement()  # the replica table switches with the weights, at once
            self.load_window.clear()
            if self.runner.graphs is not None:
                self.runner.graphs.reset()  # captured MoE layers hold the old addresses
        return {key: getattr(result, key) for key in ("ok", "experts_moved", "bytes_sent", "error")}

    def _checked_plan(self, physical_to_logical: list[list[int]]) -> ExpertPlacement:
        """The placement a rearrange plan describes; ValueError naming what is wrong with it."""
        current = self.placement.physical_to_logical.shape
        plan = torch.as_tensor(physical_to_logical, dtype=torch.int64)
        if tuple(plan.shape) != tuple(current):
            raise ValueError(
                f"rearrange: the plan's physical_to_logical has shape {tuple(plan.shape)}, the "
                f"placement in use {tuple(current)} (MoE layers x physical slots)"
            )
        return ExpertPlacement.from_physical_to_logical(plan, self.config.model.n_routed_experts)

    def prepare_weights(
        self, source: str | dict[str, torch.Tensor], experts: dict | None = None
    ) -> None:
        """Phase 1 of a weight update (HF names): read and check everything this rank needs,
        in host memory; nothing in use changes. A directory's config.json must describe the
        running model (read_checkpoint). A state dict may come cut in two (WorkerGroup: the
        part every rank reads, and `experts`, this rank's own). Any problem is a ValueError
        (a refusal)."""
        model, self.staged_weights = self.runner.model, None
        name = source if isinstance(source, str) else "the state dict"
        try:
            local = self._local_experts()
            tensors = (
                read_checkpoint(Path(source), model.config, local_experts=local)
                if isinstance(source, str)
                else {**source, **(experts or {})}
            )
            staged = check_weights(model, dict(tensors), local, name)
        except ValueError:
            raise
        except Exception as exc:  # unreadable files: a refusal too, since nothing changed
            raise ValueError(f"weights {name!r}: {type(exc).__name__}: {exc}") from exc
        self.staged_weights = staged

    def commit_weights(self) -> None:
        """Phase 2, once every rank prepared: the staged weights replace the old ones."""
        model, staged, self.staged_weights = self.runner.model, self.staged_weights, None
        self.runner.lookahead.drop()  # launched with the old weights
        assign_weights(model, staged)
        model.after_weights_loaded()
        if self.runner.graphs is not None:
            self.runner.graphs.reset()  # the absorbed MLA weights are new tensors

    def discard_weights(self) -> None:
        self.staged_weights = None

    def stats(self) -> dict:
        """Counters of this rank; `slot_load[l][s]` = rows served by local slot s of MoE layer l;
        `ep_dispatcher` = the dispatcher's class name; `num_graph_segments` = captured pieces of
        a decode step (0 before the first capture or without graphs);
        `num_tp_all_reduces` = row-parallel sums over the TP group this rank ran (0 at tp_size
        1), `num_tp_fp32_gathers` = the all-gathers of fp32 subtree sums among them (invariant
        mode; fast mode sums with the backend's all_reduce instead), `num_tp_share_gathers` =
        MoE layers whose finished rows came from each TP rank's token share,
        `num_tp_head_exchanges` / `num_tp_attention_gathers` = attention layers that swapped
        their heads for token shares / gathered o_proj's finished rows of the shares;
        `num_eager_rows_sent_remote` = the remote rows FixedCapacityDispatcher sent through
        the uneven exchange on steps that replayed no graph (0 with any other dispatcher);
        `num_lookahead_hits` / `num_lookahead_misses` = decode steps launched ahead that served
        the step the engine asked for / that were dropped (scheduler.overlap_decode), and
        `num_unread_launches` those of them queued before the read, fed the sampled ids on the
        device."""
        total = self.total_load.tolist() if self.total_load is not None else []
        tp, graphs, lookahead = self.runner.model.tp, self.runner.graphs, self.runner.lookahead
        is_capacity = isinstance(self.dispatcher, FixedCapacityDispatcher)
        return {
            "rank": self.rank,
            "ep_dispatcher": type(self.dispatcher).__name__,
            "num_graph_replays": graphs.num_replays if graphs is not None else 0,
            # Captured pieces of a decode step: 1 when the MoE layers are inside the graph.
            "num_graph_segments": len(graphs.segments) if graphs is not None else 0,
            "tp_size": tp.size,
            "tp_rank": tp.rank,
            "num_tp_all_reduces": tp.num_calls["all_reduce"],
            "num_tp_fp32_gathers": tp.num_calls["fp32_subtree_gather"],
            "num_tp_share_gathers": tp.num_calls["share_gather"],
            "num_tp_head_exchanges": tp.num_calls["head_exchange"],
            "num_tp_attention_gathers": tp.num_calls["attention_share_gather"],
            "num_steps": self.num_steps,
            "num_rows_sent_remote": self.dispatcher.num_rows_sent_remote,
            "num_eager_rows_sent_remote": (
                self.dispatcher.num_eager_rows_sent_remote if is_capacity else 0
            ),
            "num_lookahead_hits": lookahead.num_hits,
            "num_lookahead_misses": lookahead.num_misses,
            "num_unread_launches": lookahead.num_unread_launches,
            "slot_load": total,
            "physical_to_logical": self.placement.physical_to_logical.tolist(),
        }

    def shutdown(self) -> None:
        """Leave the process groups this rank joined. A single rank joined none (it runs in
        the caller's process): the caller's own torch.distributed group, a trainer's, stays."""
        if self.world_size > 1:
            destroy_process_groups()
