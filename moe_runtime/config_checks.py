"""The checks of a RuntimeConfig that span its sections: the parallel layout against the
model, the attention launch's kernel keys, the DeepEP backend's conditions. Each runs once, as
the config is built, and each failure names the keys and the values that would work."""

from __future__ import annotations

from comm.config import ParallelConfig
from comm.deepep_dispatch import check_deepep_shapes, is_deepep_installed
from comm.groups import select_backend
from eplb.config import EplbConfig
from moe_kernels.attention_launch import WIDE_HEADS, head_launch
from moe_kernels.config import KernelConfig
from moe_runtime.model_config import ModelConfig


def check_attention_launch(
    model: ModelConfig, kernels: KernelConfig, parallel: ParallelConfig
) -> None:
    """The kernel keys that depend on the attention launch the model's head count picks
    (moe_kernels/attention_launch.py)."""
    launch = head_launch(model.num_attention_heads)
    is_wide = launch.is_wide
    is_gpu_invariant = kernels.is_invariant and parallel.device == "cuda"
    if is_gpu_invariant and is_wide and model.dtype != "bfloat16":
        # (moe_kernels/triton_attention.py refuses it too)
        raise ValueError(
            f"kernels.mode 'invariant' on parallel.device 'cuda' with "
            f"model.num_attention_heads={model.num_attention_heads} (>= {WIDE_HEADS}: "
            f"64 heads an attention program) needs model.dtype 'bfloat16', got "
            f"{model.dtype!r} (fp32 cache blocks do not fit in shared memory)"
        )
    if kernels.attention_group_splits and is_wide:
        raise ValueError(
            f"kernels.attention_group_splits={kernels.attention_group_splits} applies to models "
            f"below {WIDE_HEADS} attention heads (16 heads a program), got "
            f"model.num_attention_heads={model.num_attention_heads}: set it to 0"
        )
    size = kernels.attention_long_split_blocks
    if size is not None and (size <= launch.split_blocks or (is_wide and size % 2)):
        even = " and even (the kernel pairs cache blocks)" if is_wide else ""
        raise ValueError(
            f"kernels.attention_long_split_blocks={size} must be above the launch's split of "
            f"{launch.split_blocks} cache blocks{even} at "
            f"model.num_attention_heads={model.num_attention_heads}"
        )


def check_deepep(model: ModelConfig, parallel: ParallelConfig, max_num_batched_tokens: int) -> None:
    """parallel.ep_backend 'deepep': every condition DeepEP needs, each failure naming it."""
    bad = "parallel.ep_backend 'deepep' needs"
    if parallel.device != "cuda":
        raise ValueError(f"{bad} parallel.device 'cuda', got {parallel.device!r}")
    if select_backend(parallel) != "nccl":
        raise ValueError(f"{bad} the nccl backend, got parallel.backend {parallel.backend!r}")
    if parallel.world_size < 2:
        raise ValueError(f"{bad} parallel.world_size >= 2, got {parallel.world_size}")
    if parallel.allow_multiple_reduction:
        # The backend sends every (token, slot) row home alone (DeepEP as transport only).
        raise ValueError(f"{bad} parallel.allow_multiple_reduction: false")
    if parallel.ep_capacity_dispatch == "on":
        # DeepEP's dispatch syncs with the host: it can't be the capturable exchange.
        raise ValueError(f"{bad} parallel.ep_capacity_dispatch 'auto' or 'off', got 'on'")
    if model.dtype != "bfloat16":
        raise ValueError(f"{bad} model.dtype 'bfloat16' (DeepEP moves bf16), got {model.dtype!r}")
    check_deepep_shapes(
        model.hidden_size,
        max_num_batched_tokens,
        model.num_experts_per_tok,
        parallel.world_size,
    )
    if not is_deepep_installed():
        raise ValueError(
            f"{bad} the deep_ep package, which is not installed (README: DeepEP backend)"
        )


def check_layout(
    model: ModelConfig, parallel: ParallelConfig, eplb: EplbConfig, kernels: KernelConfig
) -> None:
    """Every constraint between the parallel layout and the model, here at load, before
    any worker starts; each message names the keys and the values that would work."""
    world, tp = parallel.world_size, parallel.tp_size
    num_physical = model.n_routed_experts + eplb.num_redundant_experts
    _check_expert_slots(model, eplb, world, num_physical)
    _check_tp_splits(model, world, tp)
    if kernels.is_invariant:
        _check_tp_max(model, parallel.tp_size, kernels.tp_max)
    if tp > 1 and model.tie_word_embeddings:
        raise ValueError("model.tie_word_embeddings needs parallel.tp_size 1 (not supported)")
    _check_eplb_nodes(model, eplb, world, num_physical)


