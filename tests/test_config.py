"""Config loading: shipped YAML files, overrides in every accepted spelling."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch

from launch import cli
from moe_runtime.config import RuntimeConfig, load_config
from moe_runtime.llm import _flatten_overrides
from moe_runtime.model_config import ModelConfig

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


def test_exponent_floats_without_a_dot_read_as_floats(tmp_path):
    """YAML 1.1 reads `1e-6` as text (it wants `1.0e-6`): a file's and an override's both load."""
    path = tmp_path / "config.yaml"
    path.write_text(
        (CONFIGS / "tiny_cpu.yaml")
        .read_text(encoding="utf-8")
        .replace("  seed: 0\n", "  seed: 0\n  rms_norm_eps: 1e-5\n"),
        encoding="utf-8",
    )
    config = load_config(path, {"model.routed_scaling_factor": "25E-1"})
    assert config.model.rms_norm_eps == 1e-5 and config.model.routed_scaling_factor == 2.5
    for text, value in [("2.5e2", 250.0), (".5e1", 5.0), ("6.02E2", 602.0), ("1.0e1", 10.0)]:
        assert load_config(path, {"model.init_std": text}).model.init_std == value, text
    assert load_config(path, {"server.api_key": "'1e5'"}).server.api_key == "1e5"


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda text: text + "scheduler:\n  max_num_seqs: 4\n", r"key 'scheduler' .*line 40"),
        (lambda text: text.replace("  seed: 0\n", "  seed: 0\n  seed: 1\n"), r"key 'seed'"),
        (
            lambda text: text.replace(
                "eplb:\n  enabled: false", "eplb: {enabled: false, enabled: 1}"
            ),
            r"key 'enabled'",
        ),
    ],
    ids=["section", "key", "flow"],
)
def test_a_key_given_twice_is_refused_naming_it(tmp_path, edit, named):
    """PyYAML keeps a repeated key's last value: a second `scheduler:` section appended to a
    config dropped every key of the first (max_model_len, max_num_batched_tokens ...) silently.
    A `<<:` merge's keys may still be overridden."""
    path = tmp_path / "config.yaml"
    path.write_text(edit((CONFIGS / "tiny_cpu.yaml").read_text(encoding="utf-8")), "utf-8")
    with pytest.raises(ValueError, match=rf"config\.yaml' is not valid YAML: {named}"):
        load_config(path)
    merged = "base: &base {block_size: 16, num_blocks: 64}\ncache:\n  <<: *base\n  num_blocks: 8\n"
    path.write_text(merged, encoding="utf-8")
    with pytest.raises(ValueError, match="unknown config section 'base'"):  # it parsed
        load_config(path)


