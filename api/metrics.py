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
    def __init__(self, engine: EngineClient, connections: ConnectionStats) -> None:
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
