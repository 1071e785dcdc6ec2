"""Malformed HF checkpoints are refused at start-up with a ValueError naming the tensor, the file
or the config.json field, before any tensor is read; none is loaded silently.

Each case writes its bad copy of one tiny DeepSeek-V3 checkpoint (transformers) into tmp_path.
The good checkpoint, and one whose extra layer is a declared multi-token-prediction layer, load
the file's own bits.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_kernels import KernelConfig, build_op_table
from moe_runtime import LLM
from moe_runtime.model.loader import build_model
from moe_runtime.model_config import ModelConfig
from tests.checkpoints import rewrite_checkpoint, shard_checkpoint

pytest.importorskip("transformers")

EXPERT = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """3 decoder layers (1 and 2 MoE, 16 experts), num_nextn_predict_layers 1, no MTP tensors."""
    from tests.checkpoints import write_tiny_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    write_tiny_checkpoint(path, "v3", seed=3, q_lora_rank=None)
    return path


def _load(path, dtype: str = "float32") -> dict[str, torch.Tensor]:
    model = build_model(
        ModelConfig.from_dict({"path": str(path), "dtype": dtype}),
        build_op_table(KernelConfig(), "cpu"),
    )
    return {name: p.detach() for name, p in model.named_parameters()}


def _with(tensors: dict[str, torch.Tensor]):
    return lambda state: {**state, **tensors}


def _layers(num_hidden: int, num_mtp: int | None):
    def edit(hf: dict) -> dict:
        hf = {**hf, "num_hidden_layers": num_hidden}
        hf.pop("num_nextn_predict_layers")
        return hf if num_mtp is None else {**hf, "num_nextn_predict_layers": num_mtp}

    return edit


def _assert_file_bits(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Every parameter holds the file's tensor; routed experts stacked in expert order."""
    for name, value in params.items():
        prefix, proj = name.rsplit(".", 1)
        if proj in ("gate_up_proj", "down_proj"):
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            per_expert = [[state[f"{prefix}.{e}.{p}.weight"] for p in parts] for e in range(16)]
            assert torch.equal(value, torch.stack([torch.cat(t) for t in per_expert])), name
        else:
            assert torch.equal(value, state[name]), name


def test_good_checkpoint_loads_its_own_bits(checkpoint):
    _assert_file_bits(_load(checkpoint), load_file(str(checkpoint / "model.safetensors")))


def _mtp_module(layer_id: int):
    """The tensors DeepSeek-V3 stores beside a decoder layer's to make it an MTP module."""
    prefix = f"model.layers.{layer_id}"
    return _with(
        {
            f"{prefix}.eh_proj.weight": torch.zeros(64, 128),
            f"{prefix}.enorm.weight": torch.ones(64),
            f"{prefix}.hnorm.weight": torch.ones(64),
            f"{prefix}.shared_head.norm.weight": torch.ones(64),
            f"{prefix}.shared_head.head.weight": torch.zeros(512, 64),
        }
    )


def test_declared_mtp_layer_is_skipped(checkpoint, tmp_path):
    """config.json with 2 decoder layers and 1 MTP layer: layer 2 is the MTP layer, left out."""
    path = rewrite_checkpoint(
        checkpoint, tmp_path / "mtp", tensors=_mtp_module(2), config=_layers(2, 1)
    )
    params = _load(path)
    assert not any(name.startswith("model.layers.2.") for name in params)
    _assert_file_bits(params, load_file(str(checkpoint / "model.safetensors")))


def test_a_decoder_layer_the_config_does_not_count_is_refused(checkpoint, tmp_path):
    """config.json counting 2 decoder layers and the 1 MTP layer V3 declares by default, over a
    checkpoint of 3 decoder layers: layer 2 has no MTP module's eh_proj, so it is a decoder
    layer the model would lack (it was skipped as MTP: a 2-layer model, no error)."""
    path = rewrite_checkpoint(checkpoint, tmp_path / "short", config=_layers(2, 1))
    with pytest.raises(
        ValueError,
        match=r"layer 2 holds no model\.layers\.2\.eh_proj\.weight.*num_hidden_layers=2",
    ):
        _load(path)


