"""Row invariance of the tiled CPU references on every width, not only multiples of 16.

A row's bits must not depend on its position in a tile, on the batch size, nor on the offset
at which a grouped GEMM finds an expert's rows. Widths swept: 1..16 and the odd ones to 63,
plus 64, for both in and out features. MKL picks its GEMM kernels by CPU, so the linear sweep
also runs in a child process under MKL's SSE4.2 dispatch (the kernels an older CPU gets): on
the fixed-tile code before the K/N padding, out 2-3 and grouped out 1 (in % 4 != 0) failed
there while this CPU's AVX-512 path hid it.

Controls: plain torch's linear and grouped linear (fast mode's) give rows position-dependent
bits at some swept widths, so the linear sweep can fail. Where a control depends on MKL's
kernels it runs in this process and, if it finds no difference here, again under MKL's
SSE4.2 dispatch (`_under_sse42`): the machines these tests were written on gave every such
difference in process; an AMX Xeon's MKL (its AVX-512 and AVX2 kernels) gives none of the
grouped, unpadded-attention or thread ones, its SSE4.2 kernels all of them. At the sweep's
widths plain torch's norm and softmaxes gave a row the same bits in any batch here, so there
an untiled reference is caught only by the engagement check (the row op ran on whole tiles
alone); where torch splits a row's sum (2 threads, D = 2**16) the untiled norm differs and
the tiled one does not. The untiled attention differs at every head shape swept.
"""

import ast
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from moe_kernels import attention, rmsnorm, softmax
from moe_kernels.attention import mla_attention_fast, mla_attention_ref
from moe_kernels.config import MIN_TILE_ROWS
from moe_kernels.linear import grouped_linear_fast, grouped_linear_ref, linear_fast, linear_ref
from moe_kernels.rmsnorm import rms_norm_fast, rms_norm_ref
from moe_kernels.softmax import log_softmax_ref, softmax_ref

TILE = 16
WIDTHS = [*range(1, 17), *range(17, 64, 2), 64]


def _placements(row: torch.Tensor, op) -> list[torch.Tensor]:
    """op's result for `row` [1, ...] at every position of a tile, alone, and in larger batches."""
    g = torch.Generator().manual_seed(1)
    tile = op(row.expand(TILE, *row.shape[1:]).contiguous())
    others = torch.randn(TILE + 7, *row.shape[1:], generator=g).to(row.dtype)
    return [
        *tile,
        op(row)[0],
        op(torch.cat([others[:5], row, others[5:]]))[5],
        op(torch.cat([others, row]))[-1],
    ]


