"""Attention with TP: o_proj runs whole on each TP rank's token share (moe_runtime/model/mla.py).

- Over gloo (two processes): a TP-2 rank holds o_proj's whole weight [D, H * v] (the TP-1
  values), and its attention output [T, D] equals the TP-1 attention's bit for bit on the same
  inputs in invariant mode, at T = 1 (rank 1's share is empty: it still joins both
  collectives), at T = 2 (a row each) and at T = 37 (uneven shares); the rank counted one head
  exchange and one gather of o_proj's rows per call, and no row-parallel sum. Negative
  control: fast kernels differ at T = 2 or 37 (o_proj on a share of 1, 18 or 19 rows rounds
  otherwise than on all the rows: on an AVX-512 Xeon's MKL only a one-row product (its GEMV)
  differs from a many-row one, so T = 2, whose shares are a row each; on the AMD EPYC where
  this was written, T = 37 did too).
- The same in bfloat16 proves no invariance: on this CPU torch's bfloat16 GEMMs and attention
  gave TP 2 the TP-1 bits in fast mode too (T from 1 to 600, o_proj K up to 2048), so there it
  only checks that the heads land in the columns o_proj reads at TP 1 in the bfloat16 path.
- The head exchange alone, at tp 2 and 4: every rank receives every head of its own tokens,
  heads in global order (the columns the TP-1 attention's o_proj reads).
"""

from __future__ import annotations

import pytest
import torch

from comm import ParallelConfig, destroy_process_groups, init_process_groups
from moe_kernels import KernelConfig, build_op_table
from moe_runtime.config import load_config
from moe_runtime.forward_batch import ForwardBatch
from moe_runtime.model.loader import build_model
from moe_runtime.model.tensor_parallel import TensorParallel
from tests.invariance import TINY_CONFIG
from tests.test_comm_groups import MASTER_ADDR, run_ranks

NUM_TOKENS = (1, 2, 37)
BLOCK_SIZE = 16


def _attention_inputs(cfg, num_tokens: int, dtype: torch.dtype):
    """(x [T, D], one sequence's batch of T prompt tokens, an empty latent cache): the same on
    every rank."""
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, cfg.hidden_size, generator=generator).to(dtype)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    batch = ForwardBatch(
        token_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.arange(num_tokens),
        query_seq_ids=torch.zeros(num_tokens, dtype=torch.int64),
        block_tables=torch.arange(num_blocks)[None],
        slot_mapping=torch.arange(num_tokens),
        logits_indices=torch.arange(num_tokens),
    )
    kv_cache = torch.zeros(num_blocks, BLOCK_SIZE, cfg.latent_dim, dtype=dtype)
    return x, batch, kv_cache


def _attention_worker(rank: int, world_size: int, port: int, dtype_name: str, mode: str) -> dict:
    config = ParallelConfig(world_size=world_size, tp_size=world_size, backend="gloo")
    groups = init_process_groups(config, rank, MASTER_ADDR, port)
    cfg = load_config(TINY_CONFIG, {"model.dtype": dtype_name}).model
    ops = build_op_table(KernelConfig(tile_rows=BLOCK_SIZE, mode=mode), "cpu")
    tp = TensorParallel(groups.tp_size, groups.tp_rank, groups.tp_group)
    whole = build_model(cfg, ops).model.layers[0].self_attn  # TP 1: no collective
    split = build_model(cfg, ops, tp=tp).model.layers[0].self_attn
    result = {
        "o_proj": split.o_proj.weight.clone(),
        "whole_o_proj": whole.o_proj.weight.clone(),
        "num_heads": split.num_heads,
        "out": {},
    }
    for num_tokens in NUM_TOKENS:
        x, batch, kv_cache = _attention_inputs(cfg, num_tokens, split.o_proj.weight.dtype)
        with torch.inference_mode():
            # Collectives: every rank runs the TP-2 attention once per T, in this order.
            got = split(x, batch, kv_cache.clone())
            want = whole(x, batch, kv_cache.clone())
        result["out"][num_tokens] = (got, want)
    result["calls"] = dict(tp.num_calls)
    destroy_process_groups()
    return result


