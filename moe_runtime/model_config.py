"""ModelConfig: the architecture of a DeepSeek-style MoE model, and where its weights come from.

Built from the YAML `model` section (random weights drawn from `seed`) or from an HF
DeepSeek-V2/V3 `config.json` when `path` names a checkpoint directory (read, and its unsupported
fields refused, by `moe_runtime.model.hf_config`). Field names follow the HF configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_runtime.config_fields import check_section
from moe_runtime.model.hf_config import (
    hf_config_fields,
    read_config_json,
    read_generation_eos_ids,
    rope_problem,
)

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
DTYPES = ("float32", "bfloat16")
_POSITIVE_INTS = (
    "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
    "num_attention_heads kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
    "n_routed_experts num_experts_per_tok n_group topk_group max_position_embeddings"
).split()


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None
    dtype: str = "float32"
    seed: int = 0
    init_std: float = 0.02
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    n_group: int = 4
    topk_group: int = 2
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # generation_config.json's eos_token_id ids (read from `path`): they end a sample as EOS too
    generation_eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        self._check_keys()
        self._check_experts()
        self._check_scales()
        self._check_rope_scaling()
        self._check_token_ids()

    def _check_keys(self) -> None:
        """Each key on its own: positive ints, q_lora_rank, the named choices, an even rope dim."""
        for key in _POSITIVE_INTS:
            value = getattr(self, key)
            _require(isinstance(value, int) and value >= 1, key, value, "an int >= 1")
        _require(
            self.q_lora_rank is None
            or (isinstance(self.q_lora_rank, int) and self.q_lora_rank >= 1),
            "q_lora_rank",
            self.q_lora_rank,
            "null or an int >= 1",
        )
        for key, choices in (
            ("dtype", DTYPES),
            ("scoring_func", SCORING_FUNCS),
            ("topk_method", TOPK_METHODS),
        ):
            value = getattr(self, key)
            _require(value in choices, key, value, f"one of {choices}")
        _require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim, "even")

    def _check_experts(self) -> None:
        """The routed experts against their groups and top-k, the shared experts, and the
        dense layers before the first MoE one."""
        _require(
            self.n_routed_experts % self.n_group == 0,
            "n_group",
            self.n_group,
            f"a divisor of n_routed_experts ({self.n_routed_experts})",
        )
        _require(
            self.num_experts_per_tok <= self.n_routed_experts,
            "num_experts_per_tok",
            self.num_experts_per_tok,
            f"<= n_routed_experts ({self.n_routed_experts})",
        )
        if self.topk_method != "greedy":
            self._check_groups()
        _require(
            isinstance(self.n_shared_experts, int) and self.n_shared_experts >= 0,
            "n_shared_experts",
            self.n_shared_experts,
            "an int >= 0",
        )
        _require(
            0 <= self.first_k_dense_replace <= self.num_hidden_layers,
            "first_k_dense_replace",
            self.first_k_dense_replace,
            f"in [0, num_hidden_layers={self.num_hidden_layers}]",
        )

    def _check_scales(self) -> None:
        _require(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "> 0")
        # Why: a rope_theta <= 0 gives NaN rotations, a negative scale flips every routed
        # expert's sign, a negative std is no distribution: each ran before, to noise.
        _require(self.rope_theta > 0, "rope_theta", self.rope_theta, "> 0")
        scale = self.routed_scaling_factor
        _require(scale > 0, "routed_scaling_factor", scale, "> 0")
        _require(self.init_std >= 0, "init_std", self.init_std, ">= 0")

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling is None:
            return
        problem = rope_problem(self.rope_scaling)
        if problem is None and "rope_theta" in self.rope_scaling:  # read from model.rope_theta
            problem = ("rope_theta", self.rope_scaling["rope_theta"], "set model.rope_theta")
        if problem is not None:
            sub, value, why = problem
            name = f"rope_scaling.{sub}" if sub else "rope_scaling"
            raise ValueError(f"model.{name}={value!r} is refused: {why}")

    def _check_token_ids(self) -> None:
        for key in ("bos_token_id", "eos_token_id"):
            value = getattr(self, key)
            _require(
                value is None or 0 <= value < self.vocab_size,
                key,
                value,
                f"null or in [0, vocab_size={self.vocab_size})",
            )
        ids = self.generation_eos_token_ids
        _require(
            isinstance(ids, (list, tuple))
            and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            and all(0 <= i < self.vocab_size for i in ids),
            "generation_eos_token_ids",
            ids,
            f"a list of ids in [0, vocab_size={self.vocab_size})",
        )

    def _check_groups(self) -> None:
        """Group-limited routing the reference computes: topk_group of n_group groups, top_k
        within the experts of the eligible groups (transformers masks the others to a score of
        0.0 and may pick them), and noaux_tc's group score, the sum of a group's top 2, from
        groups of 2 or more. (Plain `greedy` reads no group key; n_group only places experts,
        for EPLB's hierarchical policy.)"""
        _require(
            self.topk_group <= self.n_group,
            "topk_group",
            self.topk_group,
            f"<= n_group ({self.n_group}) under topk_method {self.topk_method!r}",
        )
        per_group = self.n_routed_experts // self.n_group
        _require(
            self.num_experts_per_tok <= self.topk_group * per_group,
            "num_experts_per_tok",
            self.num_experts_per_tok,
            f"<= topk_group * n_routed_experts / n_group ({self.topk_group} * "
            f"{self.n_routed_experts} / {self.n_group}) under topk_method {self.topk_method!r}",
        )
        if self.topk_method == "noaux_tc":
            _require(
                per_group >= 2,
                "n_group",
                self.n_group,
                f"<= n_routed_experts / 2 ({self.n_routed_experts} / 2) under noaux_tc",
            )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sample as EOS (unless it ignores EOS), once each: eos_token_id
        and generation_config.json's, as transformers' generate stops on the latter and vLLM
        on both."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return tuple(dict.fromkeys((*first, *self.generation_eos_token_ids)))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached KV row: the compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in_dim K, out_dim N) of every distinct linear weight (no TP split), with
        gate and up fused as the runtime runs them; benchmarks and kernel tests sweep these."""
        heads, hidden = self.num_attention_heads, self.hidden_size
        q_in = hidden if self.q_lora_rank is None else self.q_lora_rank
        return [
            ("q_proj", q_in, heads * self.qk_head_dim),
            ("kv_a", hidden, self.latent_dim),
            ("kv_b", self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim)),
            ("o_proj", heads * self.v_head_dim, hidden),
            ("mlp_gate_up", hidden, 2 * self.intermediate_size),
            ("mlp_down", self.intermediate_size, hidden),
            ("expert_gate_up", hidden, 2 * self.moe_intermediate_size),
            ("expert_down", self.moe_intermediate_size, hidden),
            ("lm_head", hidden, self.vocab_size),
        ]

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is the routed MoE (every layer after the first dense ones)."""
        return max(self.num_hidden_layers - self.first_k_dense_replace, 0)

    @property
    def routed_width(self) -> tuple[int, int]:
        """(MoE layers, K): the shape of one token's routed experts, an output's rows being
        [T, MoE layers, K]."""
        return self.num_moe_layers, self.num_experts_per_tok

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the YAML section; with `path`, the architecture comes from config.json."""
        check_section("model", cls, raw)  # the YAML's values; config.json's are read apart
        raw = dict(raw)
        if isinstance(raw.get("path"), str) and not raw["path"].strip():
            # `path: ${CKPT}` with the variable unset: random weights served as if the
            # checkpoint's, with no word
            raise ValueError(
                f"model.path is empty ({raw['path']!r}): a checkpoint directory, or null (or no "
                "key) for random weights"
            )
        if raw.get("path"):
            path = Path(raw["path"])
            hf_json = read_config_json(path)  # once: both readers below take its object
            hf = {
                **hf_config_fields(hf_json),
                "generation_eos_token_ids": read_generation_eos_ids(path, hf_json),
            }
            clash = sorted(set(raw) & set(hf))
            if clash:
                is_generation = clash[0] == "generation_eos_token_ids"
                source = "generation_config.json" if is_generation else "config.json"
                raise ValueError(
                    f"model.{clash[0]} is set in the YAML but comes from {raw['path']}/{source}"
                )
            raw.update(hf)
        if isinstance(raw.get("generation_eos_token_ids"), list):  # YAML's; a config is hashable
            raw["generation_eos_token_ids"] = tuple(raw["generation_eos_token_ids"])
        return cls(**raw)


def _require(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"model.{key} must be {expected}, got {value!r}")
