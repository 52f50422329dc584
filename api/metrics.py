"""Prometheus metrics: engine gauges and counters read at scrape time, latency histograms
observed by the request handlers."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runtime.protocol import EngineStats

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


class _EngineCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        stats = self._metrics.stats
        if stats is None:
            return
        yield GaugeMetricFamily(
            "runtime:num_requests_running",
            "Sequences in the running batch.",
            stats.num_requests_running,
        )
        yield GaugeMetricFamily(
            "runtime:num_requests_waiting",
            "Sequences waiting to be scheduled.",
            stats.num_requests_waiting,
        )
        yield GaugeMetricFamily(
            "runtime:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0 to 1).",
            stats.kv_cache_usage,
        )
        yield CounterMetricFamily(
            "runtime:prompt_tokens", "Prompt tokens submitted.", stats.prompt_tokens_total
        )
        yield CounterMetricFamily(
            "runtime:generation_tokens", "Tokens generated.", stats.generation_tokens_total
        )
        yield CounterMetricFamily(
            "runtime:num_preemptions", "Sequences preempted.", stats.scheduler.num_preemptions
        )
        yield CounterMetricFamily(
            "runtime:prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache.",
            stats.scheduler.num_cached_tokens,
        )
        yield from _time_split(stats)


def _time_split(stats: EngineStats) -> Iterator[Metric]:
    """Where engine time goes, for benchmarks: divide by runtime:engine_steps_total."""
    s = stats.scheduler
    yield CounterMetricFamily("runtime:engine_steps", "Engine steps run.", s.num_steps)
    phases = CounterMetricFamily(
        "runtime:step_phase_seconds",
        "Seconds spent per engine-step phase, in total.",
        labels=["phase"],
    )
    for phase, seconds in (
        ("schedule", s.schedule_seconds),
        ("update", s.update_seconds),
        ("prepare", s.prepare_seconds),
        ("forward", s.forward_seconds),
        ("sample", s.sample_seconds),
        ("worker_idle", s.worker_idle_seconds),
        ("scheduler_wait", s.wait_seconds),
        ("dispatch", stats.dispatch_seconds),
        ("detokenize", stats.detokenize_seconds),
    ):
        phases.add_metric([phase], seconds)
    yield phases


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.stats: EngineStats | None = None
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
        self.registry.register(_EngineCollector(self))

    def render(self, stats: EngineStats) -> bytes:
        self.stats = stats
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