def _check_tp2_attention(results) -> dict[int, bool]:
    """The TP-2 layout and collectives on every rank; -> {T: TP 2 gave the TP-1 bits on every
    rank}."""
    cfg = load_config(TINY_CONFIG).model
    whole_k = cfg.num_attention_heads * cfg.v_head_dim
    is_equal = dict.fromkeys(NUM_TOKENS, True)
    for rank, r in enumerate(results):
        assert r["num_heads"] == cfg.num_attention_heads // 2, rank  # the heads are split
        assert tuple(r["o_proj"].shape) == (cfg.hidden_size, whole_k), rank
        assert torch.equal(r["o_proj"], r["whole_o_proj"]), rank
        for num_tokens, (got, want) in r["out"].items():
            assert got.shape == (num_tokens, cfg.hidden_size), (rank, num_tokens)
            is_equal[num_tokens] &= torch.equal(got, want)
        # Engagement: the split path ran (one head exchange and one share gather per call).
        calls = len(NUM_TOKENS)
        assert r["calls"] == {"head_exchange": calls, "attention_share_gather": calls}, r["calls"]
    return is_equal


# bfloat16: the TP-1 values in the bfloat16 path, no proof of invariance (module docstring).
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_tp2_attention_gives_tp1_bits(tmp_path, dtype_name):
    results = run_ranks(_attention_worker, 2, tmp_path, dtype_name, "invariant", timeout_s=120.0)
    is_equal = _check_tp2_attention(results)
    assert all(is_equal.values()), f"TP 2 differs from TP 1 at T: {is_equal}"


def test_tp2_attention_fast_kernels_differ(tmp_path):
    """Negative control (float32 only: bfloat16 finds no difference here, module docstring)."""
    results = run_ranks(_attention_worker, 2, tmp_path, "float32", "fast", timeout_s=120.0)
    is_equal = _check_tp2_attention(results)
    assert not (is_equal[2] and is_equal[37]), (
        f"fast kernels gave TP 2 the TP-1 bits at T = 2 and 37: the comparison cannot fail "
        f"({is_equal})"
    )


def _exchange_worker(rank: int, world_size: int, port: int) -> dict:
    config = ParallelConfig(world_size=world_size, tp_size=world_size, backend="gloo")
    groups = init_process_groups(config, rank, MASTER_ADDR, port)
    tp = TensorParallel(groups.tp_size, groups.tp_rank, groups.tp_group)
    out = {}
    num_heads, width = 4 * world_size, 3  # 4 heads a rank, 3 channels a head
    for num_tokens in (0, 1, 5, 8):
        # Element (token t, head h, channel c) = 1000 t + 10 h + c; this rank holds its heads.
        t, h, c = torch.meshgrid(
            torch.arange(num_tokens), torch.arange(num_heads), torch.arange(width), indexing="ij"
        )
        every = (1000 * t + 10 * h + c).float()
        mine = every[:, rank * 4 : (rank + 1) * 4].reshape(num_tokens, 4 * width)
        want = every[tp.token_share(num_tokens)].reshape(-1, num_heads * width)
        # Collective: every rank exchanges once per T, in this order, empty shares included.
        out[num_tokens] = (tp.heads_to_share(mine), want)
    destroy_process_groups()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_heads_to_share_gives_every_head_of_the_share(tmp_path, world_size):
    results = run_ranks(_exchange_worker, world_size, tmp_path, timeout_s=60.0)
    for rank, r in enumerate(results):
        for num_tokens, (got, want) in r.items():
            assert torch.equal(got, want), (rank, num_tokens)
    assert results[world_size - 1][1][0].shape == (0, 4 * world_size * 3)  # an empty share
