"""Op table: `kernels.mode` selects every reducing op of the token path, by device; bound
tile_rows, pin_threads, package exports."""

import dataclasses
from functools import partial

import pytest
import torch

import moe_kernels
from moe_kernels import (
    KernelConfig,
    OpTable,
    build_op_table,
    combine,
    cumsum,
    pin_threads,
    softmax,
)
from tests.test_kernels_router import V2_GREEDY

TILED_OPS = (
    "linear",
    "batched_linear",
    "grouped_linear",
    "rms_norm",
    "add_rms_norm",
    "softmax",
    "log_softmax",
    "mla_attention",
    "router_logits",
    "router_topk",
    "write_latent_cache",  # the latent norm, fused with the rope and the cache write
)
# Row-wise by construction (a token's slots, the ranks of one element, one vocab row): the
# torch references need no tile, and serve the CUDA table too (elementwise or host-ordered).
UNTILED_OPS = ("moe_combine", "sum_over_ranks", "cumsum")
# The TP row-parallel linear, bound to tile_rows and kernels.tp_max (moe_kernels/tp_linear.py).
REDUCING_OPS = TILED_OPS + UNTILED_OPS + ("row_parallel_linear",)
# Fast mode on CUDA: ops whose plain-torch version needs host sizes, replaced by a capturable one.
# Fast mode on CUDA: the capturable grouped GEMM and decode attention, and the one-launch Triton
# kernels where they are the fastest version (moe_kernels/op_table._FASTEST_ON_CUDA).
CUDA_FAST_OPS = {
    "grouped_linear": "grouped_linear_by_rows",  # the faster of torch's and the Triton one
    # The Triton kernel at the few rows where it beat cuBLAS (moe_kernels.linear.ByRows).
    "linear": "linear_triton or linear_triton or linear_fast",  # one row, then narrow weights
    "batched_linear": "batched_linear_triton or batched_linear_fast",
    "router_logits": "router_logits_triton or router_logits_fast",
    "router_topk": "router_topk_triton",
    "mla_attention": "mla_decode_fast",
    "rms_norm": "rms_norm_triton",
    "add_rms_norm": "add_rms_norm_triton",
    "moe_combine": "moe_combine_triton",
    "write_latent_cache": "write_latent_cache_triton",
}


def _name(op) -> str:
    from moe_kernels.linear import ByRows

    if isinstance(op, ByRows):
        return f"{_name(op.few)} or {_name(op.many)}"
    return op.func.__name__ if isinstance(op, partial) else op.__name__


def test_every_field_is_a_known_op():
    # A new op must join REDUCING_OPS (and so every check below) or be named here.
    fields = {f.name for f in dataclasses.fields(OpTable)}
    named = {"silu_mul", "moe_output", "moe_combine_output", "grouped_gated_linear", "mode"}
    named |= {"branch", "side_stream"}  # a layer's independent branch (moe_kernels/streams.py)
    named |= {"mla_prefill"}  # fast mode's prefill form (tests/test_mla_prefill.py)
    assert fields == set(REDUCING_OPS) | named


@pytest.mark.parametrize("mode", ("fast", "invariant"))
def test_combine_output_follows_the_tables_combine(mode, generator):
    """The fused combine + MoE output reduces like the table's own combine: composed from it
    off CUDA (so fast mode's control reaches it), one Triton launch on CUDA in both modes
    (where both modes' combine is the Triton kernel)."""
    table = build_op_table(KernelConfig(mode=mode), "cpu")
    fused = table.moe_combine_output
    assert fused.keywords == {"moe_combine": table.moe_combine, "moe_output": table.moe_output}
    rows = torch.randn(6, 8, generator=generator).bfloat16()
    slots = torch.randperm(6, generator=generator)
    weights = torch.rand(3, 2, generator=generator)
    shared, residual = torch.randn(2, 3, 8, generator=generator).bfloat16()
    want = table.moe_output(table.moe_combine(rows, slots, weights), shared, residual)
    assert torch.equal(fused(rows, slots, weights, shared, residual), want)
    cuda = build_op_table(KernelConfig(mode=mode), "cuda")
    assert cuda.moe_combine_output.__name__ == "moe_combine_output_triton"


