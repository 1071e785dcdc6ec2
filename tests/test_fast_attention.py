"""Fast-mode decode attention (moe_kernels/fast_attention.py): closeness to the torch oracle with a
tolerance (fast mode is not batch-invariant, so bits are not the contract here), the split
choice, the fallback of batches that are not decode-shaped, the rule that takes the invariant
launch instead of FlashMLA; on the GPU the three paths (FlashMLA when installed) at 16 and 128
heads, and a CUDA-graph capture replayed with new positions.

As in tests/test_triton_kernels.py, the Triton kernels run on CPU only under TRITON_INTERPRET=1,
read at import of the kernel module, so the interpreted checks run in one fresh process
(tests/interpreted.py) and each test asserts on its own check's outcome.
"""

from __future__ import annotations

import pytest
import torch

from moe_kernels.attention import mla_attention_fast, mla_attention_ref
from tests import interpreted

SEED = 0
# fp32 with exact (ieee) products vs the oracle on fp64 inputs: a few fp32 ulps.
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
# bf16 probabilities times bf16 values, fp32 accumulation, bf16 output: about one bf16 ulp.
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}
SPLIT_CHOICES = (1, 2, 3, 7)  # cache blocks per KV split; 7 = the tables' width (one split)
CPU_SEQ_LENS = (40, 5, 70, 16, 1)  # block size 16: within, at and across block boundaries
GPU_SEQ_LENS = (1000, 70, 300, 5, 257, 64, 65, 1)  # block size 64, V2-Lite / V3 decode