@pytest.mark.parametrize(
    ("num_hidden", "num_mtp"), [(2, None), (2, 0), (1, 1)], ids=["no_mtp_key", "mtp0", "mtp1"]
)
def test_layer_beyond_the_mtp_layers_is_refused(checkpoint, tmp_path, num_hidden, num_mtp):
    path = rewrite_checkpoint(checkpoint, tmp_path / "ckpt", config=_layers(num_hidden, num_mtp))
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.2\."):
        _load(path)


GATE = torch.zeros(32, 64)
BAD_EXPERTS = {
    "extra_expert": (
        _with(
            {
                f"model.layers.2.mlp.experts.16.{p}.weight": GATE.clone()
                for p in ("gate_proj", "up_proj")
            }
        ),
        r"unexpected tensor model\.layers\.2\.mlp\.experts\.16\.gate_proj\.weight",
    ),
    "lone_extra_projection": (
        _with({f"{EXPERT}.16.up_proj.weight": GATE}),
        r"unexpected tensor model\.layers\.1\.mlp\.experts\.16\.up_proj\.weight",
    ),
    "expert_in_dense_layer": (
        _with({"model.layers.0.mlp.experts.0.gate_proj.weight": GATE}),
        r"unexpected tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight",
    ),
    "int32_down_proj": (
        _with({f"{EXPERT}.5.down_proj.weight": torch.ones(64, 32, dtype=torch.int32)}),
        r"experts\.5\.down_proj\.weight is \(64, 32\) torch\.int32",
    ),
    "int64_up_proj": (
        _with({f"{EXPERT}.5.up_proj.weight": torch.ones(32, 64, dtype=torch.int64)}),
        r"experts\.5\.up_proj\.weight is \(32, 64\) torch\.int64",
    ),
    "float8_up_proj": (
        _with({f"{EXPERT}.5.up_proj.weight": torch.zeros(32, 64).to(torch.float8_e4m3fn)}),
        r"experts\.5\.up_proj\.weight is \(32, 64\) torch\.float8_e4m3fn",
    ),
    "missing_up_proj": (
        lambda state: {k: v for k, v in state.items() if k != f"{EXPERT}.3.up_proj.weight"},
        r"lacks model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight",
    ),
    "wrong_expert_shape": (
        _with({f"{EXPERT}.2.down_proj.weight": torch.zeros(64, 31)}),
        r"experts\.2\.down_proj\.weight is \(64, 31\) torch\.float32, the model expects \(64, 32\)",
    ),
}


@pytest.mark.parametrize("case", BAD_EXPERTS)
def test_bad_expert_tensor_is_refused_by_name(checkpoint, tmp_path, case):
    edit, match = BAD_EXPERTS[case]
    path = rewrite_checkpoint(checkpoint, tmp_path / case, tensors=edit)
    with pytest.raises(ValueError, match=match):
        _load(path)


