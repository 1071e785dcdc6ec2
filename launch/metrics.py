"""Prometheus metrics of the server, on a registry of its own (one per app).

Request-side series (tokens in and out, time to first token, inter-token latency, requests by
route and status) are recorded from the engine's per-step output deltas; engine-side series
(running and waiting sequences, KV cache usage, rebalances, balancedness, weight version,
steps) are read from the AsyncEngine's last `EngineStats` at scrape time, so a scrape never
touches the engine itself.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from moe_runtime.engine.outputs import EngineStats, RequestOutput

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("moe_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(
            "moe_generation_tokens", "Output tokens generated", registry=r
        )
        self.requests = Counter(
            "moe_http_requests", "Generation requests answered", ["route", "status"], registry=r
        )
        latency = functools.partial(Histogram, buckets=LATENCY_BUCKETS_S, registry=r)
        self.time_to_first_token = latency(
            "moe_time_to_first_token_seconds", "From submission to a sample's first token"
        )
        self.inter_token_latency = latency(
            "moe_inter_token_latency_seconds", "Between consecutive tokens of one sample"
        )
        r.register(self)  # its `collect`: the engine-side series

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

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
        if stats.last_balancedness is not None:
            yield GaugeMetricFamily(
                "moe_last_balancedness",
                "Mean over max expert load per rank after the last rebalance",
                stats.last_balancedness,
            )
        yield GaugeMetricFamily(
            "moe_weight_version", "Version of the weights served", stats.weight_version
        )
        yield CounterMetricFamily("moe_engine_steps", "Engine steps run", stats.num_steps)


class RequestTracker:
    """Timings of one submission's samples. `observe` runs on the engine thread."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._submitted = time.monotonic()
        self._last: dict[tuple[int, int], float] = {}  # (prompt idx, sample idx) -> time

    def observe(self, prompt_idx: int, delta: RequestOutput) -> None:
        now, m = time.monotonic(), self._metrics
        for out in delta.outputs:
            key = (prompt_idx, out.index)
            last = self._last.get(key)
            if last is None:
                m.time_to_first_token.observe(now - self._submitted)
                if out.index == 0:
                    m.prompt_tokens.inc(len(delta.prompt_token_ids))
            else:
                m.inter_token_latency.observe((now - last) / len(out.token_ids))
            self._last[key] = now
            m.generation_tokens.inc(len(out.token_ids))