@pytest.mark.parametrize("mode", ("fast", "invariant"))
def test_gated_expert_gemm_follows_the_tables_grouped_gemm(mode, generator):
    """gate_up + silu * up as one op: composed from the table's grouped GEMM and silu off
    CUDA (fast mode's control reaches it); on CUDA the one-launch Triton kernel where the
    table runs the Triton grouped GEMM (invariant; fast at few rows an expert)."""
    table = build_op_table(KernelConfig(mode=mode), "cpu")
    fused = table.grouped_gated_linear
    assert fused.keywords == {"grouped_linear": table.grouped_linear, "silu_mul": table.silu_mul}
    x = torch.randn(5, 16, generator=generator)
    w = torch.randn(2, 2 * 8, 16, generator=generator)
    index = torch.tensor([4, 0, 0, 3, 1, 2])
    gate, up = table.grouped_linear(x[index], w, [2, 4]).chunk(2, dim=-1)
    assert torch.equal(fused(x, w, [2, 4], row_index=index), table.silu_mul(gate, up))
    cuda = build_op_table(KernelConfig(mode=mode), "cuda").grouped_gated_linear
    if mode == "invariant":
        assert cuda.__name__ == "grouped_gated_linear_triton"
    else:
        assert cuda.keywords["few_rows"].__name__ == "grouped_gated_linear_triton"
        many = cuda.keywords["many_rows"].keywords
        assert many["grouped_linear"].__name__ == "grouped_linear_cuda_fast"


@pytest.mark.parametrize("mode", ("fast", "invariant"))
def test_mode_selects_every_reducing_op(mode):
    devices = ("cpu", "cuda", torch.device("cuda", 1))
    suffix = {"fast": "_fast", "invariant": "_ref"}[mode]
    for device in devices if mode == "fast" else ("cpu",):
        table = build_op_table(KernelConfig(mode=mode), device)
        assert table.mode == mode
        for name in REDUCING_OPS:
            expected = f"{name}{suffix}"
            if mode == "fast" and torch.device(device).type == "cuda":
                expected = CUDA_FAST_OPS.get(name, expected)
            assert _name(getattr(table, name)) == expected, (device, name)


def test_invariant_cpu_binds_refs_to_tile_rows(generator):
    table = build_op_table(KernelConfig(mode="invariant", tile_rows=8), "cpu")
    for name in TILED_OPS:
        assert getattr(table, name).keywords == {"tile_rows": 8}, name
    x = torch.randn(5, 12, generator=generator)
    assert torch.equal(table.softmax(x), softmax.softmax_ref(x, tile_rows=8))


def test_invariant_cuda_binds_a_fixed_order_op_for_every_reducing_op():
    table = build_op_table(KernelConfig(), "cuda:1")
    assert table.mode == "invariant"
    for name in TILED_OPS:
        assert _name(getattr(table, name)) == f"{name}_triton", name
    # The split-K linears share the table's arrival counts (none without a CUDA device here).
    assert table.linear.keywords == table.router_logits.keywords
    assert table.linear.keywords["arrivals"] is table.row_parallel_linear.keywords["arrivals"]
    # One-launch kernels of the references' row-wise arithmetic (fewer launches per layer).
    assert table.moe_combine.__name__ == "moe_combine_triton"
    assert table.silu_mul.__name__ == "silu_mul_triton"
    assert table.moe_output.__name__ == "moe_output_triton"
    assert build_op_table(KernelConfig(), "cpu").moe_output is combine.moe_output_ref
    assert table.sum_over_ranks is combine.sum_over_ranks_ref
    assert table.cumsum is cumsum.cumsum_ref


def test_fast_and_invariant_tables_differ_in_every_reducing_op():
    fast = build_op_table(KernelConfig(mode="fast"), "cpu")
    for device in ("cpu", "cuda"):
        invariant = build_op_table(KernelConfig(), device)
        for name in REDUCING_OPS:
            assert _name(getattr(fast, name)) != _name(getattr(invariant, name)), name


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
    assert set(moe_kernels.__all__) == {"KernelConfig", "OpTable", "build_op_table", "pin_threads"}