def test_a_config_path_names_what_is_wrong_with_it_and_a_pipe_is_read(tmp_path):
    """A directory was 'does not exist', and so was a pipe (bash's `--config <(...)`), which is
    now read."""
    with pytest.raises(ValueError, match=r"is a directory; name a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ValueError, match=r"absent\.yaml' does not exist"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ValueError, match=r"'/dev/zero' holds more than 16777216 bytes"):
        load_config("/dev/zero")  # it was read until the memory ran out
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as f:
        f.write("cache:\n  num_blocks: 8\n")
    try:
        assert load_config(f"/dev/fd/{read_end}").cache.num_blocks == 8
    finally:
        os.close(read_end)


def test_override_without_equals_is_a_usage_error():
    parser = argparse.ArgumentParser(prog="serve_ep")
    cli.add_override_argument(parser)
    assert parser.parse_args(["--set", "a.b=c=d"]).set == ["a.b=c=d"]
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--set", "kernels.mode"])
    assert exit_info.value.code == 2


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
        ("scheduler.admission_reserve", -1),
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


def test_a_cache_sized_from_free_memory_leaves_the_largest_steps_logits(monkeypatch):
    """The cache took gpu_memory_utilization of all the free memory: a scoring step of
    max_num_batched_tokens rows needs their fp32 logits (rows x vocabulary x 4 bytes) beside
    it, and ran out of memory on an H100 at V2-Lite's shape. Now they come off first; a
    device whose free memory they exceed is refused naming both keys."""
    from moe_runtime.worker import worker

    overrides = {"cache.num_blocks": 0, "scheduler.max_num_batched_tokens": 256}
    config = load_config(CONFIGS / "tiny_cpu.yaml", overrides)
    model = config.model
    logits = 256 * model.vocab_size * 4
    block = model.num_hidden_layers * config.cache.block_size * model.latent_dim * 4  # fp32
    free = {"bytes": logits + 1000 * block}
    monkeypatch.setattr(worker.torch.cuda, "mem_get_info", lambda device: (free["bytes"], 0))
    utilization = config.cache.gpu_memory_utilization
    assert worker.kv_cache_blocks(config, torch.device("cuda")) == int(1000 * utilization)
    free["bytes"] = logits
    with pytest.raises(ValueError, match="max_num_batched_tokens 256 x model.vocab_size"):
        worker.kv_cache_blocks(config, torch.device("cuda"))


def test_cuda_graphs_default_on_where_they_run_and_keys_parse():
    assert load_config(CONFIGS / "tiny_cpu.yaml").kernels.cuda_graphs is False
    assert load_config(CONFIGS / "tiny_gpu.yaml").kernels.cuda_graphs is True
    tp2 = {"parallel.world_size": 2, "parallel.tp_size": 2}
    assert load_config(CONFIGS / "tiny_gpu.yaml", tp2).kernels.cuda_graphs is False
    ep2 = {"parallel.world_size": 2}  # NCCL between the ranks: off until tested there
    assert load_config(CONFIGS / "tiny_gpu.yaml", ep2).kernels.cuda_graphs is False
    gloo = {**ep2, "parallel.backend": "gloo"}
    assert load_config(CONFIGS / "tiny_gpu.yaml", gloo).kernels.cuda_graphs is True
    nccl_on = {**ep2, "kernels.cuda_graphs": True}
    assert load_config(CONFIGS / "tiny_gpu.yaml", nccl_on).kernels.cuda_graphs is True
    fast = load_config(CONFIGS / "tiny_gpu.yaml", {"kernels.mode": "fast"})
    assert fast.kernels.cuda_graphs is True  # fast mode graphs too: the fair baseline
    config = load_config(
        CONFIGS / "tiny_gpu.yaml",
        {"kernels.cuda_graphs": True, "kernels.cuda_graph_batch_sizes": "[1, 4, 16]"},
    )
    assert config.kernels.cuda_graphs is True
    assert config.kernels.cuda_graph_batch_sizes == (1, 4, 16)  # YAML's list, kept as a tuple


@pytest.mark.parametrize(
    "max_num_seqs, sizes",
    [(1, (1,)), (64, (1, 2, 4, 8, 16, 32, 64)), (200, (1, 2, 4, 8, 16, 32, 64, 128, 256))],
)
def test_graph_batch_sizes_follow_the_scheduler_unless_set(max_num_seqs, sizes):
    """Unset, the graph sizes are the powers of two up to the first at or past the scheduler's
    batch, so every decode batch it forms has a graph (before, the fixed list stopped at 128:
    a user raising max_num_seqs to 256 decoded eagerly there, ~3x slower on the H200); set,
    they are kept as given."""
    path = CONFIGS / "tiny_gpu.yaml"
    config = load_config(path, {"scheduler.max_num_seqs": max_num_seqs})
    assert config.kernels.cuda_graph_batch_sizes == sizes
    assert max(sizes) >= max_num_seqs
    given = {"scheduler.max_num_seqs": max_num_seqs, "kernels.cuda_graph_batch_sizes": "[1, 8]"}
    assert load_config(path, given).kernels.cuda_graph_batch_sizes == (1, 8)


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
            {"parallel.world_size": 2, "eplb.num_redundant_experts": 2**62},
            ["eplb.num_redundant_experts=4611686018427387904 is more than 16", "world_size=2"],
        ),
        (
            {"parallel.world_size": 4, "parallel.tp_size": 4, "model.num_attention_heads": 6},
            ["parallel.tp_size=4", "model.num_attention_heads = 6", "valid tp sizes", "[1, 2]"],
        ),
        ({"parallel.world_size": 4, "eplb.num_nodes": 3}, ["eplb.num_nodes=3", "[1, 2, 4]"]),
        (
            {
                "parallel.world_size": 4,
                "eplb.num_nodes": 2,
                "eplb.policy": "hierarchical",
                "eplb.num_redundant_experts": 20,
            },
            ["each rank's 9 slots", "the 8 experts of a node", "at most 16 redundant experts"],
        ),
        (
            {"parallel.world_size": 2, "parallel.tp_size": 2, "model.tie_word_embeddings": True},
            ["model.tie_word_embeddings"],
        ),
    ],
    ids=[
        "experts",
        "redundant",
        "unusable-replicas",
        "tp-heads",
        "nodes",
        "hierarchical-crowded",
        "tied-embeddings",
    ],
)
def test_layout_constraints_fail_at_load_naming_the_keys(overrides, names):
    """Checked when the config loads, before any worker starts (no Ray here)."""
    with pytest.raises(ValueError) as failure:
        load_config(CONFIGS / "tiny_cpu.yaml", overrides)
    for name in names:
        assert name in str(failure.value)


