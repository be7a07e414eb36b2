"""Prometheus metrics, named as vLLM's are (`vllm:x` is `ferrum_x` here) under Prometheus'
conventions: counters end in `_total`, units are in the names (`_seconds`, `_bytes`), ratios are
0-1 (`ferrum_kv_cache_usage_perc` is a fraction, as vLLM's is).

Engine state is read at scrape time (running and waiting requests, KV cache, prefix cache,
preemptions, tokens); request latencies are observed by the API as outputs arrive (time to first
token, inter-token latency, end-to-end latency, queue time, tokens per request, success by finish
reason); admission refusals by reason; the weights' load by source. Each app has its own
registry, so several apps (tests) in one process do not collide. `METRIC_NAMES` lists every family,
`SPEC_METRIC_NAMES` those of speculative decoding, exposed while the engine speculates (the Grafana
dashboard deploy/grafana/ferrum.json reads them all; a test checks that it reads no other).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ferrum.engine.async_engine import EngineClient
    from ferrum.server.state import ServerState

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

METRIC_NAMES = frozenset({
    "ferrum_server_ready", "ferrum_num_requests_running", "ferrum_num_requests_waiting",
    "ferrum_api_requests_in_flight", "ferrum_api_waiting_prompt_tokens", "ferrum_kv_blocks_used",
    "ferrum_kv_blocks_total", "ferrum_kv_cache_usage_perc", "ferrum_num_preemptions_total",
    "ferrum_prompt_tokens_total", "ferrum_generation_tokens_total", "ferrum_prefix_cache_queries_total",
    "ferrum_prefix_cache_hits_total", "ferrum_requests_finished_total", "ferrum_request_success_total",
    "ferrum_requests_rejected_total", "ferrum_time_to_first_token_seconds", "ferrum_inter_token_latency_seconds",
    "ferrum_e2e_request_latency_seconds", "ferrum_request_queue_time_seconds", "ferrum_request_prompt_tokens",
    "ferrum_request_generation_tokens", "ferrum_weight_load_bytes_total", "ferrum_weight_load_seconds_total",
})
# exposed while the engine speculates (--speculative-config), as vLLM exposes its own
SPEC_METRIC_NAMES = frozenset({
    "ferrum_spec_decode_num_drafts_total", "ferrum_spec_decode_num_draft_tokens_total",
    "ferrum_spec_decode_num_accepted_tokens_total", "ferrum_spec_decode_num_accepted_tokens_per_pos_total",
})


class _EngineCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        labels = [m.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("ferrum_server_ready", "1 while the server is ready (GET /ready answers 200).",
                    1.0 if m.state is not None and m.state.ready else 0.0)
        yield gauge("ferrum_api_requests_in_flight", "Engine requests admitted by the API and not finished.",
                    m.in_flight())
        yield gauge("ferrum_api_waiting_prompt_tokens", "Prompt tokens of admitted requests not yet started.",
                    m.waiting_tokens())
        engine = m.engine
        if engine is None:
            return
        s = engine.stats()
        yield gauge("ferrum_num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("ferrum_num_requests_waiting", "Requests queued for the running batch.", s.num_waiting)
        yield gauge("ferrum_kv_blocks_used", "KV cache blocks in use.", s.kv_blocks_used)
        yield gauge("ferrum_kv_blocks_total", "KV cache blocks in all.", s.kv_blocks_total)
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        yield gauge("ferrum_kv_cache_usage_perc", "KV cache usage (0-1: the fraction of blocks in use).", usage)
        yield counter("ferrum_num_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions)
        yield counter("ferrum_requests_finished", "Requests the engine finished.", s.requests_finished)
        yield counter("ferrum_prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total)
        yield counter("ferrum_generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("ferrum_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queries)
        yield counter("ferrum_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.",
                      s.prefix_cache_hits)
        if s.spec_accepted_per_position:  # speculative decoding on (vLLM's names)
            yield counter("ferrum_spec_decode_num_drafts", "Drafts verified (one per sequence and step).",
                          s.spec_num_drafts)
            yield counter("ferrum_spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens)
            yield counter("ferrum_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          s.spec_num_accepted_tokens)
            per_pos = CounterMetricFamily("ferrum_spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft (0: the first).",
                                          labels=["model_name", "position"])
            for position, accepted in enumerate(s.spec_accepted_per_position):
                per_pos.add_metric([m.model_name, str(position)], accepted)
            yield per_pos
        load = engine.weight_load
        if load is not None:
            for name, doc, value in (
                ("ferrum_weight_load_bytes", "Bytes of model weights loaded, by source kind.", load.nbytes),
                ("ferrum_weight_load_seconds", "Seconds spent loading model weights, by source kind.", load.seconds),
            ):
                c = CounterMetricFamily(name, doc, labels=["model_name", "source"])
                c.add_metric([m.model_name, load.source], value)
                yield c


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine: EngineClient | None = None  # set once the model is loaded
        self.state: ServerState | None = None
        self.in_flight: Callable[[], int] = lambda: 0
        self.waiting_tokens: Callable[[], int] = lambda: 0
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

        self._ttft = histogram("ferrum_time_to_first_token_seconds",
                               "From request arrival to its first generated token.", _LATENCY_BUCKETS)
        self._itl = histogram("ferrum_inter_token_latency_seconds",
                              "Between consecutive generated tokens of a request (a delta of several tokens "
                              "counts each at the delta's gap over its tokens).", _ITL_BUCKETS)
        self._e2e = histogram("ferrum_e2e_request_latency_seconds", "From request arrival to its last token.",
                              _LATENCY_BUCKETS)
        self._queue = histogram("ferrum_request_queue_time_seconds",
                                "Time a request waited in the engine's queue before its first step.", _LATENCY_BUCKETS)
        self._prompt_tokens = histogram("ferrum_request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self._generation_tokens = histogram("ferrum_request_generation_tokens", "Generated tokens per request.",
                                            _TOKEN_BUCKETS)
        self._success = Counter(
            "ferrum_request_success", "Requests finished, by finish reason (stop, length, abort).",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self._rejected = Counter(
            "ferrum_requests_rejected", "Requests refused before reaching the engine, by reason.",
            ["model_name", "reason"], registry=self.registry,
        )

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def observe_tokens(self, gap_seconds: float, num_tokens: int) -> None:
        per_token = gap_seconds / num_tokens
        for _ in range(num_tokens):
            self._itl.labels(self.model_name).observe(per_token)

    def observe_queue_time(self, seconds: float) -> None:
        self._queue.labels(self.model_name).observe(seconds)

    def observe_finished(self, seconds: float, finish_reason: str, prompt_tokens: int, output_tokens: int) -> None:
        self._e2e.labels(self.model_name).observe(seconds)
        self._success.labels(self.model_name, finish_reason).inc()
        self._prompt_tokens.labels(self.model_name).observe(prompt_tokens)
        self._generation_tokens.labels(self.model_name).observe(output_tokens)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
