"""Prometheus metrics: the engine's latest statistics read at scrape time, latency histograms
observed by the request handlers."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.connections import ConnectionStats
from runtime.engine_client import EngineClient, EngineStats

# Seconds: from a loaded CPU (tens of ms per step) up to long generations.
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


class _ConnectionCollector(Collector):
    def __init__(self, stats: ConnectionStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        yield GaugeMetricFamily("runtime:http_connections_open", "Open HTTP connections.", s.open)
        yield CounterMetricFamily(
            "runtime:http_connections_refused",
            "Connections answered 503 because --max-connections were open.",
            s.refused,
        )
        yield CounterMetricFamily(
            "runtime:http_send_timeouts",
            "Connections closed because their client took no data for --send-timeout.",
            s.send_timeouts,
        )


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()  # the latest snapshot: a scrape never waits
        s = stats.scheduler
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for family, name, documentation, value in (
            (gauge, "num_requests_running", "Sequences in the running batch.", s.num_running),
            (gauge, "num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            (
                gauge,
                "kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0 to 1).",
                stats.kv_cache_usage,
            ),
            (
                counter,
                "prompt_tokens",
                "Prompt tokens submitted.",
                stats.frontend.prompt_tokens_total,
            ),
            (counter, "generation_tokens", "Tokens generated.", s.num_generated_tokens),
            (counter, "num_preemptions", "Sequences preempted.", s.num_preemptions),
            (
                counter,
                "prefix_cache_hit_tokens",
                "Prompt tokens served from the prefix cache.",
                s.num_cached_tokens,
            ),
        ):
            yield family(f"runtime:{name}", documentation, value)
        yield from _time_split(stats)


class _VLLMCollector(Collector):
    """vLLM's names for the same figures, which the Kubernetes Gateway API Inference
    Extension and vLLM's production stack scrape."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self._engine = engine
        self._labels = {"model_name": model_name, "engine": "0"}

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        s = stats.scheduler
        names, values = list(self._labels), list(self._labels.values())
        for family, name, documentation, value in (
            (GaugeMetricFamily, "num_requests_running", "Requests running.", s.num_running),
            (
                GaugeMetricFamily,
                "num_requests_waiting",
                "Requests waiting.",
                s.num_waiting + s.num_held,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "KV-cache usage; 1 means 100 percent.",
                stats.kv_cache_usage,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prefix cache queries, in tokens.",
                stats.frontend.prompt_tokens_total,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Prefix cache hits, in tokens.",
                s.num_cached_tokens,
            ),
        ):
            metric = family(f"vllm:{name}", documentation, labels=names)
            metric.add_metric(values, value)
            yield metric
        info = self._engine.server_info()
        config = {
            "block_size": info.get("block_size"),
            "num_gpu_blocks": info.get("num_kv_blocks"),
            "cache_dtype": info.get("dtype"),
            "enable_prefix_caching": info.get("enable_prefix_caching"),
            "engine": "0",
        }
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the KV cache.", labels=list(config)
        )
        cache.add_metric([str(v) for v in config.values()], 1)
        yield cache


def _time_split(stats: EngineStats) -> Iterator[Metric]:
    """Where engine time goes, for benchmarks: divide by runtime:engine_steps_total."""
    s, w, f = stats.scheduler, stats.worker, stats.frontend
    yield CounterMetricFamily("runtime:engine_steps", "Engine steps run.", s.num_steps)
    phases = CounterMetricFamily(
        "runtime:step_phase_seconds",
        "Seconds spent per engine-step phase, in total.",
        labels=["phase"],
    )
    for phase, seconds in (
        ("schedule", s.schedule_seconds),
        ("update", s.update_seconds),
        ("prepare", w.prepare_seconds),
        ("forward", w.forward_seconds),
        ("sample", w.sample_seconds),
        ("worker_idle", w.idle_seconds),
        ("scheduler_wait", s.wait_seconds),
        ("dispatch", f.dispatch_seconds),
        ("detokenize", f.detokenize_seconds),
    ):
        phases.add_metric([phase], seconds)
    yield phases


class Metrics:
    def __init__(self, engine: EngineClient, connections: ConnectionStats, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram(
            "runtime:time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "runtime:inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "runtime:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))
        self.registry.register(_ConnectionCollector(connections))
        self.registry.register(_VLLMCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Observes one request's TTFT, inter-token latencies and end-to-end latency."""

    __slots__ = ("_last", "_metrics", "_start")

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._start = time.perf_counter()
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.observe(now - self._start)
            count -= 1
        if count > 0:  # several tokens arrived together: spread the gap over them
            gap = (now - (self._last if self._last is not None else now)) / count
            for _ in range(count):
                self._metrics.itl.observe(gap)
        self._last = now

    def finish(self) -> None:
        self._metrics.e2e.observe(time.perf_counter() - self._start)