def spy_input_shapes(monkeypatch, module, name: str) -> list[tuple[int, ...]]:
    """Record the shape of the first argument of every call to module.name from now on: the
    row op a tiled reference maps over its tiles, which must only ever see whole tiles."""
    shapes, op = [], getattr(module, name)

    def recorded(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return op(x, *args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return shapes


def _is_invariant(row: torch.Tensor, op) -> bool:
    first, *rest = _placements(row, op)
    return all(torch.equal(first, other) for other in rest)


TILED_LINEAR = partial(linear_ref, tile_rows=TILE)
TILED_GROUPED_LINEAR = partial(grouped_linear_ref, tile_rows=TILE)


def position_dependent_linear_shapes(
    widths=WIDTHS, linear=TILED_LINEAR, grouped_linear=TILED_GROUPED_LINEAR
) -> list[tuple[str, int, int]]:
    """(op, out, in) for every shape whose rows are not bitwise invariant."""
    g = torch.Generator().manual_seed(0)
    bad = []
    for out_dim in widths:
        for in_dim in widths:
            w = torch.randn(2, out_dim, in_dim, generator=g)
            row = torch.randn(1, in_dim, generator=g)
            if not _is_invariant(row, lambda x, w=w: linear(x, w[0])):
                bad.append(("linear", out_dim, in_dim))
            # Expert 1's rows start at a batch-dependent offset behind expert 0's.
            lead, rows = torch.randn(4, in_dim, generator=g), torch.randn(TILE, in_dim, generator=g)
            full = grouped_linear(rows, w, [0, TILE])
            if not all(
                torch.equal(grouped_linear(batch, w, [k, TILE])[k:], full)
                for k in range(1, 5)
                for batch in [torch.cat([lead[:k], rows])]
            ):
                bad.append(("grouped_linear", out_dim, in_dim))
    return bad


def test_linear_rows_invariant_for_every_width():
    assert position_dependent_linear_shapes() == []


def _under_sse42(expression: str):
    """The value of `expression` (a literal's repr: names from this module) computed in a
    child process under MKL's SSE4.2 dispatch (the kernels an older CPU gets), one thread."""
    code = (
        "import tests.test_kernels_shapes as m; globals().update(vars(m)); "
        f"print(repr({expression}))"
    )
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def _fast_sweep_ops() -> list[str]:
    """The ops (linear, grouped_linear) of which fast mode's form has some swept shape with
    position-dependent rows."""
    bad = position_dependent_linear_shapes(linear=linear_fast, grouped_linear=grouped_linear_fast)
    return sorted({op for op, _, _ in bad})


def test_the_width_sweep_catches_untiled_linears():
    """Negative control of the two sweeps: fast mode's plain torch linear and grouped linear
    give some swept shape of each op position-dependent rows, so the sweeps could fail. The
    grouped one's differences follow where its expert's rows start in memory (on the machines
    it was written on); an AMX Xeon's MKL gives them only under its SSE4.2 kernels."""
    ops = _fast_sweep_ops()
    if ops != ["grouped_linear", "linear"]:
        ops = sorted({*ops, *_under_sse42("_fast_sweep_ops()")})
    assert ops == ["grouped_linear", "linear"], ops


def test_linear_rows_invariant_under_mkl_sse42_dispatch():
    assert _under_sse42("position_dependent_linear_shapes()") == []


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("width", [1, 3, 5, 7, 13, 30, 31, 63, 1003])
def test_row_wise_refs_invariant_at_odd_widths(generator, monkeypatch, dtype, width):
    row = torch.randn(1, width, generator=generator).to(dtype)
    weight = torch.randn(width, generator=generator).to(dtype)
    row_ops = {"rms_norm_fast": rmsnorm, "softmax_fast": softmax, "log_softmax_fast": softmax}
    seen = {name: spy_input_shapes(monkeypatch, module, name) for name, module in row_ops.items()}
    assert _is_invariant(row, lambda x: rms_norm_ref(x, weight, 1e-6, tile_rows=TILE))
    assert _is_invariant(row, lambda x: softmax_ref(x, tile_rows=TILE))
    assert _is_invariant(row, lambda x: log_softmax_ref(x, tile_rows=TILE))
    # Engagement: every reference ran its row op on [TILE, width] tiles only. At these widths
    # the untiled ops give the same bits in any batch too (module docstring), so this, not the
    # comparison, is what catches a reference that stopped tiling.
    for name, shapes in seen.items():
        assert set(shapes) == {(TILE, width)}, (name, sorted(set(shapes)))


def test_untiled_rms_norm_differs_where_torch_splits_a_row(generator, restore_num_threads):
    """Negative control: with 2 threads torch splits a lone row of 2**16 between the threads but
    gives each row of a batch to one thread, so the untiled norm's bits follow the batch for
    some rows (rsqrt hides most differences in the sum, so 32 rows are tried); the reference
    must be invariant on the very row where it does. Softmax and log-softmax have no such shape
    on this CPU (tests/test_kernels_softmax.py, whose control is a split-sum softmax): the
    engagement check above is what catches an untiled one."""
    torch.set_num_threads(2)
    width = 2**16
    rows = torch.randn(32, 1, width, generator=generator)
    weight = torch.rand(width, generator=generator)

    def untiled(x):
        return rms_norm_fast(x, weight, 1e-6)

    caught = next((row for row in rows if not _is_invariant(row, untiled)), None)
    assert caught is not None, "untiled, every row was invariant: the control cannot fail"
    assert _is_invariant(caught, lambda x: rms_norm_ref(x, weight, 1e-6, tile_rows=TILE))


# (cache_dim, v_dim, num_heads, seq_len): at each the untiled attention's bits follow the batch
# (one head needs a long sequence for that; (7, 5, 1) at 11 positions was invariant untiled).
HEAD_SHAPES = [(7, 5, 2, 40), (13, 9, 1, 100), (13, 9, 3, 11), (31, 17, 2, 11)]


@pytest.mark.parametrize("cache_dim, v_dim, num_heads, seq_len", HEAD_SHAPES)
def test_attention_ref_invariant_at_odd_head_dims(
    generator, monkeypatch, cache_dim, v_dim, num_heads, seq_len
):
    block_size = 4
    num_blocks = -(-seq_len // block_size)
    kv_cache = torch.randn(num_blocks + 1, block_size, cache_dim, generator=generator)
    block_tables = torch.randperm(num_blocks + 1, generator=generator)[None, :num_blocks]
    q = torch.randn(1, num_heads, cache_dim, generator=generator)

    def attend(op, **tiling):  # every query is sequence 0 at the last position
        def run(qs):
            n = qs.shape[0]
            positions = torch.full((n,), seq_len - 1, dtype=torch.int64)
            seq_ids = torch.zeros(n, dtype=torch.int64)
            return op(
                qs, kv_cache, seq_ids, block_tables, positions, scale=0.3, v_dim=v_dim, **tiling
            )

        return run

    tiles = spy_input_shapes(monkeypatch, attention, "_attend_tile")
    assert _is_invariant(q, attend(mla_attention_ref, tile_rows=TILE))
    assert set(tiles) == {(TILE, num_heads, cache_dim)}, sorted(set(tiles))  # engagement
    # Negative control: the untiled attention on the same inputs, in either of fast mode's
    # forms: one batched product a query (an AVX-512 Xeon's MKL gives it the same bits in any
    # batch; an AMD EPYC's did not), or, past FAST_PADDED_BYTES, a product a sequence whose
    # rows are the batch's queries of it (here every query: its bits follow their count).
    is_padded_invariant = _is_invariant(q, attend(mla_attention_fast))
    monkeypatch.setattr(attention, "FAST_PADDED_BYTES", 0)
    is_per_sequence_invariant = _is_invariant(q, attend(mla_attention_fast))
    assert not (is_padded_invariant and is_per_sequence_invariant), "the control cannot fail"


# (block_size, cache_dim, v_dim, seq_len): long cache blocks (64, 65) with a latent width
# (kv_lora_rank) or a block that is no multiple of 16. Unpadded, MKL's bmm rounded these
# products by their index in the tile (each shape here; blocks of 1-16 were invariant): a model
# with kv_lora_rank 11 and blocks of 64 gave a decoded token other top-k logprobs alone than in
# a batch (found by a shape fuzz).
BLOCK_SHAPES = [(64, 17, 11, 100), (64, 13, 9, 70), (65, 72, 64, 80), (64, 40, 17, 70)]


def _block_shape_case(block_size: int, cache_dim: int, v_dim: int, seq_len: int):
    """(a query [1, 1, cache_dim], attend(queries): the tiled reference with every query
    sequence 0 at its last position) over a seeded cache of blocks of block_size."""
    g = torch.Generator().manual_seed(0)
    num_blocks = -(-seq_len // block_size)
    kv_cache = torch.randn(num_blocks + 1, block_size, cache_dim, generator=g)
    block_tables = torch.randperm(num_blocks + 1, generator=g)[None, :num_blocks]
    q = torch.randn(1, 1, cache_dim, generator=g)

    def attend(qs):
        n = qs.shape[0]
        positions = torch.full((n,), seq_len - 1, dtype=torch.int64)
        seq_ids = torch.zeros(n, dtype=torch.int64)
        return mla_attention_ref(
            qs, kv_cache, seq_ids, block_tables, positions, scale=0.3, v_dim=v_dim, tile_rows=TILE
        )

    return q, attend


def _unpadded_is_invariant(*shape: int) -> bool:
    """Whether _block_shape_case(*shape)'s query keeps its bits in any batch with the
    per-head products unpadded (PAD_FEATURES 1)."""
    q, attend = _block_shape_case(*shape)
    kept = attention.PAD_FEATURES
    attention.PAD_FEATURES = 1
    try:
        return _is_invariant(q, attend)
    finally:
        attention.PAD_FEATURES = kept


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_attention_ref_invariant_at_odd_block_and_latent_widths(monkeypatch, shape):
    q, attend = _block_shape_case(*shape)
    products = spy_input_shapes(monkeypatch, torch, "bmm")
    assert _is_invariant(q, attend)
    # Engagement: every product ran on 16-wide K and N, one product a (row, head) of a tile.
    assert all(m == TILE and k % 16 == 0 for m, _, k in products), sorted(set(products))
    # Negative control: the same products unpadded give the query position-dependent bits
    # (in process where this was found; on an AMX Xeon only under MKL's SSE4.2 kernels).
    monkeypatch.undo()
    is_invariant = _unpadded_is_invariant(*shape)
    if is_invariant:
        is_invariant = _under_sse42(f"_unpadded_is_invariant{tuple(shape)}")
    assert not is_invariant, "unpadded, the query was invariant: no control"


def _position_dependent_tiles(tiles, num_threads: int) -> list[int]:
    """The tile_rows among `tiles` at which some row of linear_ref, at a few widths, gets bits
    that follow its place in the batch, run with num_threads intra-op threads."""
    torch.set_num_threads(num_threads)
    g = torch.Generator().manual_seed(2)
    shapes = [(64, 13), (512, 13), (64, 300), (512, 300)]
    weights = [(torch.randn(1, k, generator=g), torch.randn(n, k, generator=g)) for n, k in shapes]
    return [
        tile
        for tile in tiles
        if not all(
            _is_invariant(row, partial(linear_ref, weight=w, tile_rows=tile)) for row, w in weights
        )
    ]


def test_linear_rows_invariant_with_threads_at_power_of_two_tiles(restore_num_threads):
    """kernels.num_threads > 1 needs a power-of-two kernels.tile_rows (KernelConfig refuses
    others): there a row's bits ignore the batch with 2 threads. Control: on the CPUs this was
    measured on, with 2 threads MKL split the rows of a 5-11-row tile between the threads and
    some of those tile heights gave rows position-dependent bits (5-7 and 9-11), with one thread
    none, so the threads were the cause. An AMX Xeon's MKL splits no tile so (none differs in
    process); there the check is shown able to fail under its SSE4.2 kernels, where tiles of 5-7
    rows differ with any thread count."""
    assert _position_dependent_tiles([1, 2, 4, 8, 16, 32], num_threads=2) == []
    odd_tiles = [5, 6, 7, 9, 10, 11]
    caught = _position_dependent_tiles(odd_tiles, num_threads=2)
    if not caught:
        caught = _under_sse42(f"_position_dependent_tiles({odd_tiles}, num_threads=2)")
    assert caught, "no control: every odd tile matched"
    assert _position_dependent_tiles(odd_tiles, num_threads=1) == []


def test_the_tiles_invariant_mode_takes_hold_under_mkl_sse42():
    """KernelConfig takes kernels.tile_rows 1 or at least MIN_TILE_ROWS in invariant mode: under
    MKL's SSE4.2 kernels (a CPU without AVX) those heights hold on one thread, and each refused
    height (2-7) gives some row bits that follow its place in the batch there (the control,
    and the reason for the refusal; an AVX CPU holds at all of them)."""
    taken = [1, MIN_TILE_ROWS, 12, 16, 64]
    refused = list(range(2, MIN_TILE_ROWS))
    caught = _under_sse42(f"_position_dependent_tiles({taken + refused}, num_threads=1)")
    assert [tile for tile in caught if tile in taken] == []
    assert caught == refused