def _hf_config(tmp_path, family: str, **fields) -> ModelConfig:
    from tests.checkpoints import TINY_HF

    model_type = {"v2": "deepseek_v2", "v3": "deepseek_v3"}[family]
    base = {**TINY_HF, "q_lora_rank": None, "routed_scaling_factor": 1.0}
    (tmp_path / "config.json").write_text(json.dumps({**base, "model_type": model_type, **fields}))
    return ModelConfig.from_dict({"path": str(tmp_path)})


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize(
    "family, key, value, named",
    [
        ("v3", "hidden_act", "gelu", None),
        ("v3", "attention_bias", True, None),
        ("v2", "mlp_bias", True, None),
        ("v3", "pretraining_tp", 2, None),
        ("v2", "moe_layer_freq", 2, None),
        ("v3", "quantization_config", {"quant_method": "fp8"}, None),
        ("v3", "num_key_value_heads", 2, None),
        ("v3", "head_dim", 16, None),
        ("v2", "qk_head_dim", 32, None),
        ("v3", "use_mla", False, None),
        ("v3", "scoring_func", "softmax", None),
        ("v2", "scoring_func", "sigmoid", None),
        ("v3", "topk_method", "greedy", None),
        ("v2", "topk_method", "noaux_tc", None),
        ("v2", "rope_interleave", False, None),
        ("v3", "eos_token_id", [1, None], None),
        (
            "v3",
            "rope_scaling",
            {"type": "linear", "factor": 2.0},
            ("rope_scaling.rope_type", "linear"),
        ),
        (
            "v2",
            "rope_parameters",
            {**YARN, "partial_rotary_factor": 0.5},
            ("rope_parameters.partial_rotary_factor", 0.5),
        ),
        (
            "v3",
            "rope_parameters",
            {"rope_type": "yarn", "original_max_position_embeddings": 128},
            ("rope_parameters.factor", None),
        ),
    ],
)
def test_unimplemented_hf_fields_are_refused_by_name(tmp_path, family, key, value, named):
    name, shown = named or (key, value)
    with pytest.raises(ValueError) as err:
        _hf_config(tmp_path, family, **{key: value})
    assert f"config.json field {name}={shown!r}" in str(err.value)


def test_hf_fields_without_numeric_effect_load(tmp_path):
    cfg = _hf_config(
        tmp_path,
        "v3",
        architectures=["DeepseekV3ForCausalLM"],
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
        torch_dtype="bfloat16",
        aux_loss_alpha=0.001,
        seq_aux=True,
        ep_size=8,
        num_nextn_predict_layers=1,
        attention_dropout=0.1,
        use_cache=True,
        pad_token_id=None,
        hidden_act="silu",
        moe_layer_freq=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32},
        eos_token_id=[257],
    )
    assert cfg.rope_scaling["factor"] == 4.0 and cfg.eos_token_id == 257


@pytest.mark.parametrize(
    ("generation_eos", "eos_token_ids"),
    [(None, (257,)), (300, (257, 300)), ([257, 300, 301], (257, 300, 301)), ([], (257,))],
)
def test_generation_configs_eos_ids_are_read(tmp_path, generation_eos, eos_token_ids):
    """generation_config.json's eos_token_id (an int or a list) ends a sample too."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert _hf_config(tmp_path, "v3").eos_token_ids == eos_token_ids


@pytest.mark.parametrize(
    ("generation", "eos_token_ids"),
    [
        (None, (1, 2, 257)),
        ({}, (1,)),
        ({"eos_token_id": 300}, (1, 300)),
        ({"eos_token_id": []}, (1,)),
    ],
)
def test_a_list_of_eos_ids_in_config_json_ends_a_sample_on_each(
    tmp_path, generation, eos_token_ids
):
    """config.json's eos_token_id as a list of several ids (refused before: one id only): the
    first is eos_token_id, and every one ends a sample where there is no generation_config.json
    (None), as transformers' GenerationConfig.from_model_config copies the list; where there is
    one, its ids (and config.json's first) end a sample."""
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    cfg = _hf_config(tmp_path, "v3", eos_token_id=[1, 2, 257])
    assert cfg.eos_token_id == 1 and cfg.eos_token_ids == eos_token_ids


@pytest.mark.parametrize(
    ("key", "value", "outside"),
    [
        ("bos_token_id", 512, 512),
        ("bos_token_id", -1, -1),
        ("eos_token_id", 600, 600),
        ("eos_token_id", [1, 600], 600),  # a later id of the list: generation_eos_token_ids
    ],
)
def test_a_bos_or_eos_id_past_the_vocabulary_is_refused_naming_config_json(
    tmp_path, key, value, outside
):
    """An id outside [0, vocab_size) in config.json was refused as model.<key> (a key the
    YAML does not hold; a list's later id as model.generation_eos_token_ids): the refusal
    names the file, the key and its value, as every other config.json field's does."""
    with pytest.raises(ValueError) as err:
        _hf_config(tmp_path, "v3", **{key: value})
    expected = f"config.json field {key}={value!r} is refused: id {outside} is outside "
    assert expected + "[0, vocab_size=512)" in str(err.value)


@pytest.mark.parametrize("has_generation_config", [False, True])
def test_config_json_is_read_once_at_load(tmp_path, monkeypatch, has_generation_config):
    """ModelConfig.from_dict read config.json twice where there was no generation_config.json
    (once for the fields, once more for its eos_token_id list): one read now feeds both."""
    from moe_runtime.model import hf_config

    if has_generation_config:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 300}))
    files = []
    read = hf_config.read_json_object
    monkeypatch.setattr(hf_config, "read_json_object", lambda f: files.append(f.name) or read(f))
    cfg = _hf_config(tmp_path, "v3", eos_token_id=[1, 2, 257])
    assert files.count("config.json") == 1, files
    assert cfg.eos_token_ids == ((1, 300) if has_generation_config else (1, 2, 257))


