"""Prometheus metrics: engine gauges and counters read at scrape time, request latencies from the API.

Each app has its own registry, so several apps (tests) in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ferrum.engine.async_engine import EngineClient

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("ferrum_num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("ferrum_num_requests_waiting", "Requests queued for the running batch.", s.num_waiting)
        yield gauge("ferrum_kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
        yield gauge("ferrum_kv_blocks_total", "KV cache blocks in all.", s.kv_blocks_total)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        yield gauge("ferrum_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", usage)
        yield counter(
            "ferrum_num_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions
        )
        yield counter("ferrum_requests_finished", "Requests the engine finished.", s.requests_finished)
        yield counter("ferrum_prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total)
        yield counter("ferrum_generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("ferrum_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("ferrum_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.",
                      s.prefix_cache_hits)


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self._ttft = Histogram(
            "ferrum_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._e2e = Histogram(
            "ferrum_e2e_request_latency_seconds",
            "From request arrival to its last token.",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._finished = Counter(
            "ferrum_api_requests_finished",
            "Engine requests the API saw finish, by finish reason (client disconnects not included).",
            ["model_name", "finish_reason"],
            registry=self.registry,
        )

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def observe_finished(self, seconds: float, finish_reason: str) -> None:
        self._e2e.labels(self.model_name).observe(seconds)
        self._finished.labels(self.model_name, finish_reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