def _check_expert_slots(
    model: ModelConfig, eplb: EplbConfig, world: int, num_physical: int
) -> None:
    """The redundant experts' bound, and num_physical expert slots shared equally by ranks."""
    # Each rank sends an expert's rows to one of its replicas (its own first): an expert
    # serves from world_size copies at most, so slots past that would only hold memory.
    most = model.n_routed_experts * max(world - 1, 1)
    if eplb.num_redundant_experts > most:
        raise ValueError(
            f"eplb.num_redundant_experts={eplb.num_redundant_experts} is more than {most}: "
            f"an expert serves rows from at most parallel.world_size={world} copies (each "
            "rank sends its rows to one replica, its own first), so slots past "
            "model.n_routed_experts x (world_size - 1) would only hold memory (world size "
            "1, where no replica serves rows, accepts up to model.n_routed_experts)"
        )
    if num_physical % world:
        raise ValueError(
            f"parallel.world_size={world} must divide model.n_routed_experts + "
            f"eplb.num_redundant_experts = {num_physical} (each rank holds as many expert "
            f"slots); valid world sizes: {_divisors(num_physical)}"
        )


def _check_tp_splits(model: ModelConfig, world: int, tp: int) -> None:
    """tp_size divides every dimension TP splits: heads, vocab, the dense MLP's width."""
    splits = {"model.num_attention_heads": model.num_attention_heads}
    splits["model.vocab_size"] = model.vocab_size
    if model.first_k_dense_replace:
        splits["model.intermediate_size"] = model.intermediate_size
    for key, total in splits.items():
        if total % tp:
            valid = [d for d in _divisors(world) if all(t % d == 0 for t in splits.values())]
            raise ValueError(
                f"parallel.tp_size={tp} must divide {key} = {total}; valid tp sizes for "
                f"parallel.world_size={world}: {valid}"
            )


def _check_eplb_nodes(model: ModelConfig, eplb: EplbConfig, world: int, num_physical: int) -> None:
    """eplb.num_nodes against the world and, for the hierarchical policy, the expert groups
    and each rank's slots."""
    if world % eplb.num_nodes:
        raise ValueError(
            f"eplb.num_nodes={eplb.num_nodes} must divide parallel.world_size={world}; "
            f"valid: {_divisors(world)}"
        )
    if eplb.policy == "hierarchical" and model.n_group % eplb.num_nodes:
        raise ValueError(
            f"eplb.policy 'hierarchical' needs eplb.num_nodes={eplb.num_nodes} to divide "
            f"model.n_group={model.n_group}; use eplb.policy 'auto' or 'global'"
        )
    slots = num_physical // world
    node_experts = model.n_routed_experts // eplb.num_nodes
    if eplb.policy == "hierarchical" and eplb.num_nodes > 1 and slots > node_experts:
        # The planner keeps an expert on one node with one copy per rank of it at most (the
        # dispatch uses one copy a rank): a rank's slots must not outnumber the node's experts.
        raise ValueError(
            f"eplb.policy 'hierarchical' keeps each expert's copies on one node, one a rank: "
            f"each rank's {slots} slots (model.n_routed_experts + "
            f"eplb.num_redundant_experts = {num_physical} over parallel.world_size={world}) "
            f"outnumber the {node_experts} experts of a node (model.n_routed_experts="
            f"{model.n_routed_experts} over eplb.num_nodes={eplb.num_nodes}); use at most "
            f"{node_experts * world - model.n_routed_experts} redundant experts, or "
            "eplb.policy 'auto' or 'global'"
        )


def _check_tp_max(model: ModelConfig, tp: int, tp_max: int) -> None:
    """The fixed K split of the row-parallel linear (moe_kernels/tp_linear.py), the dense MLP's
    down_proj: every TP degree must hold whole chunks, and its K (the dense intermediate
    size) must cut into tp_max equal chunks. Without dense layers no linear is
    row-parallel (o_proj and the shared experts run whole on token shares): nothing to
    check."""
    if not model.first_k_dense_replace:
        return
    if tp_max % tp:
        raise ValueError(
            f"kernels.tp_max={tp_max} must be a multiple of parallel.tp_size={tp} (each TP "
            f"rank holds tp_max / tp_size chunks of the row-parallel K); valid tp sizes: "
            f"{_divisors(tp_max)}"
        )
    if model.intermediate_size % tp_max:
        valid = [d for d in _divisors(tp_max) if model.intermediate_size % d == 0]
        raise ValueError(
            f"kernels.tp_max={tp_max} must divide model.intermediate_size = "
            f"{model.intermediate_size} (the dense MLP's row-parallel down_proj cuts its K "
            f"into tp_max chunks); valid tp_max: {valid}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
