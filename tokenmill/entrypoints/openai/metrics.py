"""Prometheus metrics of one server, named as in vLLM (``tokenmill:`` prefix).

Gauges and engine counters are read from the AsyncEngine's snapshot at scrape
time (the engine already counts them; nothing is counted twice). Latency
histograms are observed as outputs reach the HTTP handlers. Each app owns its
CollectorRegistry, so several apps can live in one process (tests do).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot
        gauges = [
            ("num_requests_running", "Requests being decoded or prefilled.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV blocks held by requests (cached free blocks count as free).",
             s.kv_usage),
            ("kv_cache_blocks_in_use", "KV blocks held by requests.", s.kv_blocks_in_use),
            ("prefix_cache_blocks", "KV blocks findable in the prefix cache.", s.kv_blocks_cached),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"tokenmill:{name}", doc, value=value)
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("prompt_tokens", "Prompt tokens computed.", s.prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.generation_tokens),
            ("num_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"tokenmill:{name}", doc, value=value)


class ServerMetrics:
    """The registry of one app and the request-latency histograms it fills."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("tokenmill:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("tokenmill:inter_token_latency_seconds", "Time between two output tokens.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("tokenmill:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Observes one engine request's outputs as they arrive: its first token, the gaps
    between tokens (spread over the tokens that arrived together), and its end."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.num_tokens = 0
        self.last_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        new = num_tokens - self.num_tokens
        if new > 0:
            if self.last_time is None:
                first = output.metrics.first_token_time or now
                self.metrics.ttft.observe(max(0.0, first - output.metrics.arrival_time))
            else:
                gap = (now - self.last_time) / new
                for _ in range(new):
                    self.metrics.itl.observe(gap)
            self.last_time = now
            self.num_tokens = num_tokens
        if output.finished:
            end = output.metrics.finished_time or now
            self.metrics.e2e.observe(max(0.0, end - output.metrics.arrival_time))