@pytest.mark.parametrize(
    ("generation_eos", "problem"),
    [
        ("7", "generation_config.json: eos_token_id must be an int, a list of ints or null"),
        (
            [1, 512],
            "generation_config.json: eos_token_id=[1, 512] is refused: id 512 is outside "
            "[0, vocab_size=512) of config.json",
        ),
        (-1, "generation_config.json: eos_token_id=-1 is refused: id -1 is outside"),
    ],
)
def test_a_bad_generation_config_eos_id_is_refused_by_name(tmp_path, generation_eos, problem):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    with pytest.raises(ValueError, match=re.escape(problem)):
        _hf_config(tmp_path, "v3")


@pytest.mark.parametrize(
    "top_k, norm_in, norm, scale",
    [(4, True, True, 1.0), (4, False, False, 2.0), (1, True, False, 2.0)],
)
def test_v2_norm_topk_prob_follows_deepseek_gate(tmp_path, caplog, top_k, norm_in, norm, scale):
    """DeepSeek's V2 gate normalises (top_k > 1 and norm_topk_prob) or scales, never both.
    Where it normalises, transformers' DeepseekV2 (which ignores the key) differs: said once."""
    with caplog.at_level("WARNING", logger="moe_runtime.model.hf_config"):
        cfg = _hf_config(
            tmp_path,
            "v2",
            num_experts_per_tok=top_k,
            norm_topk_prob=norm_in,
            routed_scaling_factor=2.0,
        )
    assert (cfg.norm_topk_prob, cfg.routed_scaling_factor) == (norm, scale)
    warned = [r.getMessage() for r in caplog.records if "norm_topk_prob is true" in r.getMessage()]
    assert len(warned) == int(norm), warned
    assert not warned or "transformers' DeepseekV2 ignores the key" in warned[0]


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers(tmp_path):
    """Both set: transformers 5 runs rope_scaling (`rope_scaling or rope_parameters`); the
    runtime ran rope_parameters. An empty rope_scaling leaves rope_parameters in force."""
    transformers = pytest.importorskip("transformers")
    default = {"rope_type": "default", "rope_theta": 10000.0}
    for legacy, kind in (({**YARN, "type": "yarn"}, "yarn"), ({}, "default")):
        cfg = _hf_config(tmp_path, "v3", rope_parameters=default, rope_scaling=legacy)
        hf = transformers.DeepseekV3Config.from_pretrained(tmp_path)
        assert hf.rope_parameters["rope_type"] == kind
        assert (cfg.rope_scaling or {"rope_type": "default"})["rope_type"] == kind


ROUTING_KEYS = ("n_shared_experts", "n_group", "topk_group", "norm_topk_prob", "rope_interleave")


@pytest.mark.parametrize("family", ["v2", "v3"])
def test_absent_key_is_transformers_default_or_refused(tmp_path, family):
    """transformers runs a config.json without a key with its class default (V3's: top_k 8,
    scale 2.5, 8 groups of which 4 eligible); the runtime ran its own. Each key of a file
    transformers wrote, left out in turn: refused by name, or read as transformers' default;
    V2's group keys under `greedy` (read by neither side) load as the whole file does."""
    transformers = pytest.importorskip("transformers")
    from moe_runtime.model.hf_config import MAPPED
    from tests.checkpoints import TINY_HF

    config_cls = {"v2": transformers.DeepseekV2Config, "v3": transformers.DeepseekV3Config}
    config_cls[family](**TINY_HF, q_lora_rank=24).save_pretrained(tmp_path / "full")
    full = json.loads((tmp_path / "full" / "config.json").read_text())
    defaults = config_cls[family]()
    whole = ModelConfig.from_dict({"path": str(tmp_path / "full")})
    unread = ("n_group", "topk_group") if family == "v2" else ()
    assert family == "v3" or full.get("topk_method", "greedy") == "greedy"
    for key in [*MAPPED, *ROUTING_KEYS]:
        if key not in full:
            continue
        path = tmp_path / key
        path.mkdir()
        (path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != key}))
        try:
            loaded = ModelConfig.from_dict({"path": str(path)})
        except ValueError as exc:
            assert key not in unread, exc
            assert f"field {key} is absent" in str(exc), exc
            continue
        if key in unread:  # greedy top-k: the same config but for the unread group keys
            groups = dict(n_group=whole.n_group, topk_group=whole.topk_group)
            assert loaded.topk_method == "greedy"
            assert dataclasses.replace(loaded, path=whole.path, **groups) == whole, key
            continue
        assert getattr(loaded, key) == getattr(defaults, key), key


@pytest.mark.parametrize(
    "key, named",
    [("n_group", "n_group=8"), ("num_experts_per_tok", "num_experts_per_tok=8")]
    + [("routed_scaling_factor", "routed_scaling_factor=2.5"), ("vocab_size", "vocab_size=129280")],
)
def test_absent_v3_key_is_refused_by_name(tmp_path, key, named):
    from tests.checkpoints import TINY_HF

    hf = {**TINY_HF, "model_type": "deepseek_v3", "q_lora_rank": None, "routed_scaling_factor": 1}
    del hf[key]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=rf"field {key} is absent: .* default {named} "):
        ModelConfig.from_dict({"path": str(tmp_path)})