def test_fast_cuda_grouped_gemm_takes_the_triton_kernel_only_where_it_is_faster():
    """Fast mode's grouped GEMM on CUDA: the Triton kernel at few rows an expert on wide
    weights (measured faster there), torch's grouped GEMM otherwise."""
    from moe_kernels.linear import FAST_TRITON_GROUPED_MAX_MEAN_ROWS as MAX_MEAN
    from moe_kernels.linear import FAST_TRITON_GROUPED_MIN_IN as MIN_IN
    from moe_kernels.linear import grouped_linear_cuda_fast
    from moe_kernels.triton_grouped_linear import grouped_linear_triton

    op = build_op_table(KernelConfig(mode="fast"), "cuda").grouped_linear
    assert op.keywords == {"few_rows": grouped_linear_triton, "many_rows": grouped_linear_cuda_fast}
    calls = []
    picked = partial(
        op.func,
        few_rows=lambda *args, row_index: calls.append(("triton", row_index is not None)),
        many_rows=lambda *args, row_index: calls.append(("torch", row_index is not None)),
    )
    experts = 64
    for rows, in_dim in (
        (6, 2048),  # one decode token, top-6
        (MAX_MEAN * experts, 1408),
        (MAX_MEAN * experts + 1, 2048),  # prefill-sized
        (6, MIN_IN - 16),  # a narrow weight: not measured, torch's
    ):
        picked(torch.empty(rows, in_dim), torch.empty(experts, 32, in_dim), [rows] + [0] * 63)
    # Rows read through an index count as the index's rows, and the index is passed on.
    for rows in (6, MAX_MEAN * experts + 1):
        index = torch.zeros(rows, dtype=torch.int64)
        picked(torch.empty(1, 2048), torch.empty(experts, 32, 2048), [rows] + [0] * 63,
               row_index=index)  # fmt: skip
    assert [name for name, _ in calls] == ["triton", "triton", "torch", "torch", "triton", "torch"]
    assert [gathered for _, gathered in calls] == [False] * 4 + [True] * 2


def test_fast_cuda_linears_take_the_triton_kernel_only_where_it_is_faster():
    """Fast mode's plain linear, W_UK / W_UV products and router logits on CUDA: the Triton
    kernel (with the table's split-K arrival counts) at the rows, and for the plain linear the
    weight widths, where it beat cuBLAS; cuBLAS past them."""
    from moe_kernels import linear

    table = build_op_table(KernelConfig(mode="fast"), "cuda")
    calls = []

    def pick(op, x, weight, **kwargs):
        spy = dataclasses.replace(
            op,
            few=lambda *args, **kw: calls.append(("triton", kw)),
            many=lambda *args, **kw: calls.append(("cublas", kw)),
        )
        spy(x, weight, **kwargs)
        return calls.pop()

    rows, out = linear.FAST_TRITON_LINEAR_MAX_ROWS, linear.FAST_TRITON_LINEAR_MAX_OUT
    any_out_rows = linear.FAST_TRITON_LINEAR_ANY_OUT_ROWS
    narrow = table.linear.many  # past any_out_rows rows: the narrow weights' rule
    max_in = linear.FAST_TRITON_LINEAR_ANY_OUT_MAX_IN
    assert table.linear.max_rows == any_out_rows and table.linear.max_out is None
    assert table.linear.max_in == max_in
    assert narrow.few is table.linear.few and narrow.many.__name__ == "linear_fast"
    if not torch.cuda.is_available():  # with a device: a stream's buffer a call (a closure)
        assert table.linear.few.func.__name__ == "linear_triton"
        assert table.linear.few.keywords == table.router_logits.few.keywords == {"arrivals": None}
    # Any weight at any_out_rows rows, the op's keywords passed on.
    assert pick(table.linear, torch.empty(any_out_rows, 8), torch.empty(102400, 8),
                whole_out_dim=None) == ("triton", {"whole_out_dim": None})  # fmt: skip
    # A longer K goes to the narrow weights' rule even at one row (V3's o_proj, lm_head).
    long_k = max_in + 1
    assert pick(table.linear, torch.empty(1, max_in), torch.empty(102400, max_in))[0] == "triton"
    assert pick(table.linear, torch.empty(1, long_k), torch.empty(4096, long_k))[0] == "cublas"
    assert pick(narrow, torch.empty(1, long_k), torch.empty(576, long_k))[0] == "triton"
    assert pick(narrow, torch.empty(1, long_k), torch.empty(out + 1, long_k))[0] == "cublas"
    assert pick(narrow, torch.empty(1, 8), torch.empty(out, 8))[0] == "triton"
    assert pick(narrow, torch.empty(rows, 8), torch.empty(576, 8))[0] == "triton"
    assert pick(narrow, torch.empty(rows + 1, 8), torch.empty(576, 8))[0] == "cublas"
    assert pick(narrow, torch.empty(any_out_rows + 1, 8), torch.empty(out + 1, 8))[0] == "cublas"
    # [heads, tokens, features]: the tokens are the rows.
    batched_rows = linear.FAST_TRITON_BATCHED_MAX_ROWS
    w_uk = torch.empty(16, 512, 128)
    assert pick(table.batched_linear, torch.empty(16, batched_rows, 128), w_uk)[0] == "triton"
    assert pick(table.batched_linear, torch.empty(1, batched_rows + 1, 128), w_uk)[0] == "cublas"
    # More heads than measured winning (V3's 128 lost at every row count): cuBLAS.
    heads = linear.FAST_TRITON_BATCHED_MAX_HEADS
    w_wide = torch.empty(heads + 1, 512, 128)
    assert pick(table.batched_linear, torch.empty(heads + 1, 1, 128), w_wide)[0] == "cublas"
    w_rank = torch.empty(heads, 512, 128)
    assert pick(table.batched_linear, torch.empty(heads, 1, 128), w_rank)[0] == "triton"
    router_rows = linear.FAST_TRITON_ROUTER_MAX_ROWS
    router = torch.empty(64, 2048)
    assert pick(table.router_logits, torch.empty(router_rows, 2048), router)[0] == "triton"
    assert pick(table.router_logits, torch.empty(router_rows + 1, 2048), router)[0] == "cublas"


