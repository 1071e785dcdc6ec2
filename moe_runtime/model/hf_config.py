"""Read an HF DeepSeek-V2/V3 `config.json` into ModelConfig fields, refusing what we don't run.

Every key of the file is in exactly one class: mapped onto a ModelConfig field and computed as
transformers computes it for the model type (DeepSeek's released code where transformers drops a
field it uses: V2 `norm_topk_prob`); accepted because it cannot change a forward pass at
inference (the reason is written beside it); or accepted only at the value the reference
computes with. Anything else, including a key we have never seen, is a ValueError naming the
key and its value. This module reads the file and checks the JSON type of each key it computes
with; ModelConfig validates the values.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

from moe_runtime.config_fields import is_int

log = logging.getLogger(__name__)

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")

# Keys copied one to one onto ModelConfig fields of the same name.
MAPPED = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
    "num_attention_heads q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
    "n_routed_experts num_experts_per_tok routed_scaling_factor first_k_dense_replace "
    "rms_norm_eps rope_theta max_position_embeddings bos_token_id tie_word_embeddings"
).split()

# Keys that cannot change the logits of a forward pass at inference, and why.
NO_EFFECT = {
    "architectures": "names the HF class; model_type picks ours",
    "auto_map": "names DeepSeek's remote-code classes",
    "model_type": "checked against MODEL_TYPES",
    "transformers_version": "provenance",
    "_name_or_path": "provenance",
    "torch_dtype": "storage dtype; weights are cast to model.dtype",
    "dtype": "storage dtype; weights are cast to model.dtype",
    "use_cache": "HF generation switch; the runtime always caches latents",
    "initializer_range": "training-time init",
    "attention_dropout": "dropout is off at inference",
    "aux_loss_alpha": "training loss",
    "seq_aux": "training loss",
    "output_router_logits": "HF output switch for the training loss",
    "router_aux_loss_coef": "training loss",
    "pad_token_id": "the runtime never pads a sequence",
    "ep_size": "expert-parallel layout of DeepSeek's code; ours comes from parallel",
    # Multi-token-prediction modules sit after the last decoder layer and only draft extra
    # tokens; the next-token logits never read them (transformers drops their weights too).
    "num_nextn_predict_layers": "MTP draft modules, outside the next-token forward",
    "num_mtp_layers": "MTP draft modules, outside the next-token forward",
}

# Keys accepted only at the value the reference computes with.
ONLY = {
    "hidden_act": ("silu",),  # the op table's activation is SiLU only
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "pretraining_tp": (1, None),
    "moe_layer_freq": (1,),
    "quantization_config": (None,),  # fp8 block-scaled weights are not loaded
}
# Why a refused ONLY value is refused, where "only X is implemented" would not tell a user what
# to do about it.
ONLY_WHY = {
    "quantization_config": (
        "quantized weights (DeepSeek-V3's FP8: float8_e4m3fn `weight` with a block scale "
        "`weight_scale_inv`) are not loaded; dequantize the checkpoint to bfloat16 first"
    ),
}

ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta"},
    "yarn": set(
        "rope_type type rope_theta factor original_max_position_embeddings beta_fast "
        "beta_slow mscale mscale_all_dim attention_factor truncate".split()
    ),
}

# Keys read by the functions below, each computed (or refused) there.
_SPECIAL = set(
    "n_shared_experts num_key_value_heads head_dim qk_head_dim rope_parameters rope_scaling "
    "rope_interleave scoring_func topk_method norm_topk_prob n_group topk_group "
    "eos_token_id".split()
)

# The JSON type of each key read as a number or a switch (null aside), checked before any use.
_JSON_TYPES = {
    **dict.fromkeys(
        (
            "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
            "num_attention_heads q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim "
            "v_head_dim n_routed_experts num_experts_per_tok first_k_dense_replace "
            "max_position_embeddings bos_token_id n_shared_experts num_key_value_heads head_dim "
            "qk_head_dim n_group topk_group"
        ).split(),
        "an int",
    ),
    **dict.fromkeys(("routed_scaling_factor", "rms_norm_eps", "rope_theta"), "a finite number"),
    **dict.fromkeys(("tie_word_embeddings", "norm_topk_prob", "rope_interleave"), "a bool"),
}

# transformers' default (DeepseekV2Config / DeepseekV3Config, 5.x) of each key the runtime reads
# whose own default differs: mostly a full-size model's value, so a file without the key is
# refused by name rather than run with either default.
ABSENT_REFUSED = {
    "deepseek_v2": {
        **dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008),
        **dict(moe_intermediate_size=1407, num_hidden_layers=32, num_attention_heads=32),
        **dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64),
        **dict(v_head_dim=128, n_routed_experts=64, num_experts_per_tok=None),
        **dict(first_k_dense_replace=0, n_shared_experts=2, n_group=None, topk_group=None),
        **dict(bos_token_id=1, eos_token_id=2),
    },
    "deepseek_v3": {
        **dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432),
        **dict(moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128),
        **dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64),
        **dict(v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8),
        **dict(first_k_dense_replace=3, n_shared_experts=1, n_group=8, topk_group=4),
        **dict(routed_scaling_factor=2.5, max_position_embeddings=4096),
        **dict(bos_token_id=0, eos_token_id=1),
    },
}

ROUTING = {  # model type -> (scoring_func it computes, topk_methods it computes, default method)
    "deepseek_v2": ("softmax", ("greedy", "group_limited_greedy"), "greedy"),
    "deepseek_v3": ("sigmoid", ("noaux_tc",), "noaux_tc"),
}


def read_hf_config(path: Path) -> dict[str, Any]:
    """config.json of the checkpoint directory `path` -> ModelConfig keyword arguments."""
    return hf_config_fields(read_config_json(path))


def hf_config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's object (read_config_json) -> ModelConfig keyword arguments."""
    _check_json_types(hf)
    num_mtp_layers(hf)
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model.path: model_type {model_type!r} is not deepseek_v2 or deepseek_v3")
    unread = _unread_by_routing(hf, model_type)
    for key, default in ABSENT_REFUSED[model_type].items():
        if key not in hf and key not in unread:
            raise ValueError(
                f"config.json field {key} is absent: refused, transformers would run "
                f"{model_type} with its default {key}={default!r} and the runtime with another"
            )
    out = {key: hf[key] for key in MAPPED if key in hf}
    out.update(_shape_keys(hf))
    out.update(_rope(hf))
    out.update(_routing(hf, model_type))
    out["eos_token_id"] = _eos(hf.get("eos_token_id"))
    _check_token_ids_in_vocab(hf)
    handled = set(MAPPED) | set(NO_EFFECT) | set(ONLY) | _SPECIAL
    for key, value in hf.items():
        if key in ONLY and value not in ONLY[key]:
            _refuse(key, value, ONLY_WHY.get(key, f"only {ONLY[key][0]!r} is implemented"))
        if key not in handled:
            _refuse(key, value, "this field is not implemented")
    return out


