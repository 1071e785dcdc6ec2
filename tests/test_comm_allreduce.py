"""TP all-reduce with the invariant `sum_over_ranks` (gloo on CPU; NCCL on 2 GPUs): same bits
on every rank, for every message size.

The control, the fast `sum_over_ranks`: gloo's own all_reduce (ring, chunked by message size)
gives element i different bits when it travels in a short message than inside a long one, for
fp32 values of very different magnitudes at 4 ranks.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from comm import all_reduce, destroy_process_groups, init_process_groups, worker_nccl_env
from comm.allreduce import all_to_all_equal
from moe_kernels.combine import sum_over_ranks_fast, sum_over_ranks_ref
from tests.test_comm_groups import BACKENDS, MASTER_ADDR, backend_config, run_ranks

NUM_ELEMENTS = 1 << 13
WINDOW = 16  # the short message: WINDOW elements taken from the long one
NUM_WINDOWS = 8


def rank_values(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[NUM_ELEMENTS] values with magnitudes 1e-6 .. 1e6, so summation order shows in the bits."""
    gen = torch.Generator().manual_seed(1000 + rank)
    exponent = torch.randint(-6, 7, (NUM_ELEMENTS,), generator=gen).float()
    return (torch.randn(NUM_ELEMENTS, generator=gen) * torch.pow(10.0, exponent)).to(dtype)


def _windows(x: torch.Tensor) -> list[torch.Tensor]:
    stride = NUM_ELEMENTS // NUM_WINDOWS
    return [x[i * stride : i * stride + WINDOW] for i in range(NUM_WINDOWS)]


def _all_reduce_worker(rank: int, world_size: int, port: int, backend: str) -> dict:
    config = backend_config(world_size, backend)
    if config.device == "cuda":
        os.environ.update(worker_nccl_env())  # this test process stands in for launch/
        torch.cuda.set_device(rank)
    groups = init_process_groups(config, rank, MASTER_ADDR, port)
    result = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        x = rank_values(rank, dtype).to(groups.device)
        group = groups.ep_group
        # Collectives: every rank runs the same sequence of reductions below.
        result[name] = {}
        for key, op in (("pinned", sum_over_ranks_ref), ("plain", sum_over_ranks_fast)):
            result[name][f"{key}_long"] = all_reduce(x, group, op)
            result[name][f"{key}_short"] = [all_reduce(w, group, op) for w in _windows(x)]
    destroy_process_groups()
    return {
        name: {
            key: [t.cpu() for t in v] if isinstance(v, list) else v.cpu() for key, v in r.items()
        }
        for name, r in result.items()
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_pinned_all_reduce_ignores_message_size(tmp_path, backend):
    world_size = 4 if backend == "gloo" else 2
    if torch.cuda.device_count() < world_size and backend == "nccl":
        pytest.skip(f"needs {world_size} CUDA devices")
    results = run_ranks(_all_reduce_worker, world_size, tmp_path, backend)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        # Reference: the rank-order sum in fp32, computed here in one process.
        expected = rank_values(0, dtype).float()
        for rank in range(1, world_size):
            expected = expected + rank_values(rank, dtype).float()
        expected = expected.to(dtype)
        for res in results:
            pinned = res[name]
            assert pinned["pinned_long"].dtype == dtype
            assert torch.equal(pinned["pinned_long"], expected)
            for short, long in zip(pinned["pinned_short"], _windows(expected), strict=True):
                assert torch.equal(short, long)
            assert torch.equal(pinned["plain_long"], results[0][name]["plain_long"])
    if backend == "nccl":
        return  # NCCL's own order is measured in the report, not asserted here
    plain = results[0]["fp32"]
    # Same sum in another order: close in fp32 (bf16 plain accumulates in bf16, so not there);
    # atol 1.0 because terms up to 1e6 cancel, leaving their fp32 rounding (ulp 0.06 at 1e6).
    torch.testing.assert_close(plain["plain_long"], plain["pinned_long"], rtol=1e-5, atol=1.0)
    # Control: gloo's own all_reduce gives some element other bits in a short message.
    num_diff = sum(
        int((short != long).sum())
        for short, long in zip(plain["plain_short"], _windows(plain["plain_long"]), strict=True)
    )
    assert num_diff > 0, "gloo all_reduce was size-independent: the control found nothing"


def test_the_workers_nccl_env_leaves_nccl_its_channels():
    """No bit of invariant mode goes through an NCCL reduction (the pinned sum above all-gathers),
    so the workers' NCCL keeps its own algorithm, protocol and channel count: pinned to one
    channel, every all_to_all of the MoE exchange ran on one NVLink channel."""
    env = worker_nccl_env()
    assert not {"NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"} & set(env)
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_COLLNET_ENABLE"] == "0"


def _strided_exchange_worker(rank: int, world_size: int, port: int) -> dict:
    groups = init_process_groups(backend_config(world_size, "gloo"), rank, MASTER_ADDR, port)
    # [R * n, w] as a transposed view: its rows are not one dense block each.
    strided = (torch.arange(24.0).view(3, 8) + 100 * rank).t()
    # Collectives: every rank runs both exchanges, in this order.
    result = {"strided": all_to_all_equal(strided, groups.ep_group)}
    result["dense"] = all_to_all_equal(strided.contiguous(), groups.ep_group)
    destroy_process_groups()
    return result


def test_all_to_all_equal_of_a_strided_view_moves_its_rows(tmp_path):
    results = run_ranks(_strided_exchange_worker, 2, tmp_path)
    blocks = [(torch.arange(24.0).view(3, 8) + 100 * r).t().split(4) for r in range(2)]
    for rank, res in enumerate(results):
        # Block j of what rank r receives: rank j's block r, as for a dense input.
        expected = torch.cat([blocks[source][rank] for source in range(2)])
        assert torch.equal(res["dense"], expected)
        assert torch.equal(res["strided"], expected)


def _uneven_exchange_worker(rank: int, world_size: int, port: int) -> dict:
    config = backend_config(world_size, "gloo")
    init_process_groups(replace(config, timeout_s=3.0), rank, MASTER_ADDR, port)
    try:
        all_to_all_equal(torch.zeros(3, 2))  # 3 rows: no equal block for each of 2 ranks
    except Exception as error:
        return {"type": type(error).__name__, "error": str(error)}
    finally:
        destroy_process_groups()
    return {"type": None}


def test_an_exchange_of_unequal_blocks_is_an_argument_error(tmp_path):
    """x's rows must split into one equal block per rank. torch refuses them with a
    RuntimeError raised before anything is sent, which collective_guard reported as a failed
    collective (CollectiveError), a peer's fault to the driver. It is this rank's argument: a
    ValueError naming the rank and the shape."""
    results = run_ranks(_uneven_exchange_worker, 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["type"] == "ValueError", result
        assert result["error"].startswith(f"rank {rank}: all_to_all_equal needs"), result
        assert "(3, 2)" in result["error"], result
