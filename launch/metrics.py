"""Prometheus metrics of the server, on a registry of its own (one per app).

Request-side series (tokens in and out, time to first token, inter-token latency) are recorded
from the engine's per-step output deltas, and every HTTP response by route and status;
engine-side series (running and waiting sequences, KV cache usage, rebalances, balancedness,
weight version, steps, restarts) are read from the AsyncEngine's last `EngineStats` at scrape
time. Per-rank expert load comes from `LLMEngine.worker_stats()` (a remote call on every rank),
which a scrape asks the engine thread for at most every RANK_STATS_MAX_AGE_S and waits for at
most RANK_STATS_WAIT_S; otherwise it shows the last answer. A scrape never runs engine code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from moe_runtime.engine.async_engine import AsyncEngine
from moe_runtime.engine.outputs import EngineStats, RequestOutput

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CONTENT_TYPE = CONTENT_TYPE_LATEST
RANK_STATS_MAX_AGE_S = 5.0
RANK_STATS_WAIT_S = 2.0
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats
        self._rank_stats: list[dict] = []  # the last LLMEngine.worker_stats()
        self._rank_future: Future | None = None
        self._rank_asked_at = -math.inf
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("moe_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(
            "moe_generation_tokens", "Output tokens generated", registry=r
        )
        self.requests = Counter(
            "moe_http_requests", "HTTP responses", ["route", "status"], registry=r
        )
        # Why apart: a stream's status is counted as it starts (200), before its failure.
        self.stream_errors = Counter(
            "moe_stream_errors", "Streams ended by an error chunk after their 200", registry=r
        )
        self.samples_finished = Counter(
            "moe_samples_finished",
            "Generated samples by how they ended: stop, length, abort (the client left), "
            "error (a fault, or the drain timeout)",
            ["finish_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:  # every series from the first scrape
            self.samples_finished.labels(reason)
        latency = functools.partial(Histogram, buckets=LATENCY_BUCKETS_S, registry=r)
        self.time_to_first_token = latency(
            "moe_time_to_first_token_seconds",
            "From the request's arrival to a sample's first token",
        )
        self.inter_token_latency = latency(
            "moe_inter_token_latency_seconds", "Between consecutive tokens of one sample"
        )
        r.register(self)  # its `collect`: the engine-side series

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def refresh_rank_stats(self, engine: AsyncEngine) -> None:
        """Ask the engine thread for every rank's counters unless asked in the last
        RANK_STATS_MAX_AGE_S or still pending; wait for them at most RANK_STATS_WAIT_S."""
        pending = self._rank_future
        if (pending is None or pending.done()) and (
            time.monotonic() - self._rank_asked_at >= RANK_STATS_MAX_AGE_S
        ):
            self._rank_asked_at = time.monotonic()
            with contextlib.suppress(Exception):  # loading, draining or dead: keep the last
                pending = self._rank_future = engine.call(lambda e: e.worker_stats())
                pending.add_done_callback(self._keep_rank_stats)
        if pending is not None and not pending.done():
            # shielded: a scrape that stops waiting must not cancel the call
            waiting = asyncio.shield(asyncio.wrap_future(pending))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(waiting, RANK_STATS_WAIT_S)

    def _keep_rank_stats(self, future: Future) -> None:  # on the engine thread
        if not future.cancelled() and future.exception() is None:
            self._rank_stats = future.result()

    def collect(self) -> Iterator[Metric]:
        """Series read from the engine's last stats; none while the engine is loading."""
        stats = self._stats()
        if stats is None:
            return
        yield GaugeMetricFamily(
            "moe_num_requests_running", "Sequences in running batches", stats.num_running
        )
        yield GaugeMetricFamily(
            "moe_num_requests_waiting", "Sequences waiting to run", stats.num_waiting
        )
        usage = GaugeMetricFamily(
            "moe_kv_cache_usage_ratio", "Fraction of KV blocks in use", labels=["dp_rank"]
        )
        for dp_rank, value in enumerate(stats.kv_cache_usage):
            usage.add_metric([str(dp_rank)], value)
        yield usage
        yield CounterMetricFamily("moe_rebalances", "Expert rebalances done", stats.num_rebalances)
        yield CounterMetricFamily(
            "moe_rebalances_failed",
            "Expert moves a rank refused (the old placement kept serving)",
            stats.num_failed_rebalances,
        )
        balancedness = stats.last_balancedness
        yield GaugeMetricFamily(
            "moe_last_balancedness",
            "Mean over max expert load per rank: after the last rebalance, or as the last check "
            "that skipped one found it (NaN before either)",
            math.nan if balancedness is None else balancedness,
        )
        yield GaugeMetricFamily(
            "moe_weight_version", "Version of the weights served", stats.weight_version
        )
        yield CounterMetricFamily("moe_engine_steps", "Engine steps run", stats.num_steps)
        yield CounterMetricFamily(
            "moe_engine_restarts", "Worker-group rebuilds after a rank died", stats.num_restarts
        )
        yield CounterMetricFamily(
            "moe_preemptions",
            "Running sequences preempted (their KV freed, recomputed later)",
            stats.num_preemptions,
        )
        yield CounterMetricFamily(
            "moe_dp_shared_sequences",
            "Waiting sequences an idle DP rank took over from a busier one",
            stats.num_shared,
        )
        yield from self._collect_ranks()

    def _collect_ranks(self) -> Iterator[Metric]:
        """Rows each local expert slot served since start, and each rank's share of all rows
        over the mean share (1.0 everywhere when balanced), from the last worker_stats."""
        rows = CounterMetricFamily(
            "moe_expert_rows", "Rows a local expert slot served", labels=["layer", "rank", "slot"]
        )
        ratio = GaugeMetricFamily(
            "moe_rank_load_ratio", "A rank's expert rows over the mean over ranks", labels=["rank"]
        )
        ranks = self._rank_stats
        loads = [  # before the first step: zeros, [MoE layer][local slot]
            rank["slot_load"] or [[0] * (len(p) // len(ranks)) for p in rank["physical_to_logical"]]
            for rank in ranks
        ]
        totals = [sum(map(sum, load)) for load in loads]
        mean = sum(totals) / max(1, len(totals))
        for rank, load, total in zip(ranks, loads, totals, strict=True):
            for layer, slots in enumerate(load):
                for slot, num_rows in enumerate(slots):
                    rows.add_metric([str(layer), str(rank["rank"]), str(slot)], num_rows)
            ratio.add_metric([str(rank["rank"])], total / mean if mean else 1.0)
        yield rows
        yield ratio


class RequestTracker:
    """Timings of one submission's samples, from `received` (time.monotonic: when its HTTP
    request came, so a first token's time holds tokenization, the chat template and the prompt
    checks). `observe` runs on the engine thread."""

    def __init__(self, metrics: ServerMetrics, received: float) -> None:
        self._metrics = metrics
        self._received = received
        # (prompt idx, sample idx) -> the time of its last token (None: seen, no token yet)
        self._last: dict[tuple[int, int], float | None] = {}
        self._counted: set[int] = set()  # prompts whose tokens are counted
        self._num_finished = 0  # samples that ended with a finish_reason
        # `end` runs on whichever thread settled the submission (the event loop, when its client
        # left) while `observe` may be recording a step's delta on the engine thread: each
        # sample must end once. A C lock, not reentrant, held for a few counter increments.
        self._lock = threading.Lock()
        self._is_ended = False

    def end(self, num_samples: int, reason: str) -> None:
        """The submission of num_samples ended without finishing the ones not finished yet:
        its client left ("abort") or it failed ("error"). Deltas observed after it end no
        sample: a step under way when the client left still hands them over."""
        with self._lock:
            self._is_ended = True
            num_unfinished = max(0, num_samples - self._num_finished)
        self._metrics.samples_finished.labels(reason).inc(num_unfinished)

    def observe(self, prompt_idx: int, delta: RequestOutput) -> None:
        with self._lock:
            self._observe(prompt_idx, delta)

    def _observe(self, prompt_idx: int, delta: RequestOutput) -> None:
        now, m = time.monotonic(), self._metrics
        if delta.outputs and prompt_idx not in self._counted:  # the prompt's first delta
            # Any sample's: with n > 1, sample 0's may never come (its client left first).
            self._counted.add(prompt_idx)
            m.prompt_tokens.inc(len(delta.prompt_token_ids))
        for out in delta.outputs:
            key = (prompt_idx, out.index)
            if out.finish_reason is not None and not self._is_ended:
                self._num_finished += 1
                m.samples_finished.labels(out.finish_reason).inc()
            if not out.token_ids:  # no token yet (echo with max_tokens 0 has none at all)
                self._last.setdefault(key, None)
                continue
            last = self._last.get(key)
            if last is None:
                m.time_to_first_token.observe(now - self._received)
            else:
                m.inter_token_latency.observe((now - last) / len(out.token_ids))
            self._last[key] = now
            m.generation_tokens.inc(len(out.token_ids))