GLG = {"topk_method": "group_limited_greedy"}


@pytest.mark.parametrize(
    "family, fields, named",
    [
        ("v3", {"topk_group": None}, "topk_group=None"),
        ("v3", {"topk_group": 0}, "topk_group=0"),
        ("v3", {"n_group": 0}, "n_group=0"),
        ("v3", {"n_group": None, "topk_group": None}, "n_group=None"),
        ("v2", {**GLG, "topk_group": None}, "topk_group=None"),
        ("v2", {**GLG, "topk_group": 0}, "topk_group=0"),
        ("v2", {"topk_method": None}, "topk_method=None"),
    ],
)
def test_a_null_or_zero_routing_key_the_method_reads_is_refused(tmp_path, family, fields, named):
    """They loaded as 1 (one eligible group: logits 0.5-2.9 off transformers' for a 0), a null
    topk_method as greedy, where transformers fails on a null; n_group 0 was refused naming a
    topk_group bound of 1 the file does not hold. V2's plain greedy reads no group key."""
    from tests.checkpoints import TINY_HF

    hf = {**TINY_HF, "model_type": f"deepseek_{family}", "q_lora_rank": None}
    hf |= {"routed_scaling_factor": 1} if family == "v3" else {"scoring_func": "softmax"}
    (tmp_path / "config.json").write_text(json.dumps({**hf, **fields}))
    with pytest.raises(ValueError, match=re.escape(f"config.json field {named} is refused")):
        ModelConfig.from_dict({"path": str(tmp_path)})
    if family == "v2":  # under greedy the group keys are read by neither side
        (tmp_path / "config.json").write_text(json.dumps({**hf, **fields, "topk_method": "greedy"}))
        loaded = ModelConfig.from_dict({"path": str(tmp_path)})
        assert (loaded.topk_method, loaded.n_group, loaded.topk_group) == ("greedy", 1, 1)


@pytest.mark.parametrize(
    "fields, named",
    [
        (
            dict(topk_method="group_limited_greedy", scoring_func="softmax", n_group=8),
            "model.num_experts_per_tok must be <= topk_group * n_routed_experts / n_group "
            "(1 * 16 / 8) under topk_method 'group_limited_greedy', got 4",
        ),
        (
            dict(n_group=8),
            "model.num_experts_per_tok must be <= topk_group * n_routed_experts / n_group "
            "(1 * 16 / 8) under topk_method 'noaux_tc', got 4",
        ),
        (
            dict(n_group=16, topk_group=4),
            "model.n_group must be <= n_routed_experts / 2 (16 / 2) under noaux_tc, got 16",
        ),
    ],
    ids=["glg_top_k_over_eligible", "noaux_top_k_over_eligible", "noaux_group_of_one"],
)
def test_group_limited_routing_the_reference_cannot_compute_is_refused(fields, named):
    """top_k past the eligible groups' experts (transformers picks masked experts, the runtime
    others), and noaux_tc's top-2 group score of one-expert groups (transformers raises)."""
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig(**{"num_experts_per_tok": 4, "topk_group": 1, **fields})
    ModelConfig(num_experts_per_tok=2, topk_group=1, n_group=8)  # exactly the eligible experts


def test_invariant_cuda_models_of_64_heads_or_more_need_bf16():
    """Their attention programs take 64 heads, whose fp32 cache blocks do not fit in the GPU's
    shared memory: refused at load, naming the keys; fast mode and bf16 load."""
    wide = {"model.num_attention_heads": 64, "model.dtype": "float32"}
    with pytest.raises(ValueError, match="model.num_attention_heads=64.*model.dtype 'bfloat16'"):
        load_config(CONFIGS / "tiny_gpu.yaml", wide)
    assert load_config(CONFIGS / "tiny_gpu.yaml", {**wide, "kernels.mode": "fast"}).model.dtype
    bf16 = load_config(CONFIGS / "tiny_gpu.yaml", {**wide, "model.dtype": "bfloat16"})
    assert bf16.model.num_attention_heads == 64
    narrow = load_config(CONFIGS / "tiny_gpu.yaml", {"model.dtype": "float32"})
    assert narrow.model.dtype == "float32"  # 4 heads: the 16-head launch, fp32 fits


