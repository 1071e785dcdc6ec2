"""Router top-k: transformers parity, exact tie-breaks, bitwise row invariance, fast control."""

from functools import partial

import pytest
import torch

from moe_kernels import router
from moe_kernels.router import router_topk_fast, router_topk_ref
from tests.test_kernels_shapes import spy_input_shapes

V2_GREEDY = dict(
    top_k=3,
    num_groups=1,
    topk_group=1,
    scoring_func="softmax",
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
)
V2_GROUPED = dict(
    top_k=4,
    num_groups=4,
    topk_group=2,
    scoring_func="softmax",
    topk_method="group_limited_greedy",
    norm_topk_prob=False,
    routed_scaling_factor=16.0,
)
V3_NOAUX = dict(
    top_k=4,
    num_groups=4,
    topk_group=2,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
METHODS = {"greedy": V2_GREEDY, "group_limited_greedy": V2_GROUPED, "noaux_tc": V3_NOAUX}
NUM_EXPERTS = 24
TILE_SIZES = (4, 16)


def _bias(params, generator):
    if params["topk_method"] != "noaux_tc":
        return None
    return torch.rand(NUM_EXPERTS, generator=generator) * 0.1


def _prefix_sizes(tile_rows):
    return sorted({1, 2, 3, 7, tile_rows - 1, tile_rows, tile_rows + 1, 2 * tile_rows + 3} - {0})


@pytest.mark.parametrize("method", METHODS)
def test_router_ref_matches_fast(generator, method):
    params = METHODS[method]
    logits = torch.randn(50, NUM_EXPERTS, generator=generator)
    bias = _bias(params, generator)
    ids, weights = router_topk_ref(logits, bias, **params, tile_rows=4)
    fast_ids, fast_weights = router_topk_fast(logits, bias, **params)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, fast_ids)
    torch.testing.assert_close(weights, fast_weights, atol=1e-6, rtol=1e-6)  # sigmoid ulps


def _hf_router(method, params, bias):
    """transformers' own router with an identity gate, so its logits are our logits."""
    if method == "noaux_tc":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        config_cls, router_cls = hf.DeepseekV3Config, hf.DeepseekV3TopkRouter
    else:
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf

        config_cls, router_cls = hf.DeepseekV2Config, hf.DeepseekV2TopkRouter
    config = config_cls(
        hidden_size=NUM_EXPERTS,
        num_attention_heads=1,
        num_key_value_heads=1,
        n_routed_experts=NUM_EXPERTS,
        num_experts_per_tok=params["top_k"],
        n_group=params["num_groups"],
        topk_group=params["topk_group"],
        norm_topk_prob=params["norm_topk_prob"],
        routed_scaling_factor=params["routed_scaling_factor"],
        topk_method=method,
    )
    router = router_cls(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(NUM_EXPERTS))
        if bias is not None:
            router.e_score_correction_bias.copy_(bias)
    return router


