"""The engine at EP=2 with the fixed-capacity exchange (parallel.ep_capacity_dispatch) on CPU.

CPU has no CUDA graphs, so the switch forces FixedCapacityDispatcher on over gloo; its MoE
layers then run eagerly, the ranks agreeing on each call's block size. Generation must be
bitwise the default dispatcher's at EP=2 and world size 1's, with the same rows crossing ranks
(engagement: the worker reports which dispatcher ran); control: with fast kernels the EP=2 run
differs from world size 1. The key's values and refusals are checked without Ray.
"""

from __future__ import annotations

import pytest

from moe_runtime import LLM
from moe_runtime.config import load_config
from tests.invariance import TINY_CONFIG, fingerprint, mixed_params, mixed_prompts

EP2 = {"parallel.world_size": 2, "parallel.timeout_s": 60}


@pytest.fixture(scope="module")
def _ray(ray_head):
    pytest.importorskip("ray")
    import ray

    ray.init(address=ray_head.gcs_address, log_to_driver=False)
    yield
    ray.shutdown()


def _generate(num_prompts: int, **overrides) -> tuple[list[tuple], list[dict]]:
    # Uneven lengths: the ranks' token counts differ in most steps (prefill and decode).
    prompts, params = mixed_prompts(5, 8, 60, seed=31), mixed_params(5, 12)
    prompts, params = prompts[:num_prompts], params[:num_prompts]
    llm = LLM(TINY_CONFIG, **overrides)
    try:
        got = [fingerprint(o) for o in llm.generate(prompts, params)]
        stats = llm.engine.worker_stats()
    finally:
        llm.shutdown()
    return got, stats


@pytest.mark.usefixtures("_ray")
@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_ep2_capacity_dispatch_bitwise_equal_to_default(mode):
    kernels = {"kernels.mode": mode}
    # The fast control differs because EP=2 is DP=2: each rank's batch holds some of the
    # prompts, and fast kernels' bits follow the batch (with one prompt, fast EP=2 gives world
    # size 1's bits). The two dispatchers agree in fast mode too: both combine in slot order.
    single, _ = _generate(5, **kernels)
    default, default_stats = _generate(5, **EP2, **kernels)
    on = {"parallel.ep_capacity_dispatch": "on"}
    capacity, stats = _generate(5, **EP2, **kernels, **on)
    assert [s["ep_dispatcher"] for s in default_stats] == ["AllToAllDispatcher"] * 2
    assert [s["ep_dispatcher"] for s in stats] == ["FixedCapacityDispatcher"] * 2
    # The same rows crossed ranks (counted on the device by the capacity path).
    sent = [s["num_rows_sent_remote"] for s in stats]
    assert sent == [s["num_rows_sent_remote"] for s in default_stats] and min(sent) > 0
    assert capacity == default, f"{mode}: the capacity exchange changed bits"
    if mode == "invariant":
        assert capacity == single
    else:
        assert capacity != single, "fast EP=2 matched world size 1: no control"


def test_capacity_dispatch_key_resolves_and_refuses():
    def resolved(**overrides) -> bool:
        return load_config(TINY_CONFIG, overrides).uses_capacity_dispatch

    assert not resolved(**EP2)  # auto: no graphs on CPU
    assert resolved(**EP2, **{"parallel.ep_capacity_dispatch": "on"})
    assert resolved(**EP2, **{"parallel.ep_capacity_dispatch": True})  # YAML's bare `on`
    assert not resolved(**EP2, **{"parallel.ep_capacity_dispatch": "off"})
    assert not resolved(**{"parallel.ep_capacity_dispatch": "on"})  # one rank: no exchange
    nccl = {**EP2, "parallel.device": "cuda", "parallel.backend": "nccl"}
    assert not resolved(**nccl)  # graphs stay off by default over NCCL
    assert resolved(**nccl, **{"kernels.cuda_graphs": True})
    mixed = {**nccl, "kernels.cuda_graphs": True, "parallel.allow_multiple_reduction": True}
    assert not resolved(**mixed)  # auto keeps the pre-reducing AllToAllDispatcher
    with pytest.raises(ValueError, match=r"parallel.ep_capacity_dispatch must be one of .*'maybe'"):
        load_config(TINY_CONFIG, {"parallel.ep_capacity_dispatch": "maybe"})
    with pytest.raises(ValueError, match="allow_multiple_reduction"):
        load_config(TINY_CONFIG, {**mixed, "parallel.ep_capacity_dispatch": "on"})
    gloo_graphs = {**nccl, "parallel.backend": "gloo", "kernels.cuda_graphs": True}
    with pytest.raises(ValueError, match="needs the nccl backend"):
        load_config(TINY_CONFIG, {**gloo_graphs, "parallel.ep_capacity_dispatch": "on"})
