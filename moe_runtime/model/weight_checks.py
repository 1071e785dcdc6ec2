"""Checks of HF-named weights before they reach a model: names, shapes, dtypes and finite
values (ValueError naming the first bad tensor and the source), the per-expert tensors stacked
by local slot, and the copy into the model's parameters. Used at load (model/loader.py) and by
weight updates, which check every rank's tensors before any rank changes anything (a state
dict's tensors cut per rank first: rank_shares).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe_runtime.model.deepseek import DeepseekForCausalLM
from moe_runtime.model_config import ModelConfig

EXPERT_KEY = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
# transformers' in-memory layout of a layer's routed experts (5.x: fused, one row a logical
# expert, gate rows before up rows), by the names the runtime's own parameters have.
FUSED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
SHARED_KEY = re.compile(r"^model\.layers\.\d+\.mlp\.shared_experts\.")


def check_weights(
    model: DeepseekForCausalLM,
    tensors: dict[str, torch.Tensor],
    local_experts: list[list[int]],
    source: str,
) -> dict[str, torch.Tensor]:
    """HF-named tensors (or meta tensors of their headers) -> this rank's value of every
    parameter, every name, shape and dtype checked, and every value finite (ValueError naming
    the first bad one); the model is not touched."""
    cfg = model.config
    refuse_quantized(tensors, source)
    tensors = unfuse_experts(tensors, cfg, source)
    tensors = {k: v for k, v in tensors.items() if not is_absent_shared_expert(k, v.shape, cfg)}
    _check_experts(tensors, cfg, source)
    check_finite(tensors, source, model.dtype)
    tensors = drop_tied_head(tensors, cfg, source)
    tensors = stack_experts(tensors, local_experts, model.config.first_k_dense_replace)
    params = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        params.pop("lm_head.weight", None)
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"weights {source!r} do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    # The whole tensor against the whole parameter, then cut: a cut of a wrong shape can fit a
    # rank (rank 0's 64 rows of 127 where 128 were due), and its shape is none the file holds.
    for name, param in params.items():
        _check_tensor(tensors[name], model.tp.full_shape(name, param.shape), name, source)
    return {name: model.tp.shard(name, tensors[name]) for name in params}


def refuse_quantized(tensors: dict[str, torch.Tensor], source: str) -> None:
    """ValueError naming the first float8 weight or block scale: an FP8 block-quantized
    checkpoint (DeepSeek-V3 stores `weight` in float8_e4m3fn and `weight_scale_inv` [rows/128,
    cols/128]) needs its scales applied, which the loader does not do. Why here, first: the
    scales were refused as unexpected names, or an expert's float8 dtype, with no word of what
    the checkpoint is or what to do (a config.json declaring it is refused before: hf_config)."""
    for key, value in tensors.items():
        if key.endswith("_scale_inv") or value.dtype in FLOAT8_DTYPES:
            raise ValueError(
                f"weights {source!r}: tensor {key} is {tuple(value.shape)} {value.dtype}, "
                "part of an FP8 block-quantized checkpoint (float8 `weight` with a "
                "`weight_scale_inv` block scale), which is not loaded; dequantize it to "
                "bfloat16 first"
            )


def rank_shares(
    tensors: dict[str, torch.Tensor], local_experts: list[list[list[int]]], cfg: ModelConfig
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """An HF-named state dict cut for ranks holding `local_experts` ([ranks][MoE layers][slots]
    logical ids): (the part every rank reads, each rank's own). Every rank reads all but the
    per-expert tensors; each also reads the experts it holds a slot of. So the common part
    can be shipped once for all ranks, and no rank is sent an expert it does not hold. Names no
    rank holds (an expert past the model's, a dense layer's) go in the common part, for every
    rank's checks to refuse; every expert is held by some rank, which checks it."""
    common, own = {}, [{} for _ in local_experts]
    held = [[set(layer) for layer in rank] for rank in local_experts]
    for key, value in tensors.items():
        slot = _routed_expert(key, cfg)
        if slot is None:
            common[key] = value
            continue
        layer, expert = slot
        for rank, layers in enumerate(held):
            if expert in layers[layer]:
                own[rank][key] = value
    return common, own


def _routed_expert(key: str, cfg: ModelConfig) -> tuple[int, int] | None:
    """(MoE layer, logical expert) of a routed expert's tensor of the model, else None."""
    match = EXPERT_KEY.match(key)
    if match is None:
        return None
    layer = int(LAYER_KEY.match(key).group(1)) - cfg.first_k_dense_replace
    expert = int(match.group(2))
    if 0 <= layer < cfg.num_moe_layers and expert < cfg.n_routed_experts:
        return layer, expert
    return None


def unfuse_experts(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """`tensors` with transformers' fused expert tensors (a layer's `mlp.experts.gate_up_proj`
    [E, 2I, D] and `down_proj` [E, D, I], row e logical expert e: its state_dict() from 5.x)
    as per-expert tensors (views), so they are placed by logical expert like a checkpoint's.
    Why: the runtime's parameters have the same names, indexed by local slot; copied as they
    were, row e went to slot e, which after a rebalance (or with expert parallelism or
    redundant experts) holds another expert: wrong weights with no error, or a refusal quoting
    the runtime's slot shape. A fused tensor without a row for each of the model's
    n_routed_experts is a ValueError naming it."""
    if not any(FUSED_KEY.match(key) for key in tensors):
        return tensors
    inter, hidden, num = cfg.moe_intermediate_size, cfg.hidden_size, cfg.n_routed_experts
    shapes = {"gate_up_proj": (num, 2 * inter, hidden), "down_proj": (num, hidden, inter)}
    # A layer's first per-expert tensor: with its fused one too, an expert has two values.
    apart = {}
    for key in tensors:
        match = EXPERT_KEY.match(key)
        if match is not None:
            apart.setdefault(match.group(1), key)
    out = {}
    for key, value in tensors.items():
        match = FUSED_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        prefix, name = match.groups()
        both = apart.get(prefix)
        if both is not None:
            raise ValueError(
                f"weights {source!r}: both the fused tensor {key} and the per-expert {both}: "
                "one expert would have two values (give each expert's weights once)"
            )
        if tuple(value.shape) != shapes[name]:
            raise ValueError(
                f"weights {source!r}: tensor {key} is {tuple(value.shape)}; as transformers' "
                f"fused experts it must be {shapes[name]} (one row for each of the model's "
                f"{num} routed experts)"
            )
        for expert in range(num):
            if name == "down_proj":
                out[f"{prefix}.{expert}.down_proj.weight"] = value[expert]
            else:
                out[f"{prefix}.{expert}.gate_proj.weight"] = value[expert, :inter]
                out[f"{prefix}.{expert}.up_proj.weight"] = value[expert, inter:]
    return out


def is_absent_shared_expert(key: str, shape: Sequence[int], cfg: ModelConfig) -> bool:
    """An empty shared-expert tensor of a model without shared experts: transformers builds the
    MLP at width 0 and saves its zero-element weights; there is nothing to load."""
    return cfg.n_shared_experts == 0 and 0 in shape and SHARED_KEY.match(key) is not None


def drop_tied_head(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """`tensors` without a stored lm_head.weight that tie_word_embeddings makes the embedding:
    dropped only if equal to it, since transformers keeps a different stored head untied
    (ValueError). Meta tensors (headers) are kept here and compared once read."""
    head = tensors.get("lm_head.weight")
    if not cfg.tie_word_embeddings or head is None or head.is_meta:
        return tensors
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None or not torch.equal(head, embed):
        raise ValueError(
            f"weights {source!r}: config.json sets tie_word_embeddings=True but the stored "
            "lm_head.weight differs from model.embed_tokens.weight (transformers would keep "
            "it untied)"
        )
    return {key: value for key, value in tensors.items() if key != "lm_head.weight"}


def _check_experts(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> None:
    """Every per-expert tensor, of every expert present (a restart may place them elsewhere),
    one by one: a routed expert of a MoE layer, its HF shape, a floating dtype, and its
    expert's other two projections present. Before stacking, because torch.cat promotes an
    int tensor among float ones and torch.stack's shape error names no tensor."""
    gate_up = (cfg.moe_intermediate_size, cfg.hidden_size)
    shapes = {"gate_proj": gate_up, "up_proj": gate_up, "down_proj": gate_up[::-1]}
    projs: dict[str, set[str]] = {}
    for key, value in tensors.items():
        match = EXPERT_KEY.match(key)
        if match is None:
            continue
        prefix, expert = match.group(1), int(match.group(2))
        layer_id = int(LAYER_KEY.match(key).group(1))
        is_moe = cfg.first_k_dense_replace <= layer_id < cfg.num_hidden_layers
        if not is_moe or expert >= cfg.n_routed_experts:
            raise ValueError(
                f"weights {source!r}: unexpected tensor {key} (the model has "
                f"{cfg.n_routed_experts} routed experts in layers "
                f"{cfg.first_k_dense_replace}..{cfg.num_hidden_layers - 1})"
            )
        _check_tensor(value, shapes[match.group(3)], key, source)
        projs.setdefault(f"{prefix}.{expert}", set()).add(match.group(3))
    for name, present in sorted(projs.items()):
        absent = sorted(set(shapes) - present)
        if absent:
            raise ValueError(f"weights {source!r}: checkpoint lacks {name}.{absent[0]}.weight")


# The dtypes a weight may be stored in: cast exactly or rounded once to the model's dtype.
# float8 needs the scales of a quantized checkpoint (not loaded); torch.cat of an expert's
# projections refused to promote one among others, an error naming no tensor.
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT8_DTYPES = (
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
)


def _check_tensor(value: torch.Tensor, shape: Sequence[int], name: str, source: str) -> None:
    if tuple(value.shape) != tuple(shape) or value.dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"weights {source!r}: tensor {name} is {tuple(value.shape)} {value.dtype}, the "
            f"model expects {tuple(shape)} float16, bfloat16, float32 or float64"
        )


def check_finite(
    tensors: dict[str, torch.Tensor], source: str, dtype: torch.dtype | None = None
) -> None:
    """ValueError naming the first tensor holding a NaN or an infinity (a diverged trainer's
    update, a damaged file), or, with dtype (the model's), a value that rounds to an infinity
    in it (float64 past float32's range, or float32 within 0.2% of its largest as bfloat16):
    served, it would give every request garbage or NaN logprobs with no error. Meta tensors
    (headers) are skipped; one device sync a tensor. The test is the tensor's min and max (both
    NaN if any value is; an infinity is one of them; rounding is monotonic, so a value
    overflows the cast only if one of them does): one vectorized pass, ~60x faster than
    isfinite on the CPU, where an update's tensors are read."""
    for key, value in tensors.items():
        if value.is_meta or not value.dtype.is_floating_point or not value.numel():
            continue  # the dtype checks name a non-float tensor
        # no float8 min/max kernels everywhere: widened, each value keeps its NaN-ness
        wide = value.to(torch.bfloat16) if value.dtype.itemsize == 1 else value
        extremes = torch.stack(torch.aminmax(wide))
        cast = extremes if dtype is None else extremes.to(dtype)
        is_finite, is_cast_finite = torch.stack(
            [torch.isfinite(extremes).all(), torch.isfinite(cast).all()]
        ).tolist()
        if not is_finite:
            bad = int(wide.numel() - torch.isfinite(wide).sum())
            raise ValueError(
                f"weights {source!r}: tensor {key} holds {bad} non-finite value"
                f"{'s' * (bad > 1)} (NaN or infinity) of {value.numel()}"
            )
        if not is_cast_finite:
            largest = float(extremes.abs().max())
            raise ValueError(
                f"weights {source!r}: tensor {key} holds a value of magnitude {largest:.6g}, "
                f"which is an infinity as the model's {dtype} (largest finite "
                f"{torch.finfo(dtype).max:.6g})"
            )


def assign_weights(model: DeepseekForCausalLM, values: dict[str, torch.Tensor | SlotRows]) -> None:
    """Copy checked values (check_weights) into the model's parameters (a SlotRows value row by
    row): host tensors of the parameter's dtype into GPU ones through pinned buffers
    (HostToDevice), any other through copy_, which casts the dtype and crosses devices itself.
    Returns once every copy from the host is done; one from a device tensor is queued on the
    current stream, as copy_ queues it (the model's next kernels there run after it)."""
    params = dict(model.named_parameters())
    to_device = HostToDevice()
    with torch.no_grad():
        for name, value in values.items():
            if isinstance(value, SlotRows):
                value.copy_into(params[name], to_device)
            else:
                to_device.copy(params[name], value)
    to_device.finish()


# A pinned buffer's bytes (HostToDevice has two).
HOST_CHUNK_BYTES = 64 << 20


class HostToDevice:
    """dst.copy_(src) for a host src and a CUDA dst of one dtype, both contiguous, through two
    pinned buffers in turn: each chunk is copied into one on the host while the other's goes
    to the GPU. Why: copy_ from pageable memory ran at ~5 GB/s (H100: 6.6 s of an 8.7 s update
    of V2-Lite's 31 GB from a trainer's host state dict; bench/weight_update.py), and pinning
    the caller's tensors took longer than the update. Other pairs go through copy_."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        is_staged = (
            src.device.type == "cpu"
            and dst.is_cuda
            and src.dtype == dst.dtype
            and src.is_contiguous()
            and dst.is_contiguous()
            and not src.is_pinned()
            and src.numel() > 0
        )
        if not is_staged:
            dst.copy_(src)
            return
        if not self._buffers:
            self._buffers = [
                torch.empty(HOST_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
        src_bytes, dst_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        with torch.cuda.device(dst.device):
            for start in range(0, src_bytes.numel(), HOST_CHUNK_BYTES):
                piece = src_bytes[start : start + HOST_CHUNK_BYTES]
                if self._events[self._turn] is not None:
                    self._events[self._turn].synchronize()  # its last chunk has left
                staged = self._buffers[self._turn][: piece.numel()]
                staged.copy_(piece)
                dst_bytes[start : start + piece.numel()].copy_(staged, non_blocking=True)
                self._events[self._turn] = torch.cuda.Event()
                self._events[self._turn].record()
                self._turn ^= 1

    def finish(self) -> None:
        """Wait for every copy in flight (the buffers are then free, the values in place)."""
        for event in self._events:
            if event is not None:
                event.synchronize()


@dataclass(frozen=True)
class SlotRows:
    """A stacked expert parameter's value (gate_up_proj or down_proj, [slots, rows, cols]) as
    each slot's source tensors, to be copied in place (assign_weights): slot s's rows are its
    parts' rows in order (gate then up; down). Why not torch.stack: that staged a copy of
    every routed expert on the source's device, ~29 GB at V2-Lite beside the served model and
    the caller's state dict (an update from a trainer's device tensors ran out of memory on an
    80 GB GPU), and a pass over them all before the copy in."""

    parts: tuple[tuple[torch.Tensor, ...], ...]  # [slot][part], each [rows, cols]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0]
        return (len(self.parts), sum(p.shape[0] for p in first), *first[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        """The first part's (every part's dtype is checked one by one: _check_experts)."""
        return self.parts[0][0].dtype

    def copy_into(self, param: torch.Tensor, to_device: HostToDevice) -> None:
        for slot, parts in enumerate(self.parts):
            start = 0
            for part in parts:
                to_device.copy(param[slot, start : start + part.shape[0]], part)
                start += part.shape[0]

    def stacked(self) -> torch.Tensor:
        """The value as one tensor (a copy)."""
        return torch.stack([torch.cat(parts) for parts in self.parts])


def stack_experts(
    tensors: dict[str, torch.Tensor], local_experts: list[list[int]], first_moe: int
) -> dict[str, torch.Tensor | SlotRows]:
    """Per-expert checkpoint tensors -> gate_up_proj / down_proj for the local slots, as
    SlotRows (no copy)."""
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for key, value in tensors.items():
        match = EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        per_expert.setdefault(prefix, {}).setdefault(expert, {})[proj] = value
    for prefix, experts in per_expert.items():
        expert_ids = local_experts[int(prefix.split(".")[2]) - first_moe]
        absent = [e for e in expert_ids if e not in experts]
        if absent:
            raise ValueError(f"checkpoint lacks {prefix}.{absent[0]}")
        out[f"{prefix}.gate_up_proj"] = SlotRows(
            tuple((experts[e]["gate_proj"], experts[e]["up_proj"]) for e in expert_ids)
        )
        out[f"{prefix}.down_proj"] = SlotRows(tuple((experts[e]["down_proj"],) for e in expert_ids))
    return out