def test_attention_long_splits_load_at_both_launches_and_bad_sizes_are_refused():
    """kernels.attention_long_blocks and attention_long_split_blocks load at a 4-head model
    (the 16-head launch) and a 64-head one (the wide launch), 0 and null too; a split size not
    above the launch's split (4 blocks; 16 at 64 heads), an odd one at 64 heads (the Gluon
    kernel pairs blocks), a size below 1, and either beside groups are refused, each naming
    the keys and values. The defaults (null: the launch's own) load with groups."""
    wide = {"model.num_attention_heads": 64, "model.dtype": "bfloat16"}
    for heads, size in (({}, 8), ({}, 5), (wide, 64), (wide, 32)):
        for value in (8, 0, None):
            keys = {"kernels.attention_long_blocks": value}
            config = load_config(CONFIGS / "tiny_gpu.yaml", {**heads, **keys})
            assert config.kernels.attention_long_blocks == value
        keys = {"kernels.attention_long_blocks": 64, "kernels.attention_long_split_blocks": size}
        kernels = load_config(CONFIGS / "tiny_gpu.yaml", {**heads, **keys}).kernels
        assert (kernels.attention_long_blocks, kernels.attention_long_split_blocks) == (64, size)
    groups = {"kernels.attention_group_splits": 2}
    assert load_config(CONFIGS / "tiny_gpu.yaml", groups).kernels.attention_long_blocks is None
    for heads, size, message in (
        ({}, 4, "attention_long_split_blocks=4 must be above the launch's split of 4 cache "
         "blocks at model.num_attention_heads=4"),
        (wide, 16, "attention_long_split_blocks=16 must be above the launch's split of 16 "
         "cache blocks and even .*num_attention_heads=64"),
        (wide, 33, "attention_long_split_blocks=33 .* and even"),
        ({}, 0, "attention_long_split_blocks must be an int >= 1 or null, got 0"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            keys = {"kernels.attention_long_split_blocks": size}
            load_config(CONFIGS / "tiny_gpu.yaml", {**heads, **keys})
    both = {"kernels.attention_long_blocks": 8, "kernels.attention_group_splits": 2}
    with pytest.raises(ValueError, match="attention_long_blocks=8 and .*group_splits=2"):
        load_config(CONFIGS / "tiny_gpu.yaml", both)
    both = {"kernels.attention_long_split_blocks": 8, "kernels.attention_group_splits": 2}
    with pytest.raises(ValueError, match="attention_long_split_blocks=8 and .*group_splits=2"):
        load_config(CONFIGS / "tiny_gpu.yaml", both)


def test_attention_group_splits_loads_below_64_heads_and_is_refused_from_64():
    """kernels.attention_group_splits applies to the 16-head launch: a 4-head model loads with
    it; a 64-head one is refused at load, naming both keys."""
    grouped = load_config(CONFIGS / "tiny_gpu.yaml", {"kernels.attention_group_splits": 8})
    assert grouped.kernels.attention_group_splits == 8
    wide = {"model.num_attention_heads": 64, "model.dtype": "bfloat16"}
    with pytest.raises(
        ValueError, match="kernels.attention_group_splits=8 .*model.num_attention_heads=64"
    ):
        load_config(CONFIGS / "tiny_gpu.yaml", {**wide, "kernels.attention_group_splits": 8})


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("parallel.timeout_s", ".inf", "a finite number"),  # every call must have a bound
        ("parallel.timeout_s", "abc", "a finite number"),
        ("parallel.timeout_s", "true", "a finite number"),
        ("parallel.world_size", "true", "an int"),  # Python counts a bool as the int 1
        ("parallel.max_restarts", "true", "an int"),
        ("parallel.restart_window_s", "0", r"a number in \(0, "),
        # past the platform's longest wait: an OverflowError at its first use, the loop dead
        ("parallel.timeout_s", "1.0e+30", r"a number in \(0, 9.22e\+09\] seconds"),
        ("parallel.restart_window_s", ".inf", "a finite number"),
        # an update's read has its own bound, never none (a stuck read would hang the engine)
        ("parallel.weight_read_timeout_s", "0", r"a number in \(0, .* got 0"),
        ("parallel.weight_read_timeout_s", "-5", r"a number in \(0, .* got -5"),
        ("parallel.weight_read_timeout_s", ".inf", "a finite number"),
        ("parallel.weight_read_timeout_s", "null", "a finite number"),
        ("parallel.weight_read_timeout_s", "slow", "a finite number"),
        ("cache.enable_prefix_caching", "maybe", "true or false"),  # a word is truthy
        ("scheduler.enable_chunked_prefill", "1", "true or false"),
        ("eplb.enabled", "yes please", "true or false"),
        ("eplb.balancedness_threshold", ".nan", "a finite number"),
        ("model.num_hidden_layers", "true", "an int"),
        ("model.init_std", ".inf", "a finite number"),
        ("server.port", "true", "an int"),
        ("server.host", "5", "a string"),
        ("server.host", "''", "a non-empty string"),
        ("server.model_name", "null", "a string"),
        ("server.api_key", "5", "a string or null"),
        ("server.api_key", "''", "null or a non-empty string"),
        ("server.health_check_interval_s", "0", r"null or a number in \(0, "),
        ("server.health_check_interval_s", "1.0e+10", r"null or a number in \(0, 9.22e\+09\]"),
        ("server.health_check_interval_s", ".inf", "a finite number or null"),
        ("model.rope_theta", "0", "> 0"),  # NaN rotations
        ("model.routed_scaling_factor", "-1", "> 0"),
        ("model.init_std", "-0.1", ">= 0"),
    ],
)
def test_values_of_the_wrong_type_fail_at_load_naming_the_key(key, value, named):
    """What YAML and --set hand over loosely (`true` for a number, a word for an on/off key,
    .inf for a bound) is refused with the key named, never taken for something else."""
    with pytest.raises(ValueError, match=f"{key.replace('.', '[.]')} must be {named}"):
        load_config(CONFIGS / "tiny_cpu.yaml", {key: value})


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("5", "rope_scaling=5 is refused: must be an object or null"),
        ("yarn", "rope_scaling='yarn' is refused: must be an object or null"),
        ("{type: linear, factor: 2}", "rope_scaling.rope_type='linear' is refused"),
        ("{type: yarn}", "rope_scaling.factor=None is refused: YaRN needs it set"),
        ("{type: yarn, factor: x}", "rope_scaling.factor='x' is refused: must be a finite"),
        # NaN and infinity loaded, and the logits came out NaN (greedy gave token 0 throughout)
        (
            "{type: yarn, original_max_position_embeddings: 256, factor: .nan}",
            "rope_scaling.factor=nan is refused: must be a finite number",
        ),
        (
            "{type: yarn, original_max_position_embeddings: 256, factor: 2, mscale: .inf}",
            "rope_scaling.mscale=inf is refused: must be a finite number",
        ),
        ("{rope_type: default, foo: 1}", "rope_scaling.foo=1 is refused: not implemented"),
        (
            "{type: yarn, factor: 4, original_max_position_embeddings: 0}",
            "rope_scaling.original_max_position_embeddings=0 is refused: must be > 0",
        ),
        (
            "{type: yarn, factor: 4, original_max_position_embeddings: 64, rope_theta: 5}",
            "rope_scaling.rope_theta=5 is refused: set model.rope_theta",
        ),
    ],
)
def test_a_bad_rope_scaling_fails_at_load_naming_the_key(value, named):
    """The YAML rope_scaling follows config.json's rules (one check, hf_config.rope_problem):
    a non-mapping failed with an AttributeError, a YaRN without its factor only when the
    model was built (KeyError), an unknown or ignored sub-key loaded silently."""
    with pytest.raises(ValueError, match=f"model[.]{re.escape(named)}"):
        load_config(CONFIGS / "tiny_cpu.yaml", {"model.rope_scaling": value})


