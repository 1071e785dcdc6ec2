"""Op table: selection by device and mode, bound tile_rows, pin_threads, package exports."""

import dataclasses

import pytest
import torch

import kernels
from kernels import (
    KernelConfig,
    OpTable,
    activation,
    build_op_table,
    linear,
    pin_threads,
    router,
    softmax,
)
from tests.test_kernels_router import V2_GREEDY

OPS = (
    "linear",
    "grouped_linear",
    "rms_norm",
    "softmax",
    "log_softmax",
    "mla_attention",
    "router_topk",
)


def test_fast_mode_uses_plain_torch_on_any_device():
    for device in ("cpu", "cuda", torch.device("cuda", 1)):
        table = build_op_table(KernelConfig(mode="fast"), device)
        assert table.mode == "fast"
        assert table.linear is linear.linear_fast and table.router_topk is router.router_topk_fast


def test_invariant_cpu_binds_refs_to_tile_rows(generator):
    table = build_op_table(KernelConfig(mode="invariant", tile_rows=8), "cpu")
    assert table.mode == "invariant" and set(OPS) <= {f.name for f in dataclasses.fields(table)}
    for name in OPS:
        bound = getattr(table, name)
        assert bound.func.__name__ == f"{name}_ref" and bound.keywords == {"tile_rows": 8}
    x = torch.randn(5, 12, generator=generator)
    assert torch.equal(table.softmax(x), softmax.softmax_ref(x, tile_rows=8))


def test_invariant_cuda_binds_a_triton_kernel_for_every_op():
    table = build_op_table(KernelConfig(), "cuda:1")
    assert table.mode == "invariant"
    for name in OPS:
        assert getattr(table, name).__name__ == f"{name}_triton", name
    assert table.silu is activation.silu_ref  # elementwise: invariant on GPU as it stands


def test_compiled_triton_ops_refuse_cpu_tensors_naming_the_device(generator):
    table = build_op_table(KernelConfig(), "cuda")
    logits = torch.randn(3, 8, generator=generator)
    with pytest.raises(ValueError, match="cpu"):
        table.router_topk(logits, None, **{**V2_GREEDY, "top_k": 2})
    q, kv = torch.randn(2, 4, 24, generator=generator), torch.randn(3, 16, 24, generator=generator)
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="cpu"):
        table.mla_attention(q, kv, ids, ids[None], ids, scale=1.0, v_dim=16)


def test_invariant_refuses_other_devices_naming_the_device():
    with pytest.raises(ValueError, match="meta"):
        build_op_table(KernelConfig(), torch.device("meta"))


def test_op_table_is_frozen():
    table = build_op_table(KernelConfig(mode="fast"), "cpu")
    assert isinstance(table, OpTable)
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.mode = "invariant"


def test_build_has_no_side_effects_and_pin_threads_sets_count(restore_num_threads):
    torch.set_num_threads(2)
    build_op_table(KernelConfig(num_threads=1), "cpu")
    assert torch.get_num_threads() == 2
    pin_threads(KernelConfig(num_threads=1))
    assert torch.get_num_threads() == 1


def test_package_exports():
    assert set(kernels.__all__) == {"KernelConfig", "OpTable", "build_op_table", "pin_threads"}
