"""Expert parallelism on random model shapes (tests/test_random_shapes.py's seeded draws): EP=2
or 3 with as many redundant experts gives EP=1's bits, on expert counts the fixed configs do
not take (9, 6 or 4 routed experts, 3 or 4 slots a rank). Control: multiple reduction at the
same layout differs; engagement: rows crossed ranks and the redundant replicas served rows.
A private Ray cluster (conftest's ray_local), gloo between single-CPU actors.
"""

from __future__ import annotations

import pytest

from moe_runtime import LLM
from tests.invariance import (
    TINY_CONFIG,
    mixed_params,
    mixed_prompts,
    replica_rows,
    run_in_batches,
)
from tests.test_random_shapes import draw_shape

ray = pytest.importorskip("ray")
# Draws whose expert counts split over 2 or 3 ranks with redundant experts (9, 4 + 2 and 6),
# each of top-3: the control needs three outputs a token (two sum to the same bits whether a
# rank adds them first or not).
EP_DRAW_SEEDS = (0, 2, 3)


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_local):
    yield


def _layout(shape: dict) -> tuple[int, int]:
    """(world size, redundant experts): 3 and 3 where they divide the slots, else 2 and 2."""
    experts = shape["model.n_routed_experts"]
    return (3, 3) if (experts + 3) % 3 == 0 else (2, 2)


def _run(shape: dict, prompts, params, **overrides) -> tuple[dict, list[dict]]:
    llm = LLM(TINY_CONFIG, **{**shape, "parallel.timeout_s": 60, **overrides})
    try:
        got = run_in_batches(llm, prompts, params, [list(range(len(prompts)))])
        stats = llm.engine.worker_stats() if overrides else []
    finally:
        llm.shutdown()
    return got, stats


@pytest.mark.parametrize("seed", EP_DRAW_SEEDS)
def test_random_shape_ep_layouts_give_ep1_bits(seed):
    shape = draw_shape(seed)
    assert shape["model.num_experts_per_tok"] >= 3  # what the control needs
    world, redundant = _layout(shape)
    prompts, params = mixed_prompts(10, 4, 40, seed=seed), mixed_params(10, 6)
    reference, _ = _run(shape, prompts, params)
    layout = {"parallel.world_size": world, "eplb.num_redundant_experts": redundant}
    got, stats = _run(shape, prompts, params, **layout)
    assert sum(s["num_rows_sent_remote"] for s in stats) > 0, "no row crossed ranks"
    experts = shape["model.n_routed_experts"]
    replica_load = replica_rows(stats, experts, (experts + redundant) // world)
    assert replica_load > 0, "the redundant replicas served no rows"
    assert got == reference, f"EP={world} with {redundant} redundant differs: {shape}"
    control, stats = _run(shape, prompts, params, **layout, **{
        "parallel.allow_multiple_reduction": True,
    })  # fmt: skip
    assert sum(s["num_rows_sent_remote"] for s in stats) > 0
    assert control != reference, "multiple reduction gave EP=1's bits: the test could not fail"
