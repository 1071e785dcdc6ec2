"""Row-parallel linear with the fixed tp_max K split (moe_kernels/tp_linear.py, its Triton kernels).

- The tree: adjacent pairs level by level (a known answer where left-to-right differs); at every
  tp in {1, 2, 4, 8} the ranks' subtrees finished in rank order equal the tp=1 tree bitwise.
- A row's bits ignore the batch (prefixes on both sides of tile_rows, permutations, fresh
  neighbours); control: the fast version (one GEMM, M-dependent BLAS path) does not.
- Control: the previous TP sum (a linear over the local K, partials summed in rank order in the
  activation dtype) differs from tp=1.
- Over real collectives (gloo processes; NCCL on two GPUs): TP 2 and 4 give the tp=1 bits, the
  previous sum does not, and the rank counted one all-gather of fp32 subtree sums.
- kernels.tp_max validation (KernelConfig, RuntimeConfig) and the op table binding.
- Triton kernels under TRITON_INTERPRET=1 (tests/interpreted.py): the tree-sum kernel bitwise
  equal to tree_sum, the same bits at every tp, rows invariant, close to the reference; a
  column-parallel slice (whole weight's K split) gives the whole linear's columns.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from comm import (
    ParallelConfig,
    all_reduce,
    destroy_process_groups,
    init_process_groups,
    worker_nccl_env,
)
from moe_kernels import KernelConfig, build_op_table
from moe_kernels.combine import sum_over_ranks_ref
from moe_kernels.linear import linear_ref
from moe_kernels.tp_linear import (
    local_num_chunks,
    row_parallel_linear_fast,
    row_parallel_linear_ref,
    tp_linear_ref,
    tree_sum,
)
from moe_runtime.config import load_config
from moe_runtime.model.tensor_parallel import TensorParallel
from tests import interpreted
from tests.invariance import TINY_CONFIG
from tests.test_comm_groups import BACKENDS, MASTER_ADDR, run_ranks

TP_MAX, TILE = 8, 16
TP_SIZES = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.bfloat16)
# fp32 vs fp64, K = 512, unit inputs and weights ~ 1/sqrt(K): a few fp32 ulps of O(1) values.
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 1e-2, "rtol": 1e-2}  # one bf16 rounding of the output apart
SEED = 0


def _inputs(generator, dtype=torch.float32, num_rows=37, in_dim=512, out_dim=64):
    x = torch.randn(num_rows, in_dim, generator=generator).to(dtype)
    w = (torch.randn(out_dim, in_dim, generator=generator) / in_dim**0.5).to(dtype)
    return x, w


def _ref(x, w, tp_size=1, gather=None):
    gather = gather or (lambda t: [t])
    return row_parallel_linear_ref(x, w, tp_size, gather, None, tp_max=TP_MAX, tile_rows=TILE)


def _at_tp(x, w, tp_size):
    """The tp_size ranks' result, each rank's subtree computed here from its K slice."""
    xs, ws = x.chunk(tp_size, dim=1), w.chunk(tp_size, dim=1)
    subtrees = [
        tp_linear_ref(xs[r], ws[r], TP_MAX // tp_size, tile_rows=TILE) for r in range(tp_size)
    ]
    return _ref(xs[0], ws[0], tp_size, lambda t: subtrees)


def _previous_tp_sum(x, w, tp_size):
    """The sum before the fixed K split: a linear over each rank's K, summed in rank order
    and rounded to the activation dtype (moe_kernels/combine.py's sum_over_ranks_ref)."""
    xs, ws = x.chunk(tp_size, dim=1), w.chunk(tp_size, dim=1)
    parts = [linear_ref(xs[r], ws[r], tile_rows=TILE) for r in range(tp_size)]
    return sum_over_ranks_ref(parts[0], lambda t: parts, None)


def test_tree_sum_is_adjacent_pairs_level_by_level():
    big = torch.tensor([1e8], dtype=torch.float32)
    one = torch.ones(1)
    parts = [big, one, -big, one]
    # (1e8 + 1) + (-1e8 + 1) rounds both sums back to +-1e8: 0; left to right gives 1.
    assert torch.equal(tree_sum(parts), torch.zeros(1))
    assert torch.equal(((big + one) + -big) + one, one)
    three = [one * 3, big, -big]
    assert torch.equal(tree_sum(three), (three[0] + three[1]) + three[2])
    assert tree_sum([one]) is one
    with pytest.raises(ValueError, match="at least one"):
        tree_sum([])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tp_degree_gives_the_tp1_tree(generator, dtype):
    x, w = _inputs(generator, dtype)
    full = _ref(x, w)
    assert full.dtype == dtype and full.shape == (37, 64)
    # tp=1 is the whole tree over the tp_max chunk partials, rounded once.
    assert torch.equal(full, tp_linear_ref(x, w, TP_MAX, tile_rows=TILE).to(dtype))
    for tp_size in TP_SIZES:
        assert torch.equal(_at_tp(x, w, tp_size), full), tp_size


@pytest.mark.parametrize("dtype", DTYPES)
def test_control_previous_tp_sum_differs_from_tp1(generator, dtype):
    """The previous sum is TP-dependent: at tp 4 (and at tp 2 in bf16) its bits differ from its
    own tp=1 result, a plain linear. (fp32 tp 2 at K = 512 happens to match: MKL's own K blocking
    cuts 512 where the two ranks do.)"""
    x, w = _inputs(generator, dtype)
    tp1 = linear_ref(x, w, tile_rows=TILE)
    assert torch.equal(_previous_tp_sum(x, w, 1), tp1)
    assert not torch.equal(_previous_tp_sum(x, w, 4), tp1)
    if dtype == torch.bfloat16:
        assert not torch.equal(_previous_tp_sum(x, w, 2), tp1)


def test_close_to_fp64(generator):
    x, w = _inputs(generator)
    expected = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(_ref(x, w), expected, **FP32_TOL)
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(_ref(xb, wb), (xb.double() @ wb.double().t()).bfloat16(), **BF16_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_bitwise_invariant(generator, dtype):
    x, w = _inputs(generator, dtype)
    for tp_size in (1, 4):
        xs, ws = x.chunk(tp_size, dim=1)[0], w.chunk(tp_size, dim=1)[0]
        full = tp_linear_ref(xs, ws, TP_MAX // tp_size, tile_rows=TILE)
        for m in (1, 2, 3, 7, TILE - 1, TILE, TILE + 1, 2 * TILE + 3):
            assert torch.equal(
                tp_linear_ref(xs[:m], ws, TP_MAX // tp_size, tile_rows=TILE), full[:m]
            )
        perm = torch.randperm(x.shape[0], generator=generator)
        out = tp_linear_ref(xs[perm], ws, TP_MAX // tp_size, tile_rows=TILE)
        assert torch.equal(out, full[perm])
        others = torch.randn(9, xs.shape[1], generator=generator).to(dtype)
        mixed = torch.cat([others[:6], xs[5:6], others[6:]])
        assert torch.equal(tp_linear_ref(mixed, ws, TP_MAX // tp_size, tile_rows=TILE)[6], full[5])


def test_control_fast_rows_follow_the_batch(generator):
    x, w = _inputs(generator)
    full = row_parallel_linear_fast(x, w, 1, None, lambda t: t)
    assert any(
        not torch.equal(row_parallel_linear_fast(x[:m], w, 1, None, lambda t: t)[0], full[0])
        for m in (1, 2, 3)
    )


def test_local_num_chunks_checks():
    assert local_num_chunks(8, 2, 64) == 4
    with pytest.raises(ValueError, match=r"kernels.tp_max \(8\) / parallel.tp_size \(3\)"):
        local_num_chunks(8, 3, 64)
    with pytest.raises(ValueError, match="power of two"):
        local_num_chunks(12, 4, 64)
    with pytest.raises(ValueError, match="60 local input features"):
        local_num_chunks(8, 1, 60)


@pytest.mark.parametrize("bad", [0, -8, 3, 12, 32, True, 8.0, "8"])
def test_kernel_config_refuses_bad_tp_max(bad):
    with pytest.raises(ValueError, match="kernels.tp_max"):
        KernelConfig(tp_max=bad)


def test_runtime_config_checks_tp_max_against_the_layout_and_the_model():
    assert load_config(TINY_CONFIG).kernels.tp_max == 8
    assert load_config(TINY_CONFIG, {"kernels.tp_max": 4}).kernels.tp_max == 4
    layout = {"parallel.world_size": 4, "parallel.tp_size": 4}
    with pytest.raises(ValueError, match=r"kernels.tp_max=2 must be a multiple of parallel."):
        load_config(TINY_CONFIG, {**layout, "kernels.tp_max": 2})
    message = r"kernels.tp_max=16 must divide model.intermediate_size = 40 \(the dense MLP"
    dense_40 = {"kernels.tp_max": 16, "model.intermediate_size": 40}  # 40 % 16 != 0
    with pytest.raises(ValueError, match=message):
        load_config(TINY_CONFIG, dense_40)
    # Fast mode has no K split: tp_max does not constrain it.
    assert load_config(TINY_CONFIG, {**dense_40, "kernels.mode": "fast"})
    # Without dense layers no linear is row-parallel: nothing for tp_max to divide, and any
    # TP degree the heads allow (tp_max 2 at tp 4 is refused above, with a dense layer).
    assert load_config(TINY_CONFIG, {**dense_40, "model.first_k_dense_replace": 0})
    no_dense = {**layout, "kernels.tp_max": 2, "model.first_k_dense_replace": 0}
    assert load_config(TINY_CONFIG, no_dense).parallel.tp_size == 4
    # o_proj runs whole on each TP rank's token share: its K (4 heads * 10 = 40) is free.
    heads_40 = {**layout, "kernels.tp_max": 16, "model.v_head_dim": 10}
    assert load_config(TINY_CONFIG, heads_40).kernels.tp_max == 16
    # The shared experts run whole on each TP rank's token share: no K split to constrain,
    # and their intermediate size need not divide by the TP degree.
    shared_40 = {**layout, "kernels.tp_max": 16, "model.moe_intermediate_size": 40}
    assert load_config(TINY_CONFIG, {**shared_40, "model.n_shared_experts": 1})


def test_op_table_binds_tp_max_and_tile_rows():
    table = build_op_table(KernelConfig(tp_max=4, tile_rows=8), "cpu")
    assert table.row_parallel_linear.func is row_parallel_linear_ref
    assert table.row_parallel_linear.keywords == {"tp_max": 4, "tile_rows": 8}
    cuda = build_op_table(KernelConfig(tp_max=4), "cuda").row_parallel_linear.keywords
    assert cuda["tp_max"] == 4 and set(cuda) == {"tp_max", "arrivals"}
    fast = build_op_table(KernelConfig(mode="fast"), "cpu").row_parallel_linear
    assert fast is row_parallel_linear_fast


def _rank_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _inputs(torch.Generator().manual_seed(7), dtype)


def _row_parallel_worker(rank: int, world_size: int, port: int, backend: str) -> dict:
    device = "cuda" if backend == "nccl" else "cpu"
    config = ParallelConfig(
        world_size=world_size, tp_size=world_size, backend=backend, device=device, timeout_s=60.0
    )
    if device == "cuda":
        os.environ.update(worker_nccl_env())  # this test process stands in for launch/
        torch.cuda.set_device(rank)
    groups = init_process_groups(config, rank, MASTER_ADDR, port)
    op = build_op_table(KernelConfig(tp_max=TP_MAX, tile_rows=TILE), device).row_parallel_linear
    result = {}
    for dtype in DTYPES:
        x, w = (t.to(groups.device) for t in _rank_inputs(dtype))
        cols = slice(rank * x.shape[1] // world_size, (rank + 1) * x.shape[1] // world_size)
        tp = TensorParallel(groups.tp_size, groups.tp_rank, groups.tp_group)
        # Collectives: every rank runs the same two reductions, in this order.
        out = tp.row_parallel_linear(x[:, cols], w[:, cols], op)
        previous = all_reduce(x[:, cols] @ w[:, cols].t(), groups.tp_group, sum_over_ranks_ref)
        tp1 = TensorParallel().row_parallel_linear(x, w, op)  # the whole tree here, no collective
        result[str(dtype)] = {
            "out": out.cpu(),
            "previous": previous.cpu(),
            "tp1": tp1.cpu(),
            "calls": dict(tp.num_calls),
        }
    destroy_process_groups()
    return result


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_row_parallel_over_collectives_gives_tp1_bits(tmp_path, backend, world_size):
    if backend == "nccl" and world_size > torch.cuda.device_count():
        pytest.skip(f"needs {world_size} CUDA devices")
    results = run_ranks(_row_parallel_worker, world_size, tmp_path, backend, timeout_s=120.0)
    for dtype in DTYPES:
        ranks = [r[str(dtype)] for r in results]
        tp1 = ranks[0]["tp1"]
        for rank, r in enumerate(ranks):
            assert torch.equal(r["out"], tp1), (dtype, rank)
            assert r["calls"] == {"all_reduce": 1, "fp32_subtree_gather": 1}, r["calls"]
        assert not torch.equal(ranks[0]["previous"], tp1), f"{dtype}: previous sum equals tp1"


# Triton kernels under the interpreter (one fresh process for all checks: tests/interpreted.py).


def _triton_at_tp(x, w, tp_size, *, with_origins=True):
    """with_origins False: every rank claims its K slice starts at column 0 (the control)."""
    from moe_kernels.triton_tp_linear import row_parallel_linear_triton, tp_linear_triton

    xs, ws = x.chunk(tp_size, dim=1), w.chunk(tp_size, dim=1)
    origins = [r * xs[0].shape[1] if with_origins else 0 for r in range(tp_size)]
    subtrees = [
        tp_linear_triton(xs[r], ws[r], TP_MAX // tp_size, k_origin=origins[r])
        for r in range(tp_size)
    ]
    return row_parallel_linear_triton(
        xs[0], ws[0], tp_size, lambda t: subtrees, None, tp_max=TP_MAX
    )


def check_tp_max_one_is_the_plain_linear(generator: torch.Generator) -> None:
    """kernels.tp_max 1 (no TP invariance) runs the plain invariant linear and gives its bits
    (engagement: the call reached linear_triton)."""
    import moe_kernels.triton_tp_linear as tp_module
    from moe_kernels.triton_linear import linear_triton

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return linear_triton(*args, **kwargs)

    x, w = _inputs(generator, torch.bfloat16, num_rows=40, in_dim=576)
    tp_module.linear_triton = counted
    try:
        got = tp_module.row_parallel_linear_triton(x, w, 1, None, None, tp_max=1)
    finally:
        tp_module.linear_triton = linear_triton
    assert calls == [x.shape], calls
    assert torch.equal(got, linear_triton(x, w))
    torch.testing.assert_close(
        got.float(), linear_ref(x.float(), w.float(), tile_rows=TILE), **BF16_TOL
    )


def check_tree_sum_kernel(generator: torch.Generator) -> None:
    from moe_kernels.triton_tp_linear import tree_sum_triton

    for num_parts in (1, 2, 4, 8, 16):
        scale = torch.pow(10.0, torch.randint(-6, 7, (num_parts, 33, 40), generator=generator))
        parts = torch.randn(num_parts, 33, 40, generator=generator) * scale
        expected = tree_sum(list(parts))
        assert torch.equal(tree_sum_triton(parts, torch.float32), expected), num_parts
        # The interpreter rounds fp32 -> bf16 toward zero (numpy has no bf16; compiled code
        # rounds to nearest, bitwise against torch in tests/test_gpu_tp_linear.py): one ulp.
        rounded = tree_sum_triton(parts, torch.bfloat16).float()
        ulp = torch.finfo(torch.bfloat16).eps * expected.abs()
        assert ((rounded - expected).abs() <= ulp).all(), num_parts


def check_every_tp_degree_same_bits(generator: torch.Generator) -> None:
    """K 512 (chunks of 64 columns: on the K step grid) and 576 (chunks of 72: off it, as the
    dense mlp_down's 1368 are; each rank passes its K offset so the steps stay on the whole
    weight's grid). Control: ranks that all claim offset 0 step differently at some degree."""
    for dtype in DTYPES:
        for in_dim in (512, 576):
            x, w = _inputs(generator, dtype, num_rows=70, in_dim=in_dim)
            full = _triton_at_tp(x, w, 1)
            assert full.dtype == dtype and full.shape == (70, 64)
            for tp_size in TP_SIZES[1:]:
                assert torch.equal(_triton_at_tp(x, w, tp_size), full), (dtype, in_dim, tp_size)
            if in_dim == 576:
                assert any(
                    not torch.equal(_triton_at_tp(x, w, tp, with_origins=False), full)
                    for tp in TP_SIZES[1:]
                ), dtype


def check_rows_invariant(generator: torch.Generator) -> None:
    """Prefixes keep every row at its offset in its tile: the interpreter's tl.dot is numpy's
    BLAS, whose rounding may follow a row's position inside the tile (tests/test_triton_kernels)."""
    x, w = _inputs(generator, torch.bfloat16, num_rows=130)
    full = _triton_at_tp(x, w, 1)
    for m in (1, 2, 63, 64, 65, 130):
        assert torch.equal(_triton_at_tp(x[:m], w, 1), full[:m]), m


def check_close_to_reference(generator: torch.Generator) -> None:
    """fp32 with chunks of at most one BLOCK_K (32) columns: one tl.dot per chunk, bitwise the
    reference's partial where the interpreter's tl.dot (tests/interpreted.py: tile_dot) sums a
    32-term product as torch's CPU matmul does on this machine, else within fp32 rounding (a
    CPU's SIMD width and fused multiply-adds move the last bit). Wider chunks: the
    interpreter adds BLOCK_K-wide products, MKL walks K its own way, so the partials (not the
    tree) differ by fp32 rounding."""
    x, w = _inputs(generator, num_rows=37, in_dim=256)
    a, b = x[:, :32], w[:, :32]
    if torch.equal(torch.from_numpy(interpreted.tile_dot(a.numpy(), b.numpy().T)), a @ b.T):
        assert torch.equal(_triton_at_tp(x, w, 1), _ref(x, w))
    else:
        torch.testing.assert_close(_triton_at_tp(x, w, 1), _ref(x, w), **FP32_TOL)
    x, w = _inputs(generator, num_rows=37, in_dim=1024)
    torch.testing.assert_close(_triton_at_tp(x, w, 1), _ref(x, w), **FP32_TOL)
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(_triton_at_tp(xb, wb, 2), _ref(xb, wb), **BF16_TOL)


def check_in_program_tree_same_bits(generator: torch.Generator) -> None:
    """The prefill path (the whole tree in one program, no partials in memory) makes the chunk
    path's adds: bitwise equal on the same tile shape (the interpreter's dot may round by tile
    shape; compiled, every tile shape is checked in tests/test_gpu_tp_linear.py)."""
    from moe_kernels.triton_chunk_tree import linear_chunk_tree
    from moe_kernels.triton_tp_linear import chunk_launch, tp_linear_triton

    for dtype in DTYPES:
        for num_chunks in (1, 2, 4, 8):
            x, w = _inputs(generator, dtype, num_rows=37)
            config = chunk_launch(w.shape[0], w.shape[1], dtype, x.shape[0])[0]  # its tiles
            tree = linear_chunk_tree(x, w, num_chunks, torch.float32, config)
            assert torch.equal(tree, tp_linear_triton(x, w, num_chunks)), (dtype, num_chunks)
    # Chunks off the 64-column grid (96 columns, as the shared experts' down's 352): masked
    # full steps, the chunk launch's own steps (engagement: grid_steps finds two a chunk).
    from moe_kernels.triton_chunk_tree import grid_steps

    x, w = _inputs(generator, torch.bfloat16, num_rows=37, in_dim=768)
    assert grid_steps(96, 8, 64) == 2
    config = chunk_launch(w.shape[0], w.shape[1], torch.bfloat16, x.shape[0])[0]
    tree = linear_chunk_tree(x, w, 8, torch.float32, config)
    assert torch.equal(tree, tp_linear_triton(x, w, 8))
    # Both loop forms of the kernel (one loop; a chunk loop around each chunk's steps): the
    # same dots and adds, on and off the grid, tree and chain.
    for form in (False, True):
        got = linear_chunk_tree(x, w, 8, torch.float32, config, is_chunk_loop=form)
        assert torch.equal(got, tree), form
    for dtype in DTYPES:
        x, w = _inputs(generator, dtype, num_rows=37)
        config = chunk_launch(w.shape[0], w.shape[1], dtype, x.shape[0])[0]
        for num_chunks in (2, 4, 8):
            for is_tree in (True, False):
                want = linear_chunk_tree(x, w, num_chunks, torch.float32, config, is_tree=is_tree)
                for form in (False, True):
                    got = linear_chunk_tree(
                        x, w, num_chunks, torch.float32, config, is_tree=is_tree, is_chunk_loop=form
                    )
                    assert torch.equal(got, want), (dtype, num_chunks, is_tree, form)
            # The paired form (two chunks side by side, the pair loop unrolled): the tree's adds.
            want = linear_chunk_tree(x, w, num_chunks, torch.float32, config)
            got = linear_chunk_tree(x, w, num_chunks, torch.float32, config, is_paired=True)
            assert torch.equal(got, want), (dtype, num_chunks)
    with pytest.raises(ValueError, match="paired form"):
        linear_chunk_tree(x, w, 8, torch.float32, config, is_tree=False, is_paired=True)


def check_in_program_chain_same_bits(generator: torch.Generator) -> None:
    """The linear's prefill path for a fixed K split (chunk sums added in chunk order in one
    program, no partials in memory) makes the chunk launch's adds, also for a 16-bit x against
    an fp32 weight (the router); the tree over the same chunks is the control that differs."""
    from moe_kernels.triton_chunk_tree import linear_chunk_tree
    from moe_kernels.triton_linear_config import linear_config
    from moe_kernels.triton_split_k import launch_split_k

    for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        x, w = _inputs(generator, w_dtype, num_rows=37)
        x = x.to(x_dtype)
        config = linear_config(w.shape[0], w.shape[1], w_dtype, x.shape[0])
        for num_chunks in (2, 4, 8):
            chunk_k = w.shape[1] // num_chunks
            parts = torch.empty(x.shape[0], w.shape[0])
            launch_split_k(x, w, parts, chunk_k, config, is_tree=False)
            chain = linear_chunk_tree(x, w, num_chunks, torch.float32, config, is_tree=False)
            assert torch.equal(chain, parts), (x_dtype, num_chunks)
        tree = linear_chunk_tree(x, w, 8, torch.float32, config)
        assert not torch.equal(tree, chain), "chain and tree agreed: no control"


@contextlib.contextmanager
def _kernel_launches():
    """Records each _split_k_kernel launch's HANDOFF flag while the block runs."""
    import moe_kernels.triton_split_k as split_k

    kernel, launches = split_k._split_k_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs["HANDOFF"])
                return kernel[grid](*args, **kwargs)

            return launch

    split_k._split_k_kernel = Recorder()
    try:
        yield launches
    finally:
        split_k._split_k_kernel = kernel


def check_chunks_per_program_same_bits(generator: torch.Generator) -> None:
    """A program summing 2 or 4 adjacent chunks as their subtree (fewer parts in memory) makes
    the one-chunk-a-program launch's adds, folded (few rows), with a second launch, or handed
    up the tree as the programs finish."""
    from moe_kernels.triton_linear_config import linear_config
    from moe_kernels.triton_split_k import arrival_counts, launch_split_k

    for num_rows in (5, 37):
        x, w = _inputs(generator, torch.float32, num_rows=num_rows, in_dim=576)
        config = linear_config(w.shape[0], w.shape[1], x.dtype, num_rows)
        outs = [
            launch_split_k(
                x,
                w,
                torch.empty(num_rows, 64),
                72,
                config,
                is_tree=True,
                k_origin=0,
                chunks_per_program=g,
            )  # fmt: skip
            for g in (1, 2, 4, 8)
        ]
        for g, out in zip((2, 4, 8), outs[1:], strict=True):
            assert torch.equal(out, outs[0]), (num_rows, g)
        # The hand-off (a tile's programs add their subtrees as they finish): the same adds,
        # and every tree node's counts back at zero for the next launch on the same buffer.
        arrivals = arrival_counts("cpu")
        for g in (1, 2, 4):
            for _ in range(2):
                with _kernel_launches() as launches:
                    out = launch_split_k(
                        x, w, torch.empty(num_rows, 64), 72, config, is_tree=True,
                        chunks_per_program=g, arrivals=arrivals, is_handoff=True,
                    )  # fmt: skip
                assert launches == [True], launches  # engagement: the hand-off kernel ran
                assert torch.equal(out, outs[0]), (num_rows, g)
                assert not arrivals.any(), (num_rows, g)
    try:
        launch_split_k(x, w, torch.empty(num_rows, 64), 72, config, is_tree=False, is_handoff=True)
    except ValueError as exc:
        assert "needs the tree" in str(exc)
    else:
        raise AssertionError("a hand-off of the chunk-order sum was accepted")


def check_column_slices_same_bits(generator: torch.Generator) -> None:
    """A column-parallel rank's slice (q_proj, gate/up, the LM head) with the whole weight's
    out dim gives the whole linear's columns bitwise; control: a slice narrow enough to take
    the fixed K split on its own shape (3072 -> 1536 columns over K 2048) differs."""
    from moe_kernels.triton_linear import linear_triton
    from moe_kernels.triton_linear_config import k_split_count

    x = torch.randn(5, 2048, generator=generator).to(torch.bfloat16)
    w = (torch.randn(3072, 2048, generator=generator) / 2048**0.5).to(torch.bfloat16)
    assert k_split_count(3072, 2048, w.dtype) == 1 < k_split_count(1536, 2048, w.dtype)
    whole = linear_triton(x, w)
    for tp_size in (2, 4):
        for rank, rows in enumerate(w.chunk(tp_size)):
            part = linear_triton(x, rows, whole_out_dim=w.shape[0])
            cols = slice(rank * rows.shape[0], (rank + 1) * rows.shape[0])
            assert torch.equal(part, whole[:, cols]), (tp_size, rank)
    assert not torch.equal(linear_triton(x, w[:1536]), whole[:, :1536]), "the control agreed"
    try:
        linear_triton(x, w, whole_out_dim=1536)
    except ValueError as exc:
        assert "whole_out_dim 1536" in str(exc)
    else:
        raise AssertionError("a whole_out_dim below the slice's rows was accepted")


CHECKS = {
    "column_slices_same_bits": check_column_slices_same_bits,
    "chunks_per_program_same_bits": check_chunks_per_program_same_bits,
    "tree_sum_kernel": check_tree_sum_kernel,
    "tp_max_one_is_the_plain_linear": check_tp_max_one_is_the_plain_linear,
    "in_program_tree_same_bits": check_in_program_tree_same_bits,
    "in_program_chain_same_bits": check_in_program_chain_same_bits,
    "every_tp_degree_same_bits": check_every_tp_degree_same_bits,
    "rows_invariant": check_rows_invariant,
    "close_to_reference": check_close_to_reference,
}


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    return interpreted.interpreted_results("tests.test_tp_linear", SEED)


@pytest.mark.parametrize("name", list(CHECKS))
def test_triton_tp_linear_interpreted(interpreted_results, name):
    assert interpreted_results[name] == "", interpreted_results[name]