def test_malformed_yaml_names_the_file_or_the_override(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1\n")
    with pytest.raises(ValueError, match="config file .*bad.yaml' is not valid YAML"):
        load_config(bad)
    with pytest.raises(ValueError, match=r"override model.seed='\[1' is not a YAML value"):
        load_config(CONFIGS / "tiny_cpu.yaml", {"model.seed": "[1"})


def test_loose_values_that_mean_one_thing_still_load():
    """An int where a number is meant, YAML's bare on/off for the EP exchange, null where a key
    may be off: each loads as what it says."""
    config = load_config(
        CONFIGS / "tiny_cpu.yaml",
        {
            "parallel.timeout_s": "10",
            "parallel.weight_read_timeout_s": "3600",
            "cache.gpu_memory_utilization": "1",
            "parallel.ep_capacity_dispatch": "off",
            "server.health_check_interval_s": "null",
            "model.q_lora_rank": "null",
        },
    )
    assert config.parallel.timeout_s == 10 and config.cache.gpu_memory_utilization == 1
    assert config.parallel.weight_read_timeout_s == 3600
    assert config.parallel.ep_capacity_dispatch == "off"
    assert config.server.health_check_interval_s is None and config.model.q_lora_rank is None


@pytest.mark.parametrize(
    "yaml_text, overrides, named",
    [
        # an unset shell variable (`--set server.api_key=$KEY`) meant null: auth off, no word
        ("", {"server.api_key": ""}, r"override server.api_key='' has no value"),
        ("", {"server.api_key": " "}, r"override server.api_key=' ' has no value"),
        ("kernels: 0\n", {"kernels.mode": "fast"}, r"section 'kernels' must be a mapping, got 0"),
        ("model: [1]\n", {"model.seed": "1"}, r"section 'model' must be a mapping, got \[1\]"),
        ("1: a\nfoo: b\n", {}, r"config: key 1 must be a name, got int"),  # a sort's TypeError
        ("model:\n  1: a\n", {}, r"config section 'model': key 1 must be a name, got int"),
        ("", {1: "x"}, r"override 1 must be a 'section.key' string"),
    ],
)
def test_a_config_that_cannot_be_read_as_named_keys_is_refused_naming_it(
    tmp_path, yaml_text, overrides, named
):
    """Each of these was a TypeError or AttributeError from inside the loader, or (the empty
    override) silently null."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=named):
        load_config(path, overrides)


@pytest.mark.parametrize("falsy", ["[]", "0", "false", "''"])
def test_a_falsy_value_that_is_no_mapping_is_refused_as_a_file_or_a_section(tmp_path, falsy):
    """`[]`, `0`, `false` or `''` as the whole file or as a section loaded as every default
    (`or {}`), where `[1]` and `kernels: 5` were refused (and `kernels: 0` only when an override
    touched the section). An empty file and a section with nothing under it are defaults."""
    path = tmp_path / "config.yaml"
    path.write_text(f"{falsy}\n")
    with pytest.raises(ValueError, match=r"config\.yaml' must hold a mapping of sections"):
        load_config(path)
    tiny = (CONFIGS / "tiny_cpu.yaml").read_text()
    path.write_text(tiny.replace("eplb:\n  enabled: false\n", f"eplb: {falsy}\n"))
    with pytest.raises(ValueError, match=r"config section 'eplb' must be a mapping, got"):
        load_config(path)
    path.write_text("")
    assert load_config(path) == load_config({})
    path.write_text(tiny.replace("eplb:\n  enabled: false\n", "eplb:\n"))
    assert load_config(path).eplb == load_config({}).eplb


def test_a_config_file_that_is_not_utf8_is_refused_naming_it(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"config\.yaml' is not valid YAML: 'utf-8' codec"):
        load_config(path)


def test_an_int_past_64_bits_is_refused_naming_the_key():
    """A TypeError from torch's size unpacking (or a later kernel) before."""
    for key in ("cache.num_blocks", "model.vocab_size", "kernels.tile_rows"):
        with pytest.raises(ValueError, match=rf"{key} must be an int that fits in 64 bits"):
            load_config(CONFIGS / "tiny_cpu.yaml", {key: 10**30})


def test_a_kv_cache_too_large_to_allocate_is_refused_naming_its_size():
    """A bare DefaultCPUAllocator error before, naming no setting."""
    from moe_runtime import LLM

    with pytest.raises(ValueError, match=r"KV cache of cache.num_blocks=100000000000 blocks"):
        LLM(CONFIGS / "tiny_cpu.yaml", **{"cache.num_blocks": 10**11})


@pytest.mark.parametrize("key", ["routed_scaling_factor", "rms_norm_eps", "first_k_dense_replace"])
def test_a_null_config_json_size_or_scale_is_refused_naming_it(tmp_path, key):
    """A TypeError from ModelConfig's range checks before ('>' between None and int): null
    means nothing for these keys (it does for q_lora_rank, n_shared_experts, the groups)."""
    from tests.checkpoints import TINY_HF

    hf = {**TINY_HF, "model_type": "deepseek_v3", "q_lora_rank": None, "routed_scaling_factor": 1}
    (tmp_path / "config.json").write_text(json.dumps({**hf, key: None}))
    with pytest.raises(ValueError, match=rf"field {key}=None is refused: must be .*, not null"):
        ModelConfig.from_dict({"path": str(tmp_path)})


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_model_path_is_refused_not_read_as_random_weights(path):
    """`path: ${CKPT}` with the variable unset served random weights as the checkpoint's."""
    with pytest.raises(ValueError, match=r"model\.path is empty .* or null \(or no key\)"):
        load_config(CONFIGS / "tiny_cpu.yaml", {"model.path": repr(path)})
    assert load_config(CONFIGS / "tiny_cpu.yaml", {"model.path": "null"}).model.path is None


@pytest.mark.parametrize("tile_rows", [3, 5, 12])
def test_threads_with_a_tile_that_is_no_power_of_two_are_refused_naming_both(tile_rows):
    """Several intra-op threads split a tile's rows between them, and at some heights a row's
    bits then follow its place in the tile (tests/test_kernels_shapes.py); invariant mode
    refuses such a tile with threads, fast mode (no promise) and one thread accept it."""
    threads = {"kernels.num_threads": 2, "kernels.tile_rows": tile_rows}
    with pytest.raises(
        ValueError, match=rf"kernels.tile_rows={tile_rows} with kernels.num_threads=2"
    ):
        load_config(CONFIGS / "tiny_cpu.yaml", threads)
    assert load_config(CONFIGS / "tiny_cpu.yaml", {**threads, "kernels.mode": "fast"})
    if tile_rows >= 8:  # below 8 one thread is refused too (the test below)
        assert load_config(CONFIGS / "tiny_cpu.yaml", {**threads, "kernels.num_threads": 1})
    power_of_two = load_config(CONFIGS / "tiny_cpu.yaml", {**threads, "kernels.tile_rows": 8})
    assert (power_of_two.kernels.num_threads, power_of_two.kernels.tile_rows) == (2, 8)


@pytest.mark.parametrize("tile_rows", [2, 4, 7])
def test_a_tile_of_two_to_seven_rows_is_refused_in_invariant_mode(tile_rows):
    """Under MKL's SSE4.2 kernels a row of such a tile got bits that follow its place in it,
    even on one thread (tests/test_kernels_shapes.py); 1 and 8 load, and fast mode (no
    promise) takes any height."""
    with pytest.raises(
        ValueError, match=rf"at least 8 in invariant mode .* got kernels.tile_rows={tile_rows}$"
    ):
        load_config(CONFIGS / "tiny_cpu.yaml", {"kernels.tile_rows": tile_rows})
    fast = {"kernels.tile_rows": tile_rows, "kernels.mode": "fast"}
    assert load_config(CONFIGS / "tiny_cpu.yaml", fast).kernels.tile_rows == tile_rows
    for allowed in (1, 8):
        config = load_config(CONFIGS / "tiny_cpu.yaml", {"kernels.tile_rows": allowed})
        assert config.kernels.tile_rows == allowed
