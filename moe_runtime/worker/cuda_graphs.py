"""DecodeGraphRunner: pure decode steps replayed as CUDA graphs, MoE layers inside them.

A decode step of B sequences is padded to the next size N of `batch_sizes` with dummy rows
(token 0, position 0, writing only to the scratch KV block no sequence owns). When the MoE
layers' dispatcher is capturable (one rank; or FixedCapacityDispatcher, whose collectives have
fixed shapes) the whole step is one graph per size. With FixedCapacityDispatcher every rank must
replay the same N in the same step, so the ranks agree on it first (one small collective per
step; a rank with no sequences then replays N dummy rows) or all run the step eagerly. With
AllToAllDispatcher (host split sizes: its collectives can't be captured) the model is cut at
every MoE layer into segments, each captured once ([embedding .. first MoE layer's attention
part], ..., [final norm, LM head]), and those MoE layers run eagerly on the B real rows between
replays, each rank choosing its N alone. In invariant mode real rows keep their eager bits:
every kernel computes a row from that row alone (padding rows are routed and computed too, and
change no real row), and the block-table width sets only the attention launch. Expert loads
count the real rows only. Not for TP > 1 (the config refuses).

Each size is captured at a few block-table widths (`table_widths`: 1, 2, 4, ... KV splits of
the wide attention launch and the model's launch's tail, up to the longest context) and a step
replays the narrowest that holds its longest table: the attention launch follows the batch's
context, not the engine's longest. Why: its grid has a program per KV split of the table's
width, and at 128 heads a table of 128 blocks cost B = 256 at context 1024 294 us an attention
call against 217 with its own 16 (H200, BENCHMARKS.md). The width changes no bit (no query
reads past its own blocks; the split order is fixed by position), so widths, like sizes, may
follow the batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from comm.capacity_dispatch import FixedCapacityDispatcher
from moe_kernels.attention_launch import WIDE_LAUNCH, head_launch
from moe_runtime.forward_batch import ForwardBatch, host_to_device
from moe_runtime.model.deepseek import DeepseekForCausalLM

log = logging.getLogger(__name__)


def table_widths(max_blocks_per_seq: int, tail_blocks: int = 0) -> tuple[int, ...]:
    """The block-table widths a size is captured at: 1, 2, 4, ... KV splits of the wide
    attention launch plus tail_blocks (the model's launch's: the blocks a query's last split
    takes on, so each width is the widest table of its split count; one split: a table the
    launch reads in one split, writing its output directly), while below max_blocks_per_seq,
    then max_blocks_per_seq."""
    widths, splits = [], 1
    while (width := splits * WIDE_LAUNCH.split_blocks + tail_blocks) < max_blocks_per_seq:
        widths.append(width)
        splits *= 2
    return (*widths, max_blocks_per_seq)


@dataclass(frozen=True)
class _Segment:
    """layers[first_layer:end_layer] run whole; then end_layer's attention part, or the final
    norm and LM head when end_layer is the layer count."""

    first_layer: int
    end_layer: int


@dataclass
class _SizeGraphs:
    """Static buffers and captured segments of one padded batch size N and table width MB."""

    batch: ForwardBatch  # device tensors, [N] / [N, MB]; logits_indices = arange(N)
    # token_ids, positions, slot_mapping and block_tables: views of this one buffer, loaded
    # in one host-to-device copy a step
    loaded: torch.Tensor
    inputs: list[torch.Tensor | None]  # per segment: its residual input [N, D] (None: embed)
    outputs: list[tuple[torch.Tensor, ...]]  # per segment: (x, h) [N, D] or (logits [N, V],)
    graphs: list[torch.cuda.CUDAGraph]
    moe_topk_ids: list[torch.Tensor] = field(default_factory=list)  # per captured MoE layer


class DecodeGraphRunner:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_caches: list[torch.Tensor],
        batch_sizes: tuple[int, ...],
        max_blocks_per_seq: int,
        scratch_block: int,
    ) -> None:
        """batch_sizes strictly increasing; block tables are padded to the narrowest of
        table_widths (of the model's launch) that holds them, so each graph's attention launch is
        static; scratch_block is a cache block no sequence owns."""
        self.model, self.kv_caches = model, kv_caches
        self.batch_sizes, self.max_blocks_per_seq = batch_sizes, max_blocks_per_seq
        # The tail of the model's attention launch (moe_kernels/attention_launch.py): at 128
        # heads a table of 18 blocks (a split and its tail) holds contexts of 17 and 18 blocks
        # in one split, where one of 16 gave them a second split (a launch with programs that
        # exit at once and a merge launch).
        launch = head_launch(model.config.num_attention_heads)
        self.table_widths = table_widths(max_blocks_per_seq, launch.tail_blocks)
        self.scratch_block = scratch_block
        self.block_size = kv_caches[0].shape[1]
        self.device = kv_caches[0].device
        self.segments: list[_Segment] = []  # planned at the first capture (see _plan)
        self.captured_moe: list = []
        self.pool = torch.cuda.graph_pool_handle()
        # Why a stream of our own: torch.cuda.graph's default capture stream is made once per
        # process, on whichever device was current then (another LLM's, a trainer's GPU).
        self.capture_stream = torch.cuda.Stream(self.device)
        self._graphs: dict[tuple[int, int], _SizeGraphs] = {}  # by (size, table width)
        self.num_replays = 0  # steps served by graphs (tests check the path really ran)
        self.num_captures = 0
        self._step_size: int | None = None  # the padded size can_run chose for this step
        self._step_width = 0  # and the table width

    def can_run(self, is_pure_decode: bool, batch: ForwardBatch) -> bool:
        """batch on the host; is_pure_decode: one token per sequence and no scoring rows.
        Called once per step on every rank (with FixedCapacityDispatcher, a collective); it
        also picks the padded size and table width `run` replays."""
        num_seqs, num_blocks = batch.block_tables.shape
        widths = [w for w in self.table_widths if w >= num_blocks]
        is_ready = (
            is_pure_decode
            and num_seqs <= self.batch_sizes[-1]
            and batch.num_tokens == num_seqs
            and bool(widths)
        )
        num_rows, width = self._agree_step(num_seqs, widths[0] if widths else 0, is_ready)
        sizes = [n for n in self.batch_sizes if n >= num_rows] if num_rows >= 1 else []
        self._step_size = sizes[0] if sizes else None
        self._step_width = width
        if (dispatcher := self._capacity_dispatcher()) is not None:
            # Eager steps (prefill, mixed, scoring) take the uneven exchange: the same bits
            # without padded blocks. Every rank agreed on the bucket, so every rank agrees here.
            dispatcher.begin_step(is_graph_step=self._step_size is not None)
        return self._step_size is not None

    def _capacity_dispatcher(self) -> FixedCapacityDispatcher | None:
        """The MoE layers' shared dispatcher when it is the fixed-capacity one."""
        layers = self.model.moe_layers
        if layers and isinstance(layers[0].dispatcher, FixedCapacityDispatcher):
            return layers[0].dispatcher
        return None

    def _agree_step(self, num_seqs: int, width: int, is_ready: bool) -> tuple[int, int]:
        """-> (the rows this step's graph must hold, its table width); rows -1: an eager step."""
        if (dispatcher := self._capacity_dispatcher()) is not None:
            # Collective (all ranks, once per step, before the model): the captured MoE layers'
            # collectives have the bucket's shape, so every rank replays the same one or none.
            return dispatcher.agree_graph_step(num_seqs, width, is_ready)
        return (num_seqs, width) if is_ready else (-1, -1)

    def reset(self) -> None:
        """Drop every capture (weights were replaced: the graphs hold the old addresses)."""
        self._graphs.clear()
        self.segments = []

    def _plan(self) -> None:
        """Cut the model at the MoE layers whose dispatcher can't be captured. Called at the
        first capture, not at construction: the worker binds its dispatchers after that."""
        layers = self.model.model.layers
        eager_moe = [
            i
            for i, layer in enumerate(layers)
            if layer.is_moe and not layer.mlp.dispatcher.is_capturable
        ]
        self.captured_moe = [
            layer.mlp for i, layer in enumerate(layers) if layer.is_moe and i not in eager_moe
        ]
        starts = [0] + [i + 1 for i in eager_moe]
        ends = eager_moe + [len(layers)]
        self.segments = [_Segment(a, b) for a, b in zip(starts, ends, strict=True)]

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """batch (host tensors, B rows, can_run true) -> fp32 logits [R, V] for
        batch.logits_indices, bitwise the eager model's. token_ids: the B rows' ids on the
        device, read there in place of batch.token_ids (a step fed the last step's samples
        before the host has them)."""
        num_real, size, width = batch.num_tokens, self._step_size, self._step_width
        # A pure decode step's rows each need logits: a slice, no gather, in the usual case.
        rows = batch.logits_indices
        is_every_row = torch.equal(rows, torch.arange(num_real))
        if not is_every_row:  # before the replay, which would hold the host until it ends
            rows = host_to_device(rows, self.device)
        graphs = self._graphs.get((size, width))
        if not self.segments:
            self._plan()
        if graphs is None:
            graphs = self._capture(size, width, batch)
        else:
            self._load(graphs, batch)
        if token_ids is not None:  # queued after the load's copy: it wins
            graphs.batch.token_ids[:num_real].copy_(token_ids)
        layers = self.model.model.layers
        for j, segment in enumerate(self.segments):
            graphs.graphs[j].replay()
            if segment.end_layer == len(layers):
                break
            x, h = graphs.outputs[j]
            # Eager MoE on the real rows only: the pad rows never reach the router or the
            # dispatcher (a collective every rank joins once per layer, in layer order).
            layer = layers[segment.end_layer]
            graphs.inputs[j + 1][:num_real] = layer.mlp_part(x[:num_real], h[:num_real])
        if self.captured_moe:
            self._count_real_rows(graphs.moe_topk_ids, num_real)
        self.num_replays += 1
        logits = graphs.outputs[-1][0]
        # A copy either way: the next replay reuses the pool.
        return logits[:num_real].clone() if is_every_row else logits[rows]

    def _count_real_rows(self, topk_ids: list[torch.Tensor], num_real: int) -> None:
        """After a replay: point each captured MoE layer at this size's routing (a replay
        refills the captured tensors but sets no Python attribute) and set its slot counts
        from the real rows only (the graph routed the padding rows too). With
        FixedCapacityDispatcher a collective: every rank's real rows, summed per local slot."""
        for moe, ids in zip(self.captured_moe, topk_ids, strict=True):
            moe.last_topk_ids = ids
        ids = torch.stack([ids[:num_real] for ids in topk_ids]).flatten(1)  # [M, B*K] logical
        replica_rows = torch.stack([moe.replica_row for moe in self.captured_moe])
        counts = self.captured_moe[0].dispatcher.count_served_rows(replica_rows.gather(1, ids))
        for moe, layer_counts in zip(self.captured_moe, counts, strict=True):
            moe.last_slot_counts = layer_counts

    def _load(self, graphs: _SizeGraphs, batch: ForwardBatch) -> None:
        """Copy the B real rows into the static buffers (one page-locked copy, queued: the
        host does not wait); rows B.. become dummy rows."""
        num_real, width = batch.num_tokens, batch.block_tables.shape[1]
        host = torch.empty(graphs.loaded.shape, dtype=torch.int64, pin_memory=True)
        graph_width = graphs.batch.block_tables.shape[1]  # the graph's, >= the batch's width
        token_ids, positions, slot_mapping, tables = self._input_views(host, graph_width)
        token_ids[:num_real], positions[:num_real] = batch.token_ids, batch.positions
        slot_mapping[:num_real] = batch.slot_mapping
        token_ids[num_real:], positions[num_real:] = 0, 0
        slot_mapping[num_real:] = self.scratch_block * self.block_size
        tables.fill_(-1)
        tables[:num_real, :width] = batch.block_tables
        tables[num_real:, 0] = self.scratch_block
        graphs.loaded.copy_(host, non_blocking=True)

    @staticmethod
    def _input_views(buffer: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
        """token_ids [N], positions [N], slot_mapping [N], block_tables [N, width] in a buffer
        of N * (3 + width) int64 (N from its size)."""
        num_rows = buffer.shape[0] // (3 + width)
        flat = [buffer[i * num_rows : (i + 1) * num_rows] for i in range(3)]
        return (*flat, buffer[3 * num_rows :].view(num_rows, width))

    def _run_segment(self, j: int, graphs: _SizeGraphs) -> tuple[torch.Tensor, ...]:
        """The eager code of segment j over all N rows (captured as is)."""
        segment, model = self.segments[j], self.model
        layers, batch = model.model.layers, graphs.batch
        if j == 0:
            x = model.model.embed(batch.token_ids)
        else:
            x = graphs.inputs[j]
        for i in range(segment.first_layer, segment.end_layer):
            x = layers[i](x, batch, self.kv_caches[i])
        if segment.end_layer < len(layers):
            i = segment.end_layer
            return layers[i].attention_part(x, batch, self.kv_caches[i])
        return (model.logits(x),)  # tp.size is 1 here (the config refuses graphs with TP)

    def _capture(self, num_rows: int, width: int, batch: ForwardBatch) -> _SizeGraphs:
        """Warm up (compiles this size's kernels), then capture every segment of size N with
        tables of `width` columns. Logged: the first step of a new size or width waits for it
        (kernel compiles and captures, seconds on a full-size model) and said nothing."""
        cfg, dev, started = self.model.config, self.device, time.monotonic()
        loaded = torch.zeros(num_rows * (3 + width), dtype=torch.int64, device=dev)
        token_ids, positions, slot_mapping, block_tables = self._input_views(loaded, width)
        static = ForwardBatch(
            token_ids=token_ids,
            positions=positions,
            query_seq_ids=torch.arange(num_rows, device=dev),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=torch.arange(num_rows, device=dev),
        )
        inputs = [None] + [
            torch.zeros(num_rows, cfg.hidden_size, dtype=self.model.dtype, device=dev)
            for _ in self.segments[1:]
        ]
        graphs = _SizeGraphs(static, loaded, inputs, [], [])
        self._load(graphs, batch)
        # The warm-up writes this step's latents from zero inputs into this step's own slots
        # (and the scratch block); the replays below overwrite each of them before any
        # attention reads it, since every layer writes its cache rows before attending.
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for j in range(len(self.segments)):
                self._run_segment(j, graphs)
        torch.cuda.current_stream(dev).wait_stream(stream)
        for j in range(len(self.segments)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self.pool, stream=self.capture_stream, capture_error_mode="thread_local"
            ):
                graphs.outputs.append(self._run_segment(j, graphs))
            graphs.graphs.append(graph)
        graphs.moe_topk_ids = [moe.last_topk_ids for moe in self.captured_moe]
        self._graphs[num_rows, width] = graphs
        self.num_captures += 1
        log.info(
            "captured the decode step for %d rows, tables %d blocks wide, as %d graph(s) in %.1fs",
            num_rows, width, len(graphs.graphs), time.monotonic() - started,
        )  # fmt: skip
        return graphs