@pytest.mark.parametrize("rows", (0, 64))
def test_branches_run_inline_without_a_cuda_stream(rows):
    """On CPU (and for a CUDA table without a device here) a branch runs in place: no side
    stream, whatever kernels.side_stream_rows says; the GPU test (tests/test_gpu_streams.py)
    checks the real stream."""
    for device in ("cpu",) if torch.cuda.is_available() else ("cpu", "cuda"):
        table = build_op_table(KernelConfig(side_stream_rows=rows), device)
        assert table.side_stream is None
        with table.branch(1) as side:
            assert side.stream is None
            assert side.run(torch.add, torch.ones(2), 1).tolist() == [2.0, 2.0]


@pytest.mark.parametrize("bad", (-1, 1.5, True, "64"))
def test_side_stream_rows_is_validated_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"kernels.side_stream_rows .* got {bad!r}"):
        KernelConfig(side_stream_rows=bad)


@pytest.mark.parametrize("bad", (-1, 1.5, True, "8"))
def test_attention_group_splits_is_validated_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"kernels.attention_group_splits .* got {bad!r}"):
        KernelConfig(attention_group_splits=bad)


@pytest.mark.parametrize("bad", (-1, 1.5, True, "64"))
def test_attention_long_blocks_is_validated_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"kernels.attention_long_blocks .* got {bad!r}"):
        KernelConfig(attention_long_blocks=bad)


def test_attention_long_blocks_binds_the_invariant_cuda_attention_only():
    """kernels.attention_long_blocks and attention_long_split_blocks reach the invariant CUDA
    attention op as its long_blocks and long_split_blocks (part of the bits), 0 too (off);
    None, the default, leaves the op its launch's own; CPU tables ignore them."""
    for value in (8, 0):
        op = build_op_table(KernelConfig(attention_long_blocks=value), "cuda:1").mla_attention
        assert op.func.__name__ == "mla_attention_triton"
        assert op.keywords == {"long_blocks": value}
    config = KernelConfig(attention_long_split_blocks=12)
    assert build_op_table(config, "cuda:1").mla_attention.keywords == {"long_split_blocks": 12}
    config = KernelConfig(attention_long_blocks=9, attention_long_split_blocks=12)
    op = build_op_table(config, "cuda:1").mla_attention
    assert op.keywords == {"long_blocks": 9, "long_split_blocks": 12}
    assert KernelConfig().attention_long_blocks is None
    assert KernelConfig().attention_long_split_blocks is None
    plain = build_op_table(KernelConfig(), "cuda:1").mla_attention
    assert plain.__name__ == "mla_attention_triton"
    cpu = build_op_table(KernelConfig(attention_long_blocks=8), "cpu").mla_attention
    assert "long_blocks" not in getattr(cpu, "keywords", {})


def test_attention_group_splits_binds_the_invariant_cuda_attention_only():
    """kernels.attention_group_splits reaches the invariant CUDA attention op as its
    group_splits (part of the bits); 0 leaves the op as it is; CPU and fast tables ignore it."""
    grouped = build_op_table(KernelConfig(attention_group_splits=8), "cuda:1").mla_attention
    assert grouped.func.__name__ == "mla_attention_triton"
    assert grouped.keywords == {"group_splits": 8}
    plain = build_op_table(KernelConfig(), "cuda:1").mla_attention
    assert plain.__name__ == "mla_attention_triton"
    cpu = build_op_table(KernelConfig(attention_group_splits=8), "cpu").mla_attention
    assert "group_splits" not in getattr(cpu, "keywords", {})