def _decode_batch(generator, seq_lens, num_heads, v_dim, rope_dim, block_size, extra_cols=2):
    """One query per sequence at its last position (query t is sequence t). NaN in every
    unwritten cache slot, sequences in shuffled blocks, tables -1 padded by extra_cols."""
    cache_dim = v_dim + rope_dim
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    kv_cache = torch.full((num_blocks, block_size, cache_dim), float("nan"))
    width = -(-max(seq_lens) // block_size) + extra_cols
    block_tables = torch.full((len(seq_lens), width), -1)
    free_blocks = torch.randperm(num_blocks, generator=generator)
    used = 0
    for seq_id, seq_len in enumerate(seq_lens):
        blocks = free_blocks[used : used + -(-seq_len // block_size)]
        used += len(blocks)
        block_tables[seq_id, : len(blocks)] = blocks
        pos = torch.arange(seq_len)
        kv_cache[blocks[pos // block_size], pos % block_size] = torch.randn(
            seq_len, cache_dim, generator=generator
        )
    q = torch.randn(len(seq_lens), num_heads, cache_dim, generator=generator)
    positions = torch.tensor(seq_lens) - 1
    return q, kv_cache, torch.arange(len(seq_lens)), block_tables, positions


def _oracle(q, kv_cache, seq_ids, block_tables, positions, **args):
    return mla_attention_ref(
        q.double(), kv_cache.double(), seq_ids, block_tables, positions, **args, tile_rows=8
    )


def check_split_kv_matches_oracle(generator: torch.Generator) -> None:
    from moe_kernels.fast_attention import mla_decode_fast, mla_decode_split_kv

    args = dict(scale=40**-0.5, v_dim=32)
    # 4 heads: one masked head block; 20 heads: two head blocks, the second partly masked.
    for num_heads in (4, 20):
        batch = _decode_batch(generator, CPU_SEQ_LENS, num_heads, 32, 8, 16)
        assert batch[3].shape[1] == max(SPLIT_CHOICES)
        expected = _oracle(*batch, **args)
        for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
            q, kv_cache = batch[0].to(dtype), batch[1].to(dtype)
            for split_blocks in SPLIT_CHOICES:
                got = mla_decode_split_kv(
                    q, kv_cache, *batch[2:], **args, split_blocks=split_blocks
                )
                assert got.dtype == dtype and got.shape == (5, num_heads, 32)
                torch.testing.assert_close(
                    got.double(),
                    expected,
                    **tol,
                    msg=lambda m, s=split_blocks: f"split_blocks={s}: {m}",
                )
            # The op itself: no FlashMLA on CPU, the split chosen from the shape.
            got = mla_decode_fast(q, kv_cache, *batch[2:], **args)
            torch.testing.assert_close(got.double(), expected, **tol)
    q, kv_cache, seq_ids, tables, positions = _decode_batch(generator, (3,), 4, 32, 8, 16)
    empty = mla_decode_fast(q[:0], kv_cache, seq_ids[:0], tables[:0], positions[:0], **args)
    assert empty.shape == (0, 4, 32)


CHECKS = {"split_kv_matches_oracle": check_split_kv_matches_oracle}


@pytest.fixture(scope="module")
def interpreted_results() -> dict:
    return interpreted.interpreted_results("tests.test_fast_attention", SEED)


@pytest.mark.parametrize("name", list(CHECKS))
def test_fast_attention_interpreted(interpreted_results, name):
    assert interpreted_results[name] == "", interpreted_results[name]


@pytest.mark.parametrize("num_sms", (1, 8, 132))
@pytest.mark.parametrize("num_heads", (1, 16, 128))
@pytest.mark.parametrize("num_tokens", (1, 3, 64, 256))
@pytest.mark.parametrize("table_width", (1, 5, 64, 512))
def test_split_choice_fills_the_gpu_from_host_shapes(num_sms, num_heads, num_tokens, table_width):
    from moe_kernels.fast_attention import WAVES, choose_split_blocks
    from moe_kernels.triton_attention import BLOCK_H

    split_blocks = choose_split_blocks(num_tokens, num_heads, table_width, num_sms)
    assert 1 <= split_blocks <= table_width
    programs_per_split = num_tokens * -(-num_heads // BLOCK_H)
    num_splits = -(-table_width // split_blocks)
    # WAVES programs per SM, unless the table has fewer blocks than that takes.
    assert programs_per_split * num_splits >= min(WAVES * num_sms, programs_per_split * table_width)
    if programs_per_split >= WAVES * num_sms:
        assert num_splits == 1  # enough programs already: one split, no merge launch


def test_not_decode_shaped_batches_take_the_paged_triton_kernel(generator):
    from moe_kernels.fast_attention import mla_decode_fast

    # Two chunks of a prefill (T = 6 tokens, B = 2 sequences). Compiled Triton (no interpreter
    # in this process) refuses CPU tensors, naming mla_attention_triton's check: the batch
    # reached the paged kernel and not plain torch, which would have run here.
    _, kv_cache, _, tables, _ = _decode_batch(generator, (4, 9), 4, 32, 8, 16)
    q = torch.randn(6, 4, 40, generator=generator)
    seq_ids, positions = torch.tensor([0, 0, 1, 1, 1, 1]), torch.tensor([2, 3, 5, 6, 7, 8])
    args = dict(scale=40**-0.5, v_dim=32)
    assert mla_attention_fast(q, kv_cache, seq_ids, tables, positions, **args).shape == (6, 4, 32)
    with pytest.raises(ValueError, match="cpu"):
        mla_decode_fast(q, kv_cache, seq_ids, tables, positions, **args)


def test_decode_shaped_batches_take_the_kernel_path(generator):
    from moe_kernels.fast_attention import mla_decode_fast

    # Compiled Triton (no interpreter in this process) refuses CPU tensors: the decode-shaped
    # batch reached the kernel path, not the torch fallback.
    batch = _decode_batch(generator, (4, 9), 4, 32, 8, 16)
    with pytest.raises(ValueError, match="cpu"):
        mla_decode_fast(*batch, scale=1.0, v_dim=32)


@pytest.mark.parametrize(
    ("num_tokens", "table_width", "whole_heads", "expected"),
    [
        (1, 64, 16, True),  # one query at context 4096: 16 pairs
        (16, 64, 16, True),  # 256 pairs
        (17, 64, 16, False),
        (128, 64, 16, False),  # 2048 pairs, below the whole-query launch's queries
        (64, 16, 16, True),  # context 1024: 4 splits a query, 256 pairs
        (65, 16, 16, False),
        (256, 128, 16, True),  # the whole-query launch
        (1, 64, 128, False),  # the wide launch: FlashMLA won everywhere against it
        (256, 16, 64, False),
    ],
)
def test_fast_decode_takes_the_invariant_launch_where_it_was_faster(
    num_tokens, table_width, whole_heads, expected
):
    """The rule from host shapes: narrow models at few (query, split) pairs or many queries;
    never the wide launch. The measured split (4 blocks) and limits are the rule's inputs."""
    from moe_kernels import fast_attention
    from moe_kernels.attention_launch import NARROW_LAUNCH

    assert NARROW_LAUNCH.split_blocks == 4
    assert (fast_attention.INVARIANT_MAX_PAIRS, fast_attention.INVARIANT_MIN_QUERIES) == (256, 256)
    assert fast_attention.takes_invariant_launch(num_tokens, table_width, whole_heads) is expected


@pytest.mark.parametrize(
    "num_tokens, whole_heads, expected",
    [(1, 128, True), (4, 128, True), (5, 128, False), (64, 128, False), (1, 16, False)],
)
def test_fast_decode_takes_the_split_kv_kernel_where_it_was_faster(
    num_tokens, whole_heads, expected
):
    """The rule from host shapes: wide-launch models (128 heads) at few queries; never a narrow
    model (its own rule above)."""
    from moe_kernels import fast_attention

    assert fast_attention.SPLIT_KV_MAX_QUERIES == 4
    assert fast_attention.takes_split_kv(num_tokens, whole_heads) is expected


def _gpu_decode_batch(generator, num_heads):
    batch = _decode_batch(generator, GPU_SEQ_LENS, num_heads, 512, 64, 64, extra_cols=9)
    q, kv_cache, *rest = (t.to("cuda") for t in batch)
    return [q.bfloat16(), kv_cache.bfloat16(), *rest]


def _use_path(monkeypatch, path: str) -> None:
    from moe_kernels import fast_attention

    if path == "split_kv":
        monkeypatch.setattr(fast_attention, "HAS_FLASH_MLA", False)
        return
    if not fast_attention.HAS_FLASH_MLA:
        pytest.skip("flash_mla is not installed or did not load (README: FlashMLA)")
    if torch.cuda.get_device_capability() != fast_attention.FLASH_MLA_CAPABILITY:
        pytest.skip("FlashMLA's dense decode runs on SM90 only")
    # Where FlashMLA could serve, the rule picks it or the invariant launch by shape: pinned
    # here so each path runs whatever the test's shape.
    is_invariant = path == "invariant"
    monkeypatch.setattr(fast_attention, "takes_invariant_launch", lambda *_: is_invariant)
    monkeypatch.setattr(fast_attention, "takes_split_kv", lambda *_: False)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_ARGS = dict(scale=192**-0.5, v_dim=512)  # V2-Lite: qk_nope 128 + rope 64


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ("split_kv", "flash_mla", "invariant"))
@pytest.mark.parametrize("num_heads", (16, 128))  # V2-Lite, V3
def test_gpu_decode_paths_match_oracle(generator, monkeypatch, path, num_heads):
    from moe_kernels import fast_attention
    from moe_kernels.triton_attention import mla_attention_triton

    _use_path(monkeypatch, path)
    batch = _gpu_decode_batch(generator, num_heads)
    assert fast_attention.uses_flash_mla(batch[0], batch[1], 512) == (path != "split_kv")
    got = fast_attention.mla_decode_fast(*batch, **GPU_ARGS)
    assert got.dtype == torch.bfloat16 and got.shape == (len(GPU_SEQ_LENS), num_heads, 512)
    expected = mla_attention_ref(*batch, **GPU_ARGS, tile_rows=64)
    torch.testing.assert_close(got.float(), expected.float(), **BF16_TOL)
    # The path ran: the invariant launch's own bits, FlashMLA's others.
    is_invariant = torch.equal(got, mla_attention_triton(*batch, **GPU_ARGS))
    assert is_invariant == (path == "invariant")
    if path == "split_kv":
        for split_blocks in (1, 4, batch[3].shape[1]):
            got = fast_attention.mla_decode_split_kv(*batch, **GPU_ARGS, split_blocks=split_blocks)
            torch.testing.assert_close(got.float(), expected.float(), **BF16_TOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ("split_kv", "flash_mla", "invariant"))
def test_gpu_decode_is_capturable_and_replays_new_positions(generator, monkeypatch, path):
    from moe_kernels.fast_attention import mla_decode_fast

    _use_path(monkeypatch, path)
    q, kv_cache, seq_ids, tables, positions = _gpu_decode_batch(generator, 16)
    lengths = positions + 1

    def step():
        return mla_decode_fast(q, kv_cache, seq_ids, tables, positions, **GPU_ARGS)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host sync inside would fail the capture
        out = step()
    previous = None
    # The written lengths, then shorter ones crossing block boundaries, then one position each.
    for new_positions in (lengths - 1, (lengths - 1) // 2, lengths.clamp(max=65) - 1, 0 * lengths):
        positions.copy_(new_positions)
        graph.replay()
        expected = mla_attention_ref(
            q, kv_cache, seq_ids, tables, positions, **GPU_ARGS, tile_rows=64
        )
        torch.testing.assert_close(out.float(), expected.float(), **BF16_TOL)
        if previous is not None:
            assert not torch.equal(out, previous), "the replay did not see the new positions"
        previous = out.clone()


@pytest.mark.gpu
@needs_cuda
def test_gpu_flash_mla_layers_of_a_step_share_one_plan(generator, monkeypatch):
    """The layers of a step (same positions and tables objects) share FlashMLA's metadata; a
    step whose positions changed in place, or a capture after its warm-up, plans afresh, and
    every layer's output stays the oracle's under replays with new positions."""
    from moe_kernels import fast_attention

    _use_path(monkeypatch, "flash_mla")
    q, kv_cache, seq_ids, tables, positions = _gpu_decode_batch(generator, 16)
    layer_qs = [q, torch.randn_like(q)]  # two "layers": same step, different queries
    lengths = positions + 1

    def step():
        return [fast_attention.mla_decode_fast(lq, kv_cache, seq_ids, tables, positions, **GPU_ARGS)
                for lq in layer_qs]  # fmt: skip

    def check(outs):
        for lq, out in zip(layer_qs, outs, strict=True):
            expected = mla_attention_ref(
                lq, kv_cache, seq_ids, tables, positions, **GPU_ARGS, tile_rows=64
            )
            torch.testing.assert_close(out.float(), expected.float(), **BF16_TOL)

    check(step())
    plan = fast_attention._STEP_PLANS[id(positions)]
    check(step())  # the same step again: the same plan, filled once
    assert fast_attention._STEP_PLANS[id(positions)] is plan
    positions.copy_((lengths - 1) // 2)  # in place: a new step in the same tensor
    check(step())
    assert fast_attention._STEP_PLANS[id(positions)] is not plan, "a stale plan was reused"
    eager_plan = fast_attention._STEP_PLANS[id(positions)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    assert fast_attention._STEP_PLANS[id(positions)] is not eager_plan, "capture reused warm-up's"
    for new_positions in (lengths - 1, lengths.clamp(max=65) - 1, 0 * lengths):
        positions.copy_(new_positions)
        graph.replay()
        check(outs)


@pytest.mark.gpu
@needs_cuda
def test_gpu_flash_mla_reads_the_query_after_the_kernel_before_it_ends(generator, monkeypatch):
    """FlashMLA's decode kernel is launched with PDL and does not wait for its predecessor; the
    fence (_wait_for_earlier_kernels) makes it read the query only once the kernel that wrote
    it has ended: the same bits as with the query written long before. Control: without the
    fence, after a late-storing PDL kernel, it reads the unwritten (NaN) query."""
    from moe_kernels import fast_attention
    from tests.late_write import written_late

    _use_path(monkeypatch, "flash_mla")
    q, kv_cache, seq_ids, tables, positions = _gpu_decode_batch(generator, 128)
    want = fast_attention.mla_decode_fast(q, kv_cache, seq_ids, tables, positions, **GPU_ARGS)

    def after_a_late_write() -> torch.Tensor:
        # The step's plan already exists (same positions and tables): no metadata kernel
        # comes between, as in every layer after a step's first.
        late = written_late(q)
        out = fast_attention.mla_decode_fast(late, kv_cache, seq_ids, tables, positions, **GPU_ARGS)
        torch.cuda.synchronize()
        return out

    assert torch.equal(after_a_late_write(), want)
    monkeypatch.setattr(fast_attention, "_wait_for_earlier_kernels", lambda plan: None)
    assert not torch.equal(after_a_late_write(), want), "without the fence FlashMLA waited anyway"