def read_config_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`/config.json; a ValueError naming the file if it is absent or
    not a JSON object."""
    try:
        if not (path / "config.json").is_file():
            raise ValueError(f"checkpoint directory {str(path)!r} has no config.json")
        return read_json_object(path / "config.json")
    except OSError as exc:  # a name too long, no permission
        raise ValueError(f"checkpoint directory {str(path)!r} cannot be read: {exc}") from exc


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object `file` holds (an HF config or tokenizer file); ValueError naming it. A
    key given twice in one object takes its last value, as transformers reads the file, with a
    warning naming it (refusing it would refuse checkpoints transformers and vLLM load)."""

    def last_value_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        repeated = {key for key, count in Counter(key for key, _ in pairs).items() if count > 1}
        for key in sorted(repeated):
            log.warning("%s: key %r appears twice in one object; the last value is used", file, key)
        return dict(pairs)

    try:
        value = json.loads(file.read_text(encoding="utf-8"), object_pairs_hook=last_value_wins)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds a JSON {type(value).__name__}, not an object")
    return value


def num_mtp_layers(hf: dict[str, Any]) -> int:
    """Multi-token-prediction layers the file declares; their weights follow the decoder layers
    (indices num_hidden_layers and up) and are the only layers beyond them a loader may skip."""
    key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf else "num_mtp_layers"
    value = hf.get(key) or 0
    if not is_int(value) or value < 0:
        _refuse(key, value, "must be an int >= 0")
    return value


# Keys with no null meaning (a size, a scale): null is refused as a wrong type, where it
# reached ModelConfig's range checks as a TypeError.
_NOT_NULL = frozenset(
    (
        "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
        "num_attention_heads kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
        "n_routed_experts first_k_dense_replace max_position_embeddings routed_scaling_factor "
        "rms_norm_eps rope_theta"
    ).split()
)


def _check_json_types(hf: dict[str, Any]) -> None:
    """Keys read as numbers or switches must hold one (or null, where null means something):
    refused here, before any arithmetic on them; ModelConfig checks the values."""
    for key, value in hf.items():
        if value is None and key in _NOT_NULL:
            _refuse(key, value, f"must be {_JSON_TYPES[key]}, not null")
        if value is None or key not in _JSON_TYPES:
            continue
        if not _has_type(value, _JSON_TYPES[key]):
            _refuse(key, value, f"must be {_JSON_TYPES[key]}")


def _has_type(value: Any, kind: str) -> bool:
    """Whether value is of `kind` ("a bool", "an int", "a finite number"): JSON's Infinity and
    NaN are no number here (they reached the rotary tables and the logits as NaN)."""
    if kind == "a bool":
        return isinstance(value, bool)
    if kind == "a finite number" and isinstance(value, float):
        return math.isfinite(value)
    return is_int(value)


def _shape_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """Keys that must agree with MLA's shapes; transformers derives head_dim and qk_head_dim
    (writing them back to config.json) and expands the latent to one K/V head per query head."""
    heads, rope_dim = hf.get("num_attention_heads"), hf.get("qk_rope_head_dim")
    qk_dim = (hf.get("qk_nope_head_dim") or 0) + (rope_dim or 0)
    for key, allowed in (
        ("num_key_value_heads", heads),
        ("head_dim", rope_dim),
        ("qk_head_dim", qk_dim),
    ):
        if hf.get(key) not in (None, allowed):
            _refuse(key, hf[key], f"only null or {allowed} is consistent with MLA")
    # DeepSeek's code builds no shared experts when the count is null.
    return {"n_shared_experts": hf.get("n_shared_experts") or 0}


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_scaling (DeepSeek's files, transformers 4) or rope_parameters (transformers 5).

    A non-empty rope_scaling wins, as in transformers 5 (`rope_scaling or rope_parameters`):
    the other mapping is then not read at all, by either side.
    """
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    problem = rope_problem(rope)
    if problem is not None:
        sub, value, why = problem
        _refuse(f"{key}.{sub}" if sub else key, value, why)
    kind = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    # One spelling of the kind (DeepSeek's files write "type", transformers adds "rope_type"),
    # so two saves of one model compare equal (update_weights checks config.json field by field).
    settings = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "rope_type")}
    out["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **settings}
    return out


def rope_problem(rope: object) -> tuple[str, object, str] | None:
    """The first thing wrong with a rope_scaling (or rope_parameters) mapping, as (its sub-key,
    "" for the whole; the value; why), or None: what the rotary tables (model/rope.py) read
    must be there and be numbers, and nothing they would ignore may be set."""
    if not isinstance(rope, dict):
        return "", rope, "must be an object or null"
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_KEYS:
        return "rope_type", kind, "only 'default' and 'yarn' are implemented"
    for sub, value in rope.items():
        if sub not in ROPE_KEYS[kind]:
            return sub, value, f"not implemented for rope_type {kind!r}"
        want = "a bool" if sub == "truncate" else "a finite number"
        if sub not in ("rope_type", "type") and value is not None and not _has_type(value, want):
            return sub, value, f"must be {want}"
    if kind == "yarn":
        for sub in ("factor", "original_max_position_embeddings"):
            if rope.get(sub) is None:
                return sub, rope.get(sub), "YaRN needs it set"
            if rope[sub] <= 0:  # log(factor), log(original / ...) in the tables
                return sub, rope[sub], "must be > 0"
    return None


def _unread_by_routing(hf: dict[str, Any], model_type: str) -> tuple[str, ...]:
    """The group keys when neither side reads them: V2's plain `greedy` top-k ignores groups
    (an absent n_group / topk_group changes no output there, so it is no reason to refuse)."""
    method = hf.get("topk_method") or ROUTING[model_type][2]
    return ("n_group", "topk_group") if method == "greedy" else ()


def _routing(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Router and rope-layout keys, as the model type computes them.

    transformers fixes the scoring function per type (and V3's method); a file naming another is
    refused rather than silently run the type's way. V2's `norm_topk_prob` follows DeepSeek's
    released V2 code, which transformers drops: with top_k > 1 the chosen weights are normalised
    and then *not* scaled by routed_scaling_factor; otherwise they are scaled, not normalised.
    """
    scoring, methods, default_method = ROUTING[model_type]
    if hf.get("scoring_func", scoring) != scoring:
        _refuse("scoring_func", hf["scoring_func"], f"{model_type} computes {scoring!r}")
    if model_type == "deepseek_v2" and "topk_method" in hf and hf["topk_method"] is None:
        # transformers' V2 reads it and fails on null; V3's computes noaux_tc whatever it says
        _refuse("topk_method", None, f"{model_type} reads it: one of {methods}")
    method = hf.get("topk_method") or default_method
    if method not in methods:
        _refuse("topk_method", method, f"{model_type} computes one of {methods}")
    out = {"scoring_func": scoring, "topk_method": method, **_groups(hf, method)}
    if model_type == "deepseek_v3":
        out["norm_topk_prob"] = bool(hf.get("norm_topk_prob", True))
        out["rope_interleave"] = bool(hf.get("rope_interleave", True))
        return out
    if hf.get("rope_interleave") is False:
        _refuse("rope_interleave", False, "deepseek_v2 always rotates interleaved pairs")
    out["rope_interleave"] = True
    top_k = hf.get("num_experts_per_tok") or 1
    out["norm_topk_prob"] = bool(hf.get("norm_topk_prob")) and top_k > 1
    if out["norm_topk_prob"]:
        out["routed_scaling_factor"] = 1.0  # DeepSeek-V2: normalise *or* scale, never both
        log.warning(
            "config.json: norm_topk_prob is true for deepseek_v2: the chosen experts' weights "
            "are normalised and not scaled, as DeepSeek's released V2 code does; transformers' "
            "DeepseekV2 ignores the key, so its logits differ from these"
        )
    return out


def _groups(hf: dict[str, Any], method: str) -> dict[str, int]:
    """n_group and topk_group: what the file says where the method reads them (an int >= 1;
    a null or 0 was read as 1, one eligible group, where transformers fails on a null and
    routes a 0 its own way), else 1 (plain greedy reads neither)."""
    if method == "greedy":
        return {"n_group": 1, "topk_group": 1}
    for key in ("n_group", "topk_group"):  # absent: refused by read_hf_config already
        value = hf.get(key)
        if not is_int(value) or value < 1:
            _refuse(key, value, f"{method} routing reads it: an int >= 1")
    return {"n_group": hf["n_group"], "topk_group": hf["topk_group"]}


def read_generation_eos_ids(path: Path, hf: dict[str, Any]) -> tuple[int, ...]:
    """The ids that end a sample besides config.json's first eos_token_id, as transformers'
    generate takes them: generation_config.json's eos_token_id (an int or a list; a chat
    model's end of turn among them) in the checkpoint directory `path`, or without that file
    the eos_token_id of `hf` (config.json's object, read once by the caller) where it is a list
    (GenerationConfig.from_model_config copies it); () where neither says more. ValueError
    naming the file for a value that is not an int, a list of ints or null."""
    file = path / "generation_config.json"
    if not file.is_file():
        value = hf.get("eos_token_id")
        return tuple(value) if isinstance(value, list) else ()  # checked by _eos
    value = read_json_object(file).get("eos_token_id")
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(is_int(i) for i in ids):
        raise ValueError(
            f"{file}: eos_token_id must be an int, a list of ints or null, got {value!r}"
        )
    outside = _outside_vocab(ids, hf.get("vocab_size"))
    if outside is not None:
        raise ValueError(
            f"{file}: eos_token_id={value!r} is refused: id {outside} is outside "
            f"[0, vocab_size={hf['vocab_size']}) of config.json"
        )
    return tuple(ids)


def _check_token_ids_in_vocab(hf: dict[str, Any]) -> None:
    """bos_token_id and every id of eos_token_id in [0, vocab_size), else refused naming the
    file, the key and the value (ModelConfig's own check named model.<key>, which the YAML
    does not hold, and missed a list's later ids as generation_eos_token_ids); never clamped."""
    for key in ("bos_token_id", "eos_token_id"):
        value = hf.get(key)
        outside = _outside_vocab(value if isinstance(value, list) else [value], hf["vocab_size"])
        if outside is not None:
            _refuse(key, value, f"id {outside} is outside [0, vocab_size={hf['vocab_size']})")


def _outside_vocab(ids: list[Any], vocab_size: Any) -> int | None:
    """The first int of `ids` outside [0, vocab_size), or None (also where vocab_size is no
    int >= 1: ModelConfig refuses that by its own name)."""
    if not is_int(vocab_size) or vocab_size < 1:
        return None
    return next((i for i in ids if is_int(i) and not 0 <= i < vocab_size), None)


def _eos(value: Any) -> Any:
    """config.json's eos_token_id: the first of a list (every id of it ends a sample where no
    generation_config.json says otherwise: read_generation_eos_ids)."""
    ids = value if isinstance(value, list) else [value]
    if not all(is_int(i) or i is None for i in ids) or (len(ids) > 1 and None in ids):
        _refuse("eos_token_id", value, "must be an int, null or a list of ints")
    return ids[0] if ids else None


def _refuse(key: str, value: object, why: str) -> None:
    raise ValueError(f"config.json field {key}={value!r} is refused: {why}")