def _fp8_block_quantized(state: dict) -> dict:
    """DeepSeek-V3's layout: each 2-D projection's weight in float8_e4m3fn, with a float32
    `weight_scale_inv` of one value per 128 x 128 block beside it."""
    out = dict(state)
    for key, value in state.items():
        if key.endswith("_proj.weight") and value.dim() == 2:
            out[key] = value.to(torch.float8_e4m3fn)
            blocks = (-(-value.shape[0] // 128), -(-value.shape[1] // 128))
            out[f"{key}_scale_inv"] = torch.ones(blocks)
    return out


def test_an_fp8_block_quantized_checkpoint_is_refused_naming_a_tensor(checkpoint, tmp_path):
    """Its config.json's quantization_config is refused saying what it is and what to do (it
    said "only None is implemented"); without it, the first float8 weight or scale is named
    as FP8 block-quantized (a dense layer's scale was an "unexpected" name, an expert's weight
    a wrong dtype). Either way no float8 byte is loaded."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    declared = rewrite_checkpoint(
        checkpoint,
        tmp_path / "declared",
        tensors=_fp8_block_quantized,
        config=lambda hf: {**hf, "quantization_config": fp8},
    )
    with pytest.raises(ValueError, match=r"quantization_config=.*FP8.*dequantize"):
        _load(declared)
    bare = rewrite_checkpoint(checkpoint, tmp_path / "bare", tensors=_fp8_block_quantized)
    with pytest.raises(
        ValueError,
        match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight is \(64, 128\) "
        r"torch\.float8_e4m3fn, part of an FP8 block-quantized checkpoint",
    ):
        _load(bare)
    scale = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    one_scale = rewrite_checkpoint(
        checkpoint, tmp_path / "scale", tensors=_with({scale: torch.ones(1, 1)})
    )
    with pytest.raises(ValueError, match=rf"tensor {scale} is .*FP8 block-quantized"):
        _load(one_scale)


def _poisoned(key: str, value: float):
    """The state with one value of `key` replaced by `value`."""

    def edit(state: dict) -> dict:
        tensor = state[key].clone()
        tensor.view(-1)[7] = value
        return {**state, key: tensor}

    return edit


@pytest.mark.parametrize(
    ("key", "value"),
    [(f"{EXPERT}.4.down_proj.weight", float("nan")), ("model.norm.weight", float("inf"))],
    ids=["nan_expert", "inf_norm"],
)
def test_non_finite_tensor_is_refused_by_name(checkpoint, tmp_path, key, value):
    """A NaN or an infinity in any tensor would serve NaN logprobs or garbage with no error:
    refused at load, naming the tensor. Control: the same edit with a finite value loads."""
    path = rewrite_checkpoint(checkpoint, tmp_path / "bad", tensors=_poisoned(key, value))
    with pytest.raises(ValueError, match=rf"{key} holds 1 non-finite value \(NaN or infinity\)"):
        _load(path)
    finite = rewrite_checkpoint(checkpoint, tmp_path / "finite", tensors=_poisoned(key, 0.5))
    _assert_file_bits(_load(finite), load_file(str(finite / "model.safetensors")))


def test_value_that_overflows_the_model_dtype_is_refused_by_name(checkpoint, tmp_path):
    """A finite value that is an infinity once cast to the model's dtype (float32 3.4e38 as
    bfloat16, whose largest is 3.39e38; float64 1e39 as float32) would load as one: refused,
    naming the tensor, the value and the dtype. Controls: the float32 value loads as float32
    (finite there, and the parameter holds it); bfloat16's largest loads as bfloat16."""
    key = "model.norm.weight"
    path = rewrite_checkpoint(checkpoint, tmp_path / "big", tensors=_poisoned(key, 3.4e38))
    with pytest.raises(
        ValueError, match=rf"{key} holds a value of magnitude 3\.4e\+38, which is an infinity "
        r"as the model's torch\.bfloat16 \(largest finite 3\.38953e\+38\)",
    ):  # fmt: skip
        _load(path, "bfloat16")
    assert float(_load(path)[key].view(-1)[7]) == float(torch.tensor(3.4e38))
    largest = torch.finfo(torch.bfloat16).max
    fits = rewrite_checkpoint(checkpoint, tmp_path / "fits", tensors=_poisoned(key, largest))
    assert float(_load(fits, "bfloat16")[key].view(-1)[7]) == largest

    def wide(state: dict) -> dict:
        tensor = state[key].double()
        tensor.view(-1)[3] = -1e39
        return {**state, key: tensor}

    path = rewrite_checkpoint(checkpoint, tmp_path / "wide", tensors=wide)
    with pytest.raises(ValueError, match=rf"{key} holds a value of magnitude 1e\+39, .*float32"):
        _load(path)


def test_tensor_in_two_files_is_refused(checkpoint, tmp_path):
    path = rewrite_checkpoint(checkpoint, tmp_path / "dup")
    save_file({"model.norm.weight": torch.full((64,), 3.0)}, str(path / "model-00002.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model\.norm\.weight is in both model-00002\.safetensors and model\.safetensors",
    ):
        _load(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_malformed_safetensors_file_is_named(checkpoint, tmp_path, damage):
    path = rewrite_checkpoint(checkpoint, tmp_path / damage)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" if damage == "garbage" else data[:-100]
    )
    with pytest.raises(ValueError, match=r"model\.safetensors' is not valid safetensors"):
        _load(path)


def test_a_sharded_checkpoint_loads_its_own_bits(checkpoint, tmp_path):
    path = shard_checkpoint(checkpoint, tmp_path / "sharded", 4)
    _assert_file_bits(_load(path), load_file(str(checkpoint / "model.safetensors")))


def test_a_shard_the_index_names_that_is_missing_is_named(checkpoint, tmp_path):
    """An interrupted download: the error names the absent shard and the index (it named the
    first tensor the model lacked, as if the checkpoint were of another model)."""
    path = shard_checkpoint(checkpoint, tmp_path / "sharded", 4)
    (path / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(
        ValueError,
        match=r"shard model-00003-of-00004\.safetensors is missing; "
        r"model\.safetensors\.index\.json names it for \d+ tensors",
    ):
        _load(path)


def test_a_shard_the_index_does_not_name_is_not_read(checkpoint, tmp_path, caplog):
    """A stale shard of an earlier save beside the current ones: transformers reads the index's
    shards alone, and so does the loader (it refused the directory, a tensor in two files).
    The warning names the file."""
    path = shard_checkpoint(checkpoint, tmp_path / "sharded", 4)
    stale = {"model.norm.weight": torch.full((64,), 3.0)}
    save_file(stale, str(path / "model-00001-of-00005.safetensors"))
    with caplog.at_level(logging.WARNING, logger="moe_runtime.loader"):
        params = _load(path)
    _assert_file_bits(params, load_file(str(checkpoint / "model.safetensors")))
    assert "model-00001-of-00005.safetensors not named in model.safetensors.index.json" in (
        caplog.text
    )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", r"index\.json is not valid JSON"),
        ('{"weight_map": {"model.norm.weight": "../x.safetensors"}}', r"holds no weight_map"),
        ('{"metadata": {}}', r"holds no weight_map"),
        ('{"weight_map": {}}', r"names no tensors"),
    ],
    ids=["syntax", "path_outside", "no_map", "empty_map"],
)
def test_a_malformed_index_is_named(checkpoint, tmp_path, text, match):
    path = shard_checkpoint(checkpoint, tmp_path / "sharded", 2)
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        _load(path)


@pytest.mark.parametrize("case", ["directory", "dangling_link"])
def test_an_unreadable_weights_file_is_named(checkpoint, tmp_path, case):
    """A directory named *.safetensors, a link to nothing: an OSError out of the loader (a raw
    traceback from the CLIs) before; now a ValueError naming the file."""
    path = rewrite_checkpoint(checkpoint, tmp_path / case)
    odd = path / "model-00002.safetensors"
    if case == "directory":
        odd.mkdir()
    else:
        odd.symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(ValueError, match=r"model-00002\.safetensors"):
        LLM({"model": {"path": str(path)}, "scheduler": {"max_model_len": 256}})


def test_a_model_path_too_long_to_open_is_named(tmp_path):
    path = str(tmp_path / ("x" * 300))
    with pytest.raises(ValueError, match="cannot be read: .*File name too long"):
        LLM({"model": {"path": path}})


BAD_CONFIGS = {
    "rope_parameters_str": ({"rope_parameters": "yarn"}, r"rope_parameters='yarn'"),
    "hidden_size_str": ({"hidden_size": "64"}, r"hidden_size='64'"),
    "qk_nope_head_dim_float": ({"qk_nope_head_dim": 16.5}, r"qk_nope_head_dim=16\.5"),
    "rope_theta_str": ({"rope_parameters": {"rope_theta": "1e4"}}, r"rope_parameters\.rope_theta"),
    "norm_topk_prob_str": ({"norm_topk_prob": "false"}, r"norm_topk_prob='false'"),
    "eos_str_list": ({"eos_token_id": ["257"]}, r"eos_token_id=\['257'\]"),
    "mtp_negative": ({"num_nextn_predict_layers": -1}, r"num_nextn_predict_layers=-1"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_config_field_of_wrong_type_is_named(checkpoint, tmp_path, case):
    fields, match = BAD_CONFIGS[case]
    path = rewrite_checkpoint(checkpoint, tmp_path / case, config=lambda hf: {**hf, **fields})
    with pytest.raises(ValueError, match=rf"config\.json field {match}"):
        ModelConfig.from_dict({"path": str(path)})


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff"], ids=["syntax", "list", "bytes"])
def test_malformed_config_json_is_named(checkpoint, tmp_path, text):
    path = rewrite_checkpoint(checkpoint, tmp_path / "ckpt")
    (path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(
        ValueError, match=r"ckpt/config\.json (is not valid JSON|holds a JSON list)"
    ):
        ModelConfig.from_dict({"path": str(path)})


def test_a_config_json_key_given_twice_takes_its_last_value_with_a_warning(
    checkpoint, tmp_path, caplog
):
    """As transformers reads such a file (json keeps the last value), so a checkpoint it loads
    loads here; the warning names the key (a hand-edited file may not mean what it says)."""
    path = rewrite_checkpoint(checkpoint, tmp_path / "ckpt")
    text = (path / "config.json").read_text()
    layers = json.loads(text)["num_hidden_layers"]
    (path / "config.json").write_text('{"num_hidden_layers": 99, ' + text.lstrip()[1:])
    with caplog.at_level(logging.WARNING, logger="moe_runtime.model.hf_config"):
        config = ModelConfig.from_dict({"path": str(path)})
    assert config.num_hidden_layers == layers
    assert "key 'num_hidden_layers' appears twice in one object" in caplog.text


def _tied(hf: dict) -> dict:
    return {**hf, "tie_word_embeddings": True}


def test_tied_config_with_a_different_stored_head_is_refused(checkpoint, tmp_path):
    """tie_word_embeddings with a stored lm_head.weight: transformers keeps a head that differs
    from the embedding untied, the runtime dropped it; refused naming both. Control: a stored
    head equal to the embedding loads, tied."""
    path = rewrite_checkpoint(checkpoint, tmp_path / "differs", config=_tied)
    with pytest.raises(
        ValueError,
        match=r"tie_word_embeddings=True but the stored lm_head\.weight differs from "
        r"model\.embed_tokens\.weight",
    ):
        _load(path)
    same = rewrite_checkpoint(
        checkpoint,
        tmp_path / "same",
        config=_tied,
        tensors=lambda state: {
            **state,
            "lm_head.weight": state["model.embed_tokens.weight"].clone(),
        },
    )
    params = _load(same)
    embed = load_file(str(same / "model.safetensors"))["model.embed_tokens.weight"]
    assert "lm_head.weight" not in params and torch.equal(
        params["model.embed_tokens.weight"], embed
    )


def test_empty_shared_experts_of_a_model_without_them_are_skipped(tmp_path):
    """transformers saves n_shared_experts=0 as zero-element shared_experts tensors; they hold
    nothing to load. Control: the same empty tensors with n_shared_experts=1 are refused."""
    from tests.checkpoints import write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path / "ckpt", "v3", seed=3, q_lora_rank=None, n_shared_experts=0)
    state = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    empty = [key for key, value in state.items() if not value.numel()]
    assert empty and all(".mlp.shared_experts." in key for key in empty)
    params = _load(tmp_path / "ckpt")
    _assert_file_bits(params, {k: v for k, v in state.items() if k not in empty})
    with_shared = rewrite_checkpoint(
        tmp_path / "ckpt", tmp_path / "shared1", config=lambda hf: {**hf, "n_shared_experts": 1}
    )
    with pytest.raises(ValueError, match=r"shared_experts"):
        _load(with_shared)
