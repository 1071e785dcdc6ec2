"""Model weights: HF DeepSeek-V2/V3 safetensors checkpoints, or random weights from a seed.

Parameters are allocated on the target device and written there (no host copy of the model).
HF names map one to one except the routed experts, stored per expert in checkpoints
(`mlp.experts.{e}.gate_proj.weight`, ...) and stacked here by local slot
(`mlp.experts.gate_up_proj [L, 2I, D]`, `mlp.experts.down_proj [L, D, I]`).
`local_experts [L_moe][slots]` lists the logical expert each local slot holds per MoE layer, so
a rank reads, or draws, only its own. Random weights are a pure function of (seed, parameter
name, element index): the same bits on every device, dtype-cast aside, and in every layout
(the draw is moe_runtime.model.random_weights).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from moe_kernels import OpTable
from moe_runtime.model.deepseek import DeepseekForCausalLM
from moe_runtime.model.hf_config import (
    num_mtp_layers,
    read_config_json,
    read_hf_config,
    read_json_object,
)
from moe_runtime.model.layers import NO_TP
from moe_runtime.model.random_weights import CHUNK_NUMEL, fill_uniform, weight_key
from moe_runtime.model.tensor_parallel import TensorParallel, shard_dim
from moe_runtime.model.weight_checks import (
    EXPERT_KEY,
    LAYER_KEY,
    assign_weights,
    check_finite,
    check_weights,
    drop_tied_head,
    is_absent_shared_expert,
    stack_experts,
    unfuse_experts,
)
from moe_runtime.model_config import ModelConfig

log = logging.getLogger("moe_runtime.loader")

_EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_BIAS_BOUND = 0.1  # e_score_correction_bias is uniform in [-0.1, 0.1)
_LOG_EVERY_S = 5.0
INDEX_FILE = "model.safetensors.index.json"  # HF's map of a sharded checkpoint's tensors

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def build_model(
    cfg: ModelConfig,
    ops: OpTable,
    device: torch.device | str = "cpu",
    local_experts: Sequence[Sequence[int]] | None = None,
    tp: TensorParallel = NO_TP,
) -> DeepseekForCausalLM:
    start, device = time.monotonic(), torch.device(device)
    num_moe = cfg.num_moe_layers
    if local_experts is None:
        local_experts = [range(cfg.n_routed_experts)] * num_moe
    local_experts = [[int(e) for e in row] for row in local_experts]
    if len(local_experts) != num_moe or len({len(row) for row in local_experts}) > 1:
        raise ValueError(f"local_experts must hold one equal-length row per MoE layer ({num_moe})")
    with _parameters_on(device):
        num_slots = len(local_experts[0]) if local_experts else None
        model = DeepseekForCausalLM(cfg, ops, num_slots, tp)
    if cfg.path:
        load_hf_weights(model, Path(cfg.path), local_experts, device)
    else:
        init_random_weights(model, cfg.seed, cfg.init_std, local_experts)
    model.to(device)  # the rope tables, tabulated on the host; the parameters are there already
    model.after_weights_loaded()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: the time logged includes the queued writes
        torch.cuda.empty_cache()  # the KV cache is sized from the free memory the driver reports
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log.info(
        "weights ready in %.1f s (%.2f GiB on %s)",
        time.monotonic() - start,
        num_bytes / 2**30,
        device,
    )
    return model


@contextmanager
def _parameters_on(device: torch.device) -> Iterator[None]:
    """Modules built inside get their parameters allocated on `device`, uninitialised (every
    loader path writes all of them); other tensors (the rope tables) stay where they are made."""

    def allocate(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        if param is None or param.device == device:
            return None
        return nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)

    handle = register_module_parameter_registration_hook(allocate)
    try:
        yield
    finally:
        handle.remove()


def init_random_weights(
    model: DeepseekForCausalLM,
    seed: int,
    std: float,
    local_experts: list[list[int]],
    chunk_numel: int = CHUNK_NUMEL,
) -> None:
    """Draw every weight where it lives: uniform with standard deviation `std`, norm weights 1,
    e_score_correction_bias uniform in [-0.1, 0.1).

    Each element is a pure function of (seed, name, its index in the full tensor): a TP rank
    draws exactly its slice of the full weight, and routed experts are keyed by logical expert
    (`...experts.{e}.gate_up_proj`), so a rank holding a subset gets the world-1 values.
    """
    first_moe = model.config.first_k_dense_replace
    progress = _Progress("random weights", model.config.num_hidden_layers)
    bound = std * math.sqrt(3)  # a uniform on [-b, b) has standard deviation b / sqrt(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(_EXPERT_PARAMS):
                prefix, proj = name.rsplit(".", 1)
                layer_id = int(LAYER_KEY.match(name).group(1))
                for slot, logical in enumerate(local_experts[layer_id - first_moe]):
                    key = weight_key(seed, f"{prefix}.{logical}.{proj}")
                    fill_uniform(param[slot], key, bound, chunk_numel)
            else:
                is_bias = name.endswith("e_score_correction_bias")
                first, full_cols = _shard_start(model.tp, name, param.shape)
                key = weight_key(seed, name)
                fill_uniform(
                    param, key, _BIAS_BOUND if is_bias else bound, chunk_numel, first, full_cols
                )
            progress.update(name)


def _shard_start(tp: TensorParallel, name: str, shape: torch.Size) -> tuple[int, int]:
    """(id of this rank's first element in the full tensor, full row length): tp.shard takes
    equal chunks along dim 0 (rows) or the last dim (columns) of 2-D weights."""
    dim = shard_dim(name)
    if tp.size == 1 or dim is None:
        return 0, shape[-1] if shape else 1
    full = tp.full_shape(name, shape)
    return tp.rank * shape[dim] * math.prod(full[dim + 1 :]), full[-1]


class _Progress:
    """One log line every few seconds while the layers are written, with the elapsed time."""

    def __init__(self, what: str, num_layers: int) -> None:
        self.what, self.num_layers = what, num_layers
        self.start = self.last = time.monotonic()

    def update(self, name: str) -> None:
        now = time.monotonic()
        layer = LAYER_KEY.match(name)
        if layer is None or now - self.last < _LOG_EVERY_S:
            return
        self.last = now
        done = int(layer.group(1)) + 1
        log.info("%s: at layer %d/%d, %.1f s", self.what, done, self.num_layers, now - self.start)


def load_hf_weights(
    model: DeepseekForCausalLM,
    path: Path,
    local_experts: list[list[int]],
    device: torch.device | str = "cpu",
) -> None:
    """Check every name, shape and dtype from the safetensors headers (nothing read yet), then
    read this rank's tensors straight onto `device`, one decoder layer at a time, into the
    parameters; other ranks' experts and multi-token-prediction layers are never read."""
    cfg = model.config
    progress = _Progress("checkpoint", cfg.num_hidden_layers)
    with _open_checkpoint(path, cfg, device) as handles:
        headers = {key: _header(handle, key, path) for key, handle in handles.items()}
        check_weights(model, headers, local_experts, str(path))
        for keys in _read_groups(handles, local_experts, cfg):
            tensors = {key: handles[key].get_tensor(key) for key in keys}
            tensors = unfuse_experts(tensors, cfg, str(path))  # a layer's, read whole
            check_finite(tensors, str(path), model.dtype)
            tensors = drop_tied_head(tensors, cfg, str(path))
            stacked = stack_experts(tensors, local_experts, cfg.first_k_dense_replace)
            assign_weights(model, {name: model.tp.shard(name, v) for name, v in stacked.items()})
            progress.update(keys[0])


def read_checkpoint(
    path: Path, cfg: ModelConfig, local_experts: list[list[int]] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of another HF checkpoint directory for the running model `cfg`, by HF name,
    read into host memory (a weight update stages it there); with `local_experts` (a rank's
    logical experts a MoE layer), other ranks' per-expert tensors are meta tensors of their
    headers, checked by name, shape and dtype but not read (every rank read the whole
    checkpoint: ~31 GB a rank of V2-Lite, 250 GB of host memory on a node of EP = 8, where
    start-up reads each rank's share). Its config.json must give every field it sets the value
    `cfg` holds: the weights are served under `cfg`, which a weight update does not change."""
    try:
        new = read_hf_config(path)
    except ValueError as exc:
        raise ValueError(f"weights {str(path)!r}: {exc}") from exc
    differs = next((key for key, value in new.items() if getattr(cfg, key) != value), None)
    if differs is not None:
        raise ValueError(
            f"weights {str(path)!r}: config.json has {differs}={new[differs]!r}, the running "
            f"model has {getattr(cfg, differs)!r}"
        )
    with _open_checkpoint(path, cfg, "cpu") as handles:
        if local_experts is None:
            return {key: handle.get_tensor(key) for key, handle in handles.items()}
        read = {key for keys in _read_groups(handles, local_experts, cfg) for key in keys}
        return {
            key: handle.get_tensor(key) if key in read else _header(handle, key, path)
            for key, handle in handles.items()
        }


@contextmanager
def _open_checkpoint(path: Path, cfg: ModelConfig, device: torch.device | str) -> Iterator[dict]:
    """HF name -> the open safetensors file holding it (tensors it reads land on `device`).

    The multi-token-prediction layers config.json declares after the decoder layers are left
    out, they are not part of this model; a layer beyond them, a declared one without an MTP
    module's `eh_proj.weight` (a decoder layer the config does not count), a name in two files
    or a file that is not safetensors is a ValueError naming it.
    """
    files = checkpoint_files(path)
    num_layers = cfg.num_hidden_layers
    num_stored = num_layers + num_mtp_layers(read_config_json(path))
    with ExitStack() as stack:
        handles, file_of, skipped = {}, {}, {}
        for file in files:
            handle = stack.enter_context(_safe_open(file, device))
            for key in handle.keys():
                if key in file_of:
                    raise ValueError(
                        f"weights {str(path)!r}: tensor {key} is in both {file_of[key].name} "
                        f"and {file.name}"
                    )
                file_of[key] = file
                layer = LAYER_KEY.match(key)
                layer_id = int(layer.group(1)) if layer else -1
                if layer_id >= num_stored:
                    raise ValueError(
                        f"weights {str(path)!r}: unexpected tensor {key}: config.json declares "
                        f"{num_layers} decoder and {num_stored - num_layers} "
                        "multi-token-prediction layers"
                    )
                if layer_id >= num_layers:
                    skipped.setdefault(layer_id, set()).add(key)
                    continue
                shape = handle.get_slice(key).get_shape()
                if not is_absent_shared_expert(key, shape, cfg):
                    handles[key] = handle
        _check_mtp_layers(skipped, num_layers, str(path))
        yield handles


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint directory `path`: the shards its index names
    where it has one (transformers reads those alone; another file there, a stale shard of an
    earlier save say, is left out with a warning), else every *.safetensors file. A shard the
    index names that is absent, or an index that is no weight_map of names to file names, is a
    ValueError naming it: a missing shard was reported as the first tensor it held."""
    index = path / INDEX_FILE
    if not index.is_file():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"weights path {str(path)!r} holds no *.safetensors files")
        return files
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and name and name == Path(name).name for name in weight_map.values()
    ):
        raise ValueError(f"{index} holds no weight_map of tensor names to file names in {path}")
    tensors_in: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        tensors_in.setdefault(name, []).append(key)
    if not tensors_in:
        raise ValueError(f"{index} names no tensors (its weight_map is empty)")
    for name, keys in sorted(tensors_in.items()):
        if not (path / name).exists() and not (path / name).is_symlink():
            raise ValueError(
                f"weights {str(path)!r}: shard {name} is missing; {INDEX_FILE} names it for "
                f"{len(keys)} tensor{'s' * (len(keys) > 1)} ({keys[0]}{', ...' * (len(keys) > 1)})"
            )
    unnamed = sorted(f.name for f in path.glob("*.safetensors") if f.name not in tensors_in)
    if unnamed:
        log.warning("%s: %s not named in %s, not read", path, ", ".join(unnamed), INDEX_FILE)
    return [path / name for name in sorted(tensors_in)]


def _check_mtp_layers(skipped: dict[int, set[str]], num_layers: int, path: str) -> None:
    """Every layer left out as multi-token prediction is one: it holds the `eh_proj` that joins
    an MTP module's two inputs (DeepSeek-V3's layout). Why: a config.json counting fewer decoder
    layers than the checkpoint holds (with the MTP layer V3's config declares by default)
    otherwise served a model short of its last layers, with no error."""
    for layer_id, keys in sorted(skipped.items()):
        if f"model.layers.{layer_id}.eh_proj.weight" not in keys:
            raise ValueError(
                f"weights {path!r}: layer {layer_id} holds no model.layers.{layer_id}.eh_proj."
                "weight, so it is a decoder layer, not a multi-token-prediction layer: "
                f"config.json declares num_hidden_layers={num_layers}, fewer than the "
                "checkpoint's decoder layers"
            )


def _safe_open(file: Path, device: torch.device | str):
    """The open safetensors file (its header parsed); ValueError naming a malformed one."""
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except SafetensorError as exc:
        raise ValueError(f"weights file {str(file)!r} is not valid safetensors: {exc}") from exc
    except OSError as exc:  # a directory named *.safetensors, a dangling link, no permission
        raise ValueError(f"weights file {str(file)!r} cannot be read: {exc}") from exc


def _header(handle, key: str, path: Path) -> torch.Tensor:
    """A meta tensor with the shape and dtype a checkpoint tensor's header declares."""
    info = handle.get_slice(key)
    dtype = _SAFETENSORS_DTYPES.get(info.get_dtype())
    if dtype is None:
        raise ValueError(f"weights {str(path)!r}: tensor {key} has dtype {info.get_dtype()}")
    return torch.empty(info.get_shape(), dtype=dtype, device="meta")


def _read_groups(
    keys: Sequence[str], local_experts: list[list[int]], cfg: ModelConfig
) -> list[list[str]]:
    """The checked keys this rank reads, grouped by decoder layer (the others first), so one
    layer's tensors are in device memory at a time; other ranks' experts are left out."""
    local = [set(row) for row in local_experts]
    groups: dict[int, list[str]] = {}
    for key in keys:
        layer, expert = LAYER_KEY.match(key), EXPERT_KEY.match(key)
        layer_id = int(layer.group(1)) if layer else -1
        if expert and int(expert.group(2)) not in local[layer_id - cfg.first_k_dense_replace]:
            continue
        groups.setdefault(layer_id, []).append(key)
    return [groups[layer_id] for layer_id in sorted(groups)]