@pytest.mark.parametrize("method", METHODS)
def test_router_ref_matches_transformers(generator, method):
    pytest.importorskip("transformers")
    params = METHODS[method]
    logits = torch.randn(20, NUM_EXPERTS, generator=generator)
    bias = _bias(params, generator)
    with torch.no_grad():
        _, hf_weights, hf_ids = _hf_router(method, params, bias)(logits)
    ids, weights = router_topk_ref(logits, bias, **params, tile_rows=4)
    # transformers returns unsorted slots: compare per token after sorting by expert id.
    hf_ids, order = hf_ids.sort(-1)
    ids, our_order = ids.sort(-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(
        weights.gather(1, our_order), hf_weights.gather(1, order), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("method", METHODS)
def test_router_ref_ties_go_to_lower_ids(method):
    params = METHODS[method]
    bias = None if method != "noaux_tc" else torch.zeros(NUM_EXPERTS)
    all_equal = torch.zeros(3, NUM_EXPERTS)
    ids, _ = router_topk_ref(all_equal, bias, **params, tile_rows=4)
    assert ids.tolist() == [list(range(params["top_k"]))] * 3
    # Groups 1 and 3 (6 experts each) hold identical logits, a 3-way tie at the top of each;
    # group 1 must win the group tie and ids 7, 9, 10 the expert tie.
    pattern = torch.tensor([0.5, 2.0, 1.0, 2.0, 2.0, -1.0])
    logits = torch.full((1, NUM_EXPERTS), -3.0)
    logits[0, 6:12] = logits[0, 18:24] = pattern
    ids, weights = router_topk_ref(logits, bias, **params, tile_rows=4)
    expected = {
        "greedy": [7, 9, 10],
        "group_limited_greedy": [7, 9, 10, 19],
        "noaux_tc": [7, 9, 10, 19],
    }[method]
    assert ids[0].tolist() == expected
    assert torch.equal(weights[0, :3], weights[0, :1].expand(3))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tile_rows", TILE_SIZES)
def test_router_ref_rows_bitwise_invariant(generator, monkeypatch, method, tile_rows):
    """Bitwise in every prefix, permuted, and behind other rows; engaged: the routing ran on
    whole [tile_rows, E] tiles only (plain torch's routing is invariant at these shapes on
    this CPU but for sigmoid, whose control is below, so this is what catches a reference that
    stopped tiling)."""
    tiles = spy_input_shapes(monkeypatch, router, "_route")
    params = METHODS[method]
    logits = torch.randn(40, NUM_EXPERTS, generator=generator)
    bias = _bias(params, generator)

    def route(x):
        return router_topk_ref(x, bias, **params, tile_rows=tile_rows)

    full_ids, full_weights = route(logits)
    for m in _prefix_sizes(tile_rows):
        ids, weights = route(logits[:m])
        assert torch.equal(ids, full_ids[:m]) and torch.equal(weights, full_weights[:m]), m
    perm = torch.randperm(40, generator=generator)
    ids, weights = route(logits[perm])
    assert torch.equal(ids, full_ids[perm]) and torch.equal(weights, full_weights[perm])
    mixed_ids, mixed_weights = route(torch.cat([logits[9:10], logits[:3] * 2]))
    assert torch.equal(mixed_ids[0], full_ids[9]) and torch.equal(mixed_weights[0], full_weights[9])
    assert set(tiles) == {(tile_rows, NUM_EXPERTS)}, sorted(set(tiles))


def test_router_sigmoid_fast_not_invariant_ref_is(generator):
    # Negative control, tiny-model shape (8 experts): torch.sigmoid rounds a lone [1, 8] row
    # in its scalar tail loop but a [64, 8] batch in its vector loop, so weights differ.
    params = dict(V3_NOAUX, num_groups=2, topk_group=1, top_k=2)
    logits = torch.randn(64, 8, generator=generator)
    bias = torch.zeros(8)
    _, batched = router_topk_fast(logits, bias, **params)
    alone = torch.cat([router_topk_fast(logits[i : i + 1], bias, **params)[1] for i in range(64)])
    assert not torch.equal(alone, batched)
    _, batched = router_topk_ref(logits, bias, **params, tile_rows=4)
    alone = torch.cat(
        [router_topk_ref(row[None], bias, **params, tile_rows=4)[1] for row in logits]
    )
    assert torch.equal(alone, batched)


def test_router_rejects_bad_groups():
    with pytest.raises(ValueError, match="num_groups"):
        router_topk_ref(torch.zeros(2, 10), None, **dict(V2_GROUPED, num_groups=4), tile_rows=4)


@pytest.mark.parametrize("method", METHODS)
def test_id_map_appends_the_mapped_ids_and_changes_nothing_else(generator, method):
    """With an id map (the MoE's logical -> physical slot row, with replicas) both versions add
    id_map[topk_ids] as a third output; ids and weights keep their bits."""
    params = METHODS[method]
    logits = torch.randn(50, NUM_EXPERTS, generator=generator)
    bias = _bias(params, generator)
    id_map = torch.randperm(NUM_EXPERTS + 8, generator=generator)[:NUM_EXPERTS]
    for route in (partial(router_topk_ref, tile_rows=4), router_topk_fast):
        ids, weights = route(logits, bias, **params)
        mapped_ids, mapped_weights, slot_ids = route(logits, bias, **params, id_map=id_map)
        assert torch.equal(mapped_ids, ids) and torch.equal(mapped_weights, weights)
        assert slot_ids.dtype == torch.int64 and torch.equal(slot_ids, id_map[ids])
