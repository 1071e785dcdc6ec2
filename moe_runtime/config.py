"""RuntimeConfig: one YAML file composed into frozen per-component configs.

Sections `model`, `parallel`, `kernels`, `cache`, `scheduler`, `eplb`, `server`; each
component receives only its own section. Overrides ("section.key" -> value) win over the
file. Every bad value fails here, at load, with a message naming the key; values found at run
time (number of KV blocks, eos id) are returned by their owners, never written back here.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from comm.config import ParallelConfig
from comm.groups import select_backend
from eplb.config import EplbConfig
from moe_kernels.config import KernelConfig, graph_batch_sizes
from moe_runtime.config_checks import check_attention_launch, check_deepep, check_layout
from moe_runtime.config_fields import check_section
from moe_runtime.model_config import ModelConfig

log = logging.getLogger("moe_runtime.config")


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading every exponent number (`1e-6`, `2.5e2`, `.5e3`) as a float,
    as YAML 1.2 does: YAML 1.1's rule wants a dot and a signed exponent (`1.0e+6`), and an
    epsilon written otherwise arrived as text and was refused as not a float. A key given twice
    in one mapping is refused, as YAML requires (PyYAML kept the last: a second `scheduler:`
    section appended to a file dropped every key of the first without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: its keys may be overridden, as YAML means them to be
            key = self.construct_object(key_node, deep=True)
            try:
                line = first_line.get(key)
            except TypeError:
                continue  # an unhashable key: the base class refuses it
            if line is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in one mapping (first on line {line})",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def _read_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


@dataclass(frozen=True)
class CacheConfig:
    """`num_blocks: 0` sizes the KV cache at start-up from the GPU memory still free after the
    weights, times `gpu_memory_utilization`; the count is returned by the workers, never
    written back here."""

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        _int_at_least("cache", "block_size", self.block_size)
        _int_at_least("cache", "num_blocks", self.num_blocks, 0, " (0: size from free GPU memory)")
        utilization = self.gpu_memory_utilization
        is_number = isinstance(utilization, (int, float)) and not isinstance(utilization, bool)
        if not (is_number and 0 < utilization <= 1):
            raise ValueError(
                f"cache.gpu_memory_utilization must be a number in (0, 1], got {utilization!r}"
            )

    @property
    def is_sized_from_memory(self) -> bool:
        return self.num_blocks == 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    enable_chunked_prefill: bool = True
    # Each rank launches the next decode step of the sequences it just sampled before the
    # engine asks for it, and uses it only if the engine's step is exactly that one (see
    # moe_runtime/worker/lookahead.py). null: on with CUDA graphs on one rank; needs world_size 1.
    overlap_decode: bool | None = None
    # Free KV blocks a waiting sequence's admission must leave for each running sequence (0:
    # admit into the last free block), so the running ones grow into them rather than
    # preempting the newcomer a few steps later (engine/scheduler.py, _can_admit).
    admission_reserve: int = 1

    def __post_init__(self) -> None:
        if self.overlap_decode is not None and not isinstance(self.overlap_decode, bool):
            raise ValueError(
                f"scheduler.overlap_decode must be true, false or null, got {self.overlap_decode!r}"
            )
        _int_at_least("scheduler", "max_num_seqs", self.max_num_seqs)
        _int_at_least("scheduler", "max_num_batched_tokens", self.max_num_batched_tokens)
        _int_at_least("scheduler", "max_model_len", self.max_model_len)
        _int_at_least("scheduler", "admission_reserve", self.admission_reserve, 0)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "scheduler.max_num_batched_tokens must be >= scheduler.max_model_len "
                f"({self.max_model_len}) when chunked prefill is off, "
                f"got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "moe-runtime"
    # An engine idle this long checks that every rank still answers (null: never), so a rank
    # that died between requests turns /health to 503 and is rebuilt before a request meets it.
    # A step or call running this long pings every rank; ranks silent twice in a row are
    # killed (the server's and the LLM calls' watchdog: engine/stall_watch.py).
    health_check_interval_s: float | None = 5.0
    # A request body past this many bytes is a 413, read no further (32 MiB: a prompt list of
    # ~4 million token ids).
    max_request_bytes: int = 32 * 1024 * 1024
    # A request body opening more JSON arrays and objects than this is a 413, parsed no
    # further: a 29 MB body of 6 million one-token prompts took 4 s to parse and 5 s to
    # validate on the event loop, holding the GIL (every stream and /health waited), where
    # 32 MiB of one prompt's ids take 0.4 s. 4 x max_sequences_per_request's default.
    max_request_json_containers: int = 262144
    # A completion of more prompts x n than this is a 400: each sequence holds engine state
    # (~1 KB, and its prompt) while it waits, so one body could exhaust the server's memory.
    max_sequences_per_request: int = 65536
    # Top logprobs a position may ask for (generate, score, HTTP's logprobs / top_logprobs),
    # OpenAI's bound by default: each is a sort column, a table entry and a dict item per token,
    # so a request of the whole vocabulary (102400 at V2-Lite) held that much a token.
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        port = self.port
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"server.port must be an int in [0, 65535], got {port!r}")
        for key in ("host", "model_name"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"server.{key} must be a non-empty string, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("server.api_key must be null or a non-empty string")
        for key in (
            "max_request_bytes",
            "max_request_json_containers",
            "max_sequences_per_request",
        ):
            value = getattr(self, key)
            if not 1 <= value < 2**63:  # (its type checked at load)
                raise ValueError(f"server.{key} must be an int >= 1, got {value!r}")
        if not 0 <= self.max_logprobs < 2**63:
            raise ValueError(f"server.max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        interval = self.health_check_interval_s
        if interval is not None and not 0 < interval <= threading.TIMEOUT_MAX:
            # (a wait longer than the platform's longest killed the engine loop at its first)
            raise ValueError(
                f"server.health_check_interval_s must be null or a number in "
                f"(0, {threading.TIMEOUT_MAX:.3g}] seconds, got {interval!r}"
            )


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "kernels": KernelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "eplb": EplbConfig,
    "server": ServerConfig,
}


@dataclass(frozen=True)
class RuntimeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        if self.scheduler.max_model_len > self.model.max_position_embeddings:
            raise ValueError(
                f"scheduler.max_model_len ({self.scheduler.max_model_len}) exceeds "
                f"model.max_position_embeddings ({self.model.max_position_embeddings})"
            )
        self._resolve_defaults()
        if self.scheduler.overlap_decode and self.parallel.world_size > 1:
            # Every MoE layer is a collective: a step launched ahead on one rank alone would
            # leave the ranks out of step when the engine asks for another.
            raise ValueError(
                "scheduler.overlap_decode: true needs parallel.world_size 1, "
                f"got {self.parallel.world_size}"
            )
        if self.kernels.cuda_graphs and self.parallel.device != "cuda":
            raise ValueError(
                "kernels.cuda_graphs: true needs parallel.device 'cuda', "
                f"got {self.parallel.device!r}"
            )
        if self.kernels.cuda_graphs and self.parallel.tp_size > 1:
            # The pinned TP all-reduce inside attention is not captured.
            raise ValueError(
                f"kernels.cuda_graphs: true needs parallel.tp_size 1, got {self.parallel.tp_size}"
            )
        parallel = self.parallel
        is_gloo_ep = parallel.world_size > 1 and select_backend(parallel) == "gloo"
        if parallel.ep_capacity_dispatch == "on" and self.kernels.cuda_graphs and is_gloo_ep:
            # A gloo collective can't be captured in a CUDA graph.
            raise ValueError(
                "parallel.ep_capacity_dispatch: 'on' with kernels.cuda_graphs: true needs the "
                f"nccl backend, got parallel.backend {parallel.backend!r} (gloo)"
            )
        check_layout(self.model, parallel, self.eplb, self.kernels)
        check_attention_launch(self.model, self.kernels, parallel)
        if parallel.ep_backend == "deepep":
            check_deepep(self.model, parallel, self.scheduler.max_num_batched_tokens)
        if self.kernels.is_invariant and self.parallel.allow_multiple_reduction:
            # A warning, not an error: a legitimate trade of bits for bytes, but it gives up
            # part of the contract the invariant mode stands for.
            log.warning(
                "parallel.allow_multiple_reduction: true with kernels.mode: invariant breaks "
                "expert-placement and rebalance invariance: a token's expert outputs are summed "
                "per rank before they return, so its bits depend on where its experts sit "
                "(EP degree, redundant replicas, EPLB rebalances)"
            )

    def _resolve_defaults(self) -> None:
        """The keys whose null default depends on other sections, resolved once, here:
        kernels.cuda_graphs, kernels.cuda_graph_batch_sizes, scheduler.overlap_decode."""
        if self.kernels.cuda_graphs is None:  # the default: on where graphs passed the tests
            parallel = self.parallel
            # Why not with NCCL between ranks yet: NCCL ranks may turn them on (the MoE layers
            # are then captured with FixedCapacityDispatcher; tests/test_gpu_ep_graphs.py passed
            # at EP=2 on two H200s), but the eager steps' switch to the uneven exchange came
            # after that run: on by default once that test passes again.
            is_nccl = parallel.world_size > 1 and select_backend(parallel) == "nccl"
            is_on = parallel.device == "cuda" and parallel.tp_size == 1 and not is_nccl
            object.__setattr__(self, "kernels", replace(self.kernels, cuda_graphs=is_on))
        if self.kernels.cuda_graph_batch_sizes is None:  # every batch the scheduler forms
            sizes = graph_batch_sizes(self.scheduler.max_num_seqs)
            object.__setattr__(self, "kernels", replace(self.kernels, cuda_graph_batch_sizes=sizes))
        if self.scheduler.overlap_decode is None:
            is_on = bool(self.kernels.cuda_graphs) and self.parallel.world_size == 1
            object.__setattr__(self, "scheduler", replace(self.scheduler, overlap_decode=is_on))

    @property
    def max_blocks_per_seq(self) -> int:
        """KV blocks a sequence of scheduler.max_model_len tokens holds."""
        return -(-self.scheduler.max_model_len // self.cache.block_size)

    @property
    def uses_capacity_dispatch(self) -> bool:
        """Whether the EP ranks exchange rows with FixedCapacityDispatcher (capturable):
        parallel.ep_capacity_dispatch, its 'auto' resolved; never with one rank."""
        parallel = self.parallel
        if parallel.world_size == 1 or parallel.ep_capacity_dispatch == "off" or self.uses_deepep:
            return False
        if parallel.ep_capacity_dispatch == "on":
            return True
        is_nccl = select_backend(parallel) == "nccl"
        return bool(self.kernels.cuda_graphs) and is_nccl and not parallel.allow_multiple_reduction

    @property
    def uses_deepep(self) -> bool:
        """Whether the EP ranks exchange rows with DeepEPDispatcher: parallel.ep_backend, its
        'auto' resolved. 'auto' keeps all_to_all while the DeepEP backend has not run on GPUs;
        once tests/test_deepep_backend.py's GPU tests pass, 'auto' should pick DeepEP when
        deep_ep imports, the device is cuda, the backend nccl, world_size > 1, without multiple
        reduction and without ep_capacity_dispatch 'on'."""
        return self.parallel.world_size > 1 and self.parallel.ep_backend == "deepep"


def load_config(
    source: str | Path | dict | RuntimeConfig, overrides: dict[str, Any] | None = None
) -> RuntimeConfig:
    """YAML path or dict (+ {"section.key": value} overrides) -> validated RuntimeConfig."""
    if isinstance(source, RuntimeConfig):
        if overrides:
            raise ValueError("overrides need a YAML path or dict, not a built RuntimeConfig")
        return source
    if isinstance(source, (str, Path)):
        path = Path(source)
        raw = _read_yaml_file(path)
        if not isinstance(raw, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of sections")
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        raise TypeError(
            f"config must be a YAML path, a dict or a RuntimeConfig, got {type(source).__name__}"
        )
    for dotted, value in (overrides or {}).items():
        apply_override(raw, dotted, value)
    _check_keys("config", raw)
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown config section {unknown[0]!r} (known: {sorted(SECTIONS)})")
    built = {}
    for name, cls in SECTIONS.items():
        section = raw.get(name)
        if section is None:  # `kernels:` with nothing under it; `kernels: []` is refused below
            section = {}
        if not isinstance(section, dict):
            raise ValueError(f"config section {name!r} must be a mapping, got {section!r}")
        _check_keys(f"config section {name!r}", section)
        built[name] = (
            cls.from_dict(section) if hasattr(cls, "from_dict") else _build(name, cls, section)
        )
    return RuntimeConfig(**built)


MAX_CONFIG_BYTES = 16 << 20


def _read_yaml_file(path: Path) -> Any:
    """The file's YAML ({} when empty), or ValueError naming it. Read whatever it is that can be
    read (a pipe such as bash's `<(...)` too), so the message says what failed; at most
    MAX_CONFIG_BYTES (`--config /dev/zero` read until the memory ran out)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ValueError(
                f"config file {str(path)!r} holds more than {MAX_CONFIG_BYTES} bytes: not a config"
            )
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"config file {str(path)!r} is a directory; name a YAML file") from None
    except OSError as exc:
        raise ValueError(f"config file {str(path)!r} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    try:
        raw = _read_yaml(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    # Only an empty file (or a comment, `---`) is no sections: `[]`, `0` or `false` is no
    # mapping, refused as `[1]` is (`or {}` read them as a config of every default).
    return {} if raw is None else raw


def apply_override(raw: dict, dotted: str, value: Any) -> None:
    """Set raw[section][key] from "section.key"; string values are parsed as YAML scalars (an
    empty one is refused: `key=` from an unset shell variable would have meant null, turning
    server.api_key, and with it authentication, off without a word)."""
    if not isinstance(dotted, str):
        raise ValueError(f"override {dotted!r} must be a 'section.key' string")
    section, _, key = dotted.partition(".")
    if not key or section not in SECTIONS:
        raise ValueError(
            f"override {dotted!r} must be 'section.key' with section in {sorted(SECTIONS)}"
        )
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"override {dotted}={value!r} has no value (write {dotted}=null)")
        try:
            value = _read_yaml(value)
        except yaml.YAMLError as exc:
            raise ValueError(f"override {dotted}={value!r} is not a YAML value: {exc}") from None
    raw.setdefault(section, {})
    if raw[section] is None:
        raw[section] = {}
    if not isinstance(raw[section], dict):
        raise ValueError(
            f"config section {section!r} must be a mapping, got {raw[section]!r} "
            f"(so the override {dotted} has nowhere to go)"
        )
    raw[section][key] = value


def _check_keys(where: str, mapping: dict) -> None:
    """Refuse a key that is no string (YAML reads `1:` as the int 1), naming it."""
    odd = next((key for key in mapping if not isinstance(key, str)), None)
    if odd is not None:
        raise ValueError(f"{where}: key {odd!r} must be a name, got {type(odd).__name__}")


def _build(name: str, cls: type, section: dict) -> Any:
    check_section(name, cls, section)
    try:
        return cls(**section)
    except TypeError as exc:
        raise ValueError(f"config section {name!r}: {exc}") from exc


def _int_at_least(section: str, key: str, value: object, minimum: int = 1, note: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{section}.{key} must be an int >= {minimum}{note}, got {value!r}")
