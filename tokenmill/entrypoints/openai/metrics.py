"""Prometheus metrics of one server, named as in vLLM (``tokenmill:`` prefix).

Gauges and engine counters are read at scrape time from the last statistics
the engine core sent (the core already counts them; nothing is counted twice).
Latency histograms are observed as the front-end processes the core's outputs,
for every request, streamed or not. Each app owns its CollectorRegistry, so
several apps can live in one process (tests do).

With ``vllm_names``, every metric that vLLM also has is exported a second time under
vLLM's name (``vllm:`` prefix) with vLLM's ``model_name`` and ``engine`` labels, so
dashboards and autoscalers written for vLLM read this server as they are. The twin
is made from the same samples at scrape time, so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.engine.frontend.async_llm import AsyncLLM
from tokenmill.engine.frontend.output_processor import ProcessedOutputs

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.get_stats()
        gauges = [
            ("num_requests_running", "Requests being decoded or prefilled.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            (
                "kv_cache_usage_perc",
                "Fraction of KV blocks held by requests (cached free blocks count as free).",
                s.kv_usage,
            ),
            ("kv_cache_blocks_in_use", "KV blocks held by requests.", s.kv_blocks_in_use),
            ("prefix_cache_blocks", "KV blocks findable in the prefix cache.", s.kv_blocks_cached),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"tokenmill:{name}", doc, value=value)
        yield GaugeMetricFamily(
            "tokenmill:kv_cache_capacity_tokens",
            "Tokens the KV cache holds over all requests.",
            value=s.kv_capacity_tokens,
        )
        info = GaugeMetricFamily(
            "tokenmill:kv_cache_info",
            "The KV cache's configuration, in its labels (value 1).",
            labels=["kv_cache_dtype"],
        )
        info.add_metric([s.kv_cache_dtype], 1)
        yield info
        counters = [
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("prompt_tokens", "Prompt tokens computed.", s.prompt_tokens),
            ("generation_tokens", "Tokens generated.", s.generation_tokens),
            ("num_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions),
            ("num_steps", "Engine steps.", s.num_steps),
            ("num_graph_steps", "Engine steps whose forward replayed a captured CUDA graph.", s.num_graph_steps),
            ("num_failed_steps", "Engine steps that failed (their requests ended with an error).", s.num_failed_steps),
            (
                "num_compiles_after_startup",
                "Triton kernel variants compiled inside a step (each one a shape the "
                "start-up warm-up missed; the step waited for it).",
                s.num_compiles_after_startup,
            ),
            (
                "spec_decode_num_drafts",
                "Speculative decoding: verifications of a sequence's drafts.",
                s.spec_decode_num_drafts,
            ),
            (
                "spec_decode_num_draft_tokens",
                "Speculative decoding: draft tokens proposed.",
                s.spec_decode_num_draft_tokens,
            ),
            (
                "spec_decode_num_accepted_tokens",
                "Speculative decoding: draft tokens accepted.",
                s.spec_decode_num_accepted_tokens,
            ),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"tokenmill:{name}", doc, value=value)


VLLM_SHARED_NAMES = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens",
        "generation_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_success",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    }
)
"""Metrics that vLLM exports with the same meaning, under ``vllm:`` and this same suffix."""


class _VllmTwins(Collector):
    """The metrics of ``sources`` that vLLM also has, renamed to vLLM's names and labelled as vLLM labels them."""

    def __init__(self, sources: list[Collector], model_name: str) -> None:
        self.sources = sources
        self.labels = {"model_name": model_name, "engine": "0"}

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for metric in source.collect():
                suffix = metric.name.removeprefix("tokenmill:")
                if suffix in VLLM_SHARED_NAMES:
                    yield self._twin(metric, suffix)

    def _twin(self, metric: Metric, suffix: str) -> Metric:
        twin = Metric(f"vllm:{suffix}", metric.documentation, metric.type)
        twin.samples = [
            sample._replace(
                name="vllm:" + sample.name.removeprefix("tokenmill:"), labels={**self.labels, **sample.labels}
            )
            for sample in metric.samples
        ]
        return twin


class ServerMetrics:
    """The registry of one app and the request-latency histograms it fills."""

    def __init__(self, engine: AsyncLLM, model_name: str = "", vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        engine_collector = _EngineCollector(engine)
        self.registry.register(engine_collector)
        self.ttft = Histogram(
            "tokenmill:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "tokenmill:inter_token_latency_seconds",
            "Time between two output tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tokenmill:e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "tokenmill:request_success",
            "Sequences finished, by why they finished.",
            ["finished_reason"],
            registry=self.registry,
        )
        if vllm_names:
            self.registry.register(
                _VllmTwins([engine_collector, self.ttft, self.itl, self.e2e, self.finished], model_name)
            )
        engine.observers.append(self.observe)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, processed: ProcessedOutputs) -> None:
        """Latencies of one batch of outputs (a gap shared by several tokens counts once per
        token), and the reasons its finished sequences ended ("error" for a failed request)."""
        for output in processed.outputs:
            if output.finished:
                for choice in output.outputs:
                    self.finished.labels("error" if output.error else choice.finish_reason or "abort").inc()
        for value in processed.ttfts:
            self.ttft.observe(value)
        for gap, count in processed.itls:
            for _ in range(count):
                self.itl.observe(gap)
        for value in processed.e2e_latencies:
            self.e2e.observe(value)
