"""Config loading: shipped YAML files, overrides in every accepted spelling."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from moe_runtime.config import RuntimeConfig, load_config
from moe_runtime.llm import _flatten_overrides

CONFIGS = Path(__file__).resolve().parent.parent / "launch" / "configs"


@pytest.mark.parametrize("name", ["tiny_cpu.yaml", "v2_lite_gpu.yaml"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / name)
    assert isinstance(config, RuntimeConfig)
    assert config.parallel.world_size >= 1 and config.kernels.mode == "invariant"


def test_v2_lite_shape():
    model = load_config(CONFIGS / "v2_lite_gpu.yaml").model
    assert (model.hidden_size, model.num_hidden_layers, model.n_routed_experts) == (2048, 27, 64)
    assert (model.num_experts_per_tok, model.n_shared_experts, model.kv_lora_rank) == (6, 2, 512)


def test_overrides_win_and_parse_yaml_scalars():
    config = load_config(
        CONFIGS / "tiny_cpu.yaml", {"kernels.mode": "fast", "cache.num_blocks": "64"}
    )
    assert config.kernels.mode == "fast" and config.cache.num_blocks == 64


def test_override_spellings_agree():
    assert _flatten_overrides({"kernels": {"mode": "fast"}}) == {"kernels.mode": "fast"}
    assert _flatten_overrides({"kernels__mode": "fast"}) == {"kernels.mode": "fast"}
    assert _flatten_overrides({"kernels.mode": "fast"}) == {"kernels.mode": "fast"}


def test_override_needs_section_and_key():
    with pytest.raises(ValueError, match="section.key"):
        load_config(CONFIGS / "tiny_cpu.yaml", {"mode": "fast"})


def test_configs_are_frozen():
    config = load_config(CONFIGS / "tiny_cpu.yaml")
    with pytest.raises(AttributeError):
        config.kernels.mode = "fast"  # type: ignore[misc]


@pytest.mark.parametrize(
    "key, value",
    [
        ("cache.num_blocks", -1),
        ("cache.gpu_memory_utilization", 0),
        ("cache.gpu_memory_utilization", 1.5),
    ],
)
def test_cache_sizing_keys_validated(key, value):
    with pytest.raises(ValueError, match=key):
        load_config(CONFIGS / "tiny_cpu.yaml", {key: value})


def test_kv_cache_sized_from_memory_needs_cuda():
    from moe_runtime.worker.worker import kv_cache_blocks

    config = load_config(CONFIGS / "tiny_cpu.yaml", {"cache.num_blocks": 0})
    assert config.cache.is_sized_from_memory
    with pytest.raises(ValueError, match="cache.num_blocks.*cpu"):
        kv_cache_blocks(config, torch.device("cpu"))
    assert kv_cache_blocks(load_config(CONFIGS / "tiny_cpu.yaml"), torch.device("cpu")) == 512


def test_cuda_graph_keys_default_off_and_parse():
    assert load_config(CONFIGS / "tiny_cpu.yaml").kernels.cuda_graphs is False
    config = load_config(
        CONFIGS / "tiny_gpu.yaml",
        {"kernels.cuda_graphs": True, "kernels.cuda_graph_batch_sizes": "[1, 4, 16]"},
    )
    assert config.kernels.cuda_graphs is True
    assert config.kernels.cuda_graph_batch_sizes == (1, 4, 16)  # YAML's list, kept as a tuple


@pytest.mark.parametrize(
    "key, value",
    [
        ("kernels.cuda_graphs", "yes please"),
        ("kernels.cuda_graphs", 1),
        ("kernels.cuda_graph_batch_sizes", "[]"),
        ("kernels.cuda_graph_batch_sizes", "[4, 2]"),
        ("kernels.cuda_graph_batch_sizes", "[1, 1]"),
        ("kernels.cuda_graph_batch_sizes", "[0, 8]"),
        ("kernels.cuda_graph_batch_sizes", "[1, true]"),
        ("kernels.cuda_graph_batch_sizes", 8),
    ],
)
def test_cuda_graph_keys_validated(key, value):
    with pytest.raises(ValueError, match=key):
        load_config(CONFIGS / "tiny_gpu.yaml", {key: value})


@pytest.mark.parametrize(
    "overrides, needs",
    [
        ({}, "parallel.device 'cuda', got 'cpu'"),  # tiny_cpu runs on the CPU
        ({"kernels.mode": "fast", "parallel.device": "cuda"}, "kernels.mode 'invariant'"),
        (
            {"parallel.device": "cuda", "parallel.world_size": 2, "parallel.tp_size": 2},
            "parallel.tp_size 1",
        ),
    ],
)
def test_cuda_graphs_refused_where_they_cannot_run(overrides, needs):
    with pytest.raises(ValueError, match=f"kernels.cuda_graphs.*{needs}"):
        load_config(CONFIGS / "tiny_cpu.yaml", {"kernels.cuda_graphs": True, **overrides})


def test_cpu_runner_stays_eager_with_its_cache_unchanged():
    from moe_runtime import LLM

    llm = LLM(CONFIGS / "tiny_cpu.yaml")
    try:
        runner = llm.engine.executor.worker.runner
        assert runner.graphs is None  # no scratch block either: the cache is cache.num_blocks
        assert runner.kv_caches[0].shape[0] == runner.num_blocks == llm.engine.num_kv_blocks
    finally:
        llm.shutdown()


def test_v2_lite_linear_shapes():
    shapes = load_config(CONFIGS / "v2_lite_gpu.yaml").model.linear_shapes()
    assert shapes == [
        ("q_proj", 2048, 3072),
        ("kv_a", 2048, 576),
        ("kv_b", 512, 4096),
        ("o_proj", 2048, 2048),
        ("mlp_gate_up", 2048, 2 * 10944),
        ("mlp_down", 10944, 2048),
        ("expert_gate_up", 2048, 2 * 1408),
        ("expert_down", 1408, 2048),
        ("lm_head", 2048, 102400),
    ]


@pytest.mark.parametrize(
    "overrides, warns",
    [
        ({}, False),
        ({"parallel.allow_multiple_reduction": True}, True),
        ({"parallel.allow_multiple_reduction": True, "kernels.mode": "fast"}, False),
    ],
    ids=["defaults", "invariant-multiple-reduction", "fast-multiple-reduction"],
)
def test_multiple_reduction_with_invariant_kernels_warns(caplog, overrides, warns):
    with caplog.at_level(logging.WARNING, logger="moe_runtime.config"):
        load_config(CONFIGS / "tiny_cpu.yaml", overrides)
    messages = [r.getMessage() for r in caplog.records if r.name == "moe_runtime.config"]
    if warns:
        assert len(messages) == 1
        assert "parallel.allow_multiple_reduction" in messages[0]
        assert "expert-placement and rebalance invariance" in messages[0]
    else:
        assert messages == []


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({"parallel.world_size": 3}, ["parallel.world_size=3", "valid world sizes: [1, 2, 4, 8"]),
        (
            {"parallel.world_size": 4, "eplb.num_redundant_experts": 2},
            ["eplb.num_redundant_experts = 18", "valid world sizes: [1, 2, 3, 6, 9, 18]"],
        ),
        (
            {"parallel.world_size": 4, "parallel.tp_size": 4, "model.num_attention_heads": 6},
            ["parallel.tp_size=4", "model.num_attention_heads = 6", "valid tp sizes", "[1, 2]"],
        ),
        ({"parallel.world_size": 4, "eplb.num_nodes": 3}, ["eplb.num_nodes=3", "[1, 2, 4]"]),
        (
            {"parallel.world_size": 2, "parallel.tp_size": 2, "model.tie_word_embeddings": True},
            ["model.tie_word_embeddings"],
        ),
    ],
    ids=["experts", "redundant", "tp-heads", "nodes", "tied-embeddings"],
)
def test_layout_constraints_fail_at_load_naming_the_keys(overrides, names):
    """Checked when the config loads, before any worker starts (no Ray here)."""
    with pytest.raises(ValueError) as failure:
        load_config(CONFIGS / "tiny_cpu.yaml", overrides)
    for name in names:
        assert name in str(failure.value)
