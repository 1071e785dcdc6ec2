"""Worker: one rank of the runtime — its share of the experts, a full copy of the rest, a KV cache.

The driver creates one per rank (in-process for a single rank, a Ray actor otherwise), calls
`init` on all of them at once (the process-group rendezvous is a collective), then `execute`
on all of them every step, in lockstep: every MoE layer is a collective, so a rank with no
requests still runs the step on zero tokens. This module never imports ray.
"""

from __future__ import annotations

import socket

import torch

from comm.dispatch import AllToAllDispatcher, LocalDispatcher
from comm.groups import destroy_process_groups, init_process_groups
from eplb.placement import ExpertPlacement
from kernels import build_op_table, pin_threads
from moe_runtime.config import RuntimeConfig
from moe_runtime.model.loader import build_model
from moe_runtime.model.tensor_parallel import TensorParallel
from moe_runtime.model_runner import ModelRunner
from moe_runtime.sampler import SampleResult
from moe_runtime.scheduler import ScheduledChunk


class Worker:
    def __init__(self, config: RuntimeConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.runner: ModelRunner | None = None
        self.dispatcher = None
        self.num_steps = 0

    def address(self) -> tuple[str, int]:
        """(ip, free port) of this worker's node: rank 0's is the rendezvous point."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return socket.gethostbyname(socket.gethostname()), port

    def init(self, master_addr: str, master_port: int) -> None:
        cfg, parallel = self.config, self.config.parallel
        pin_threads(cfg.kernels)
        device = torch.device(parallel.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
            device = torch.device("cuda", 0)
        ops = build_op_table(cfg.kernels, device)
        world = parallel.world_size
        num_moe = cfg.model.num_hidden_layers - cfg.model.first_k_dense_replace
        # A placement needs one layer at least; an all-dense model uses none of its rows.
        placement = ExpertPlacement.default(
            max(num_moe, 1), cfg.model.n_routed_experts, cfg.eplb.num_redundant_experts, world
        )
        slots = placement.num_physical // world
        tp = TensorParallel()
        if world > 1:
            groups = init_process_groups(parallel, self.rank, master_addr, master_port)
            tp = TensorParallel(groups.tp_size, groups.tp_rank, groups.tp_group)
            # Experts are parallel over the whole world; the TP ranks of one DP group hold the
            # same tokens after every all-reduce and each dispatches its own copy.
            self.dispatcher = AllToAllDispatcher(
                groups.ep_group, self.rank, world, slots, parallel.allow_multiple_reduction, device
            )
        else:
            self.dispatcher = LocalDispatcher(slots, parallel.allow_multiple_reduction)
        local_experts = placement.local_experts(self.rank, world)[:num_moe].tolist()
        model = build_model(cfg.model, ops, device, local_experts, tp)
        if num_moe:
            model.bind_expert_parallel(
                self.dispatcher, placement.replica_table(world)[:, self.rank]
            )
        self.runner = ModelRunner(
            model, ops, cfg.cache.num_blocks, cfg.cache.block_size, device, must_join=world > 1
        )

    def execute(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[dict[int, SampleResult], dict[int, list[float]]]:
        self.num_steps += 1
        return self.runner.step(chunks)

    def stats(self) -> dict:
        """Counters of this rank; `slot_load[l][s]` = rows served by local slot s of MoE layer l."""
        model = self.runner.model
        return {
            "rank": self.rank,
            "num_steps": self.num_steps,
            "num_rows_sent_remote": getattr(self.dispatcher, "num_rows_sent_remote", 0),
            "slot_load": [list(moe.slot_load) for moe in model.moe_layers],
        }

    def shutdown(self) -> None:
        destroy_process_groups()
