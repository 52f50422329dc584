"""Prometheus metrics: the engine's latest statistics read at scrape time, latency histograms
observed by the request handlers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.http.connections import ConnectionStats
from runtime.protocol import EngineClient, EngineStats, RankStats

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
            "Connections answered 503 because --max-connections were open, each with a "
            "request under way.",
            s.refused,
        )
        yield CounterMetricFamily(
            "runtime:http_connections_evicted",
            "Idle connections closed to make room for a new one at --max-connections.",
            s.evicted,
        )
        yield CounterMetricFamily(
            "runtime:http_send_timeouts",
            "Connections closed because their client took no data for --send-timeout.",
            s.send_timeouts,
        )


class _EngineCollector(Collector):
    """The engine's figures, one sample per data-parallel group (label `dp_rank`)."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()  # the latest snapshot: a scrape never waits
        yield from _per_rank("runtime", _ENGINE_FIGURES, stats.per_rank(), ["dp_rank"])
        yield from _time_split(stats)


class _VLLMCollector(Collector):
    """vLLM's names for the same figures, which the Kubernetes Gateway API Inference
    Extension and vLLM's production stack scrape; like vLLM, each data-parallel group is
    an `engine`."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        ranks = self._engine.statistics().per_rank()
        labels = ["engine", "model_name"]
        yield from _per_rank("vllm", _VLLM_FIGURES, ranks, labels, self._model_name)
        info = self._engine.server_info()
        cache = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the KV cache.", labels=[*_CACHE, "engine"]
        )
        for rank in ranks:
            values = (
                info.get("block_size"),
                rank.scheduler.num_total_blocks or info.get("num_kv_blocks"),
                info.get("dtype"),
                info.get("enable_prefix_caching"),
                rank.dp_rank,
            )
            cache.add_metric([str(v) for v in values], 1)
        yield cache


Family = type[GaugeMetricFamily] | type[CounterMetricFamily]
Figure = tuple[Family, str, str, Callable[[RankStats], float]]  # family, name, doc, value


def _per_rank(
    prefix: str, figures: tuple[Figure, ...], ranks: tuple[RankStats, ...], labels: list[str],
    *more_labels: str,
) -> Iterator[Metric]:  # fmt: skip
    """One metric per figure, one sample per data-parallel group (its rank, the first label)."""
    for family, name, documentation, value in figures:
        metric = family(f"{prefix}:{name}", documentation, labels=labels)
        for rank in ranks:
            metric.add_metric([str(rank.dp_rank), *more_labels], value(rank))
        yield metric


def _kv_cache_usage(rank: RankStats) -> float:
    s = rank.scheduler
    used = s.num_total_blocks - s.num_free_blocks
    return used / s.num_total_blocks if s.num_total_blocks else 0.0


_ENGINE_FIGURES: tuple[Figure, ...] = (
    (GaugeMetricFamily, "num_requests_running", "Sequences in the running batch.",
     lambda r: r.scheduler.num_running),
    (GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to be scheduled.",
     lambda r: r.scheduler.num_waiting),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
     _kv_cache_usage),
    (CounterMetricFamily, "prompt_tokens", "Prompt tokens submitted.",
     lambda r: r.prompt_tokens_total),
    (CounterMetricFamily, "generation_tokens", "Tokens generated.",
     lambda r: r.scheduler.num_generated_tokens),
    (CounterMetricFamily, "num_preemptions", "Sequences preempted.",
     lambda r: r.scheduler.num_preemptions),
    (CounterMetricFamily, "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
     lambda r: r.scheduler.num_cached_tokens),
    (CounterMetricFamily, "embedding_requests", "Embedding inputs pooled into a vector.",
     lambda r: r.scheduler.num_embeddings),
    (CounterMetricFamily, "embedding_prompt_tokens", "Prompt tokens of those embedding inputs.",
     lambda r: r.scheduler.num_embedding_tokens),
)  # fmt: skip
_VLLM_FIGURES: tuple[Figure, ...] = (
    (GaugeMetricFamily, "num_requests_running", "Requests running.",
     lambda r: r.scheduler.num_running),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting.",
     lambda r: r.scheduler.num_waiting + r.scheduler.num_held),
    (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
     _kv_cache_usage),
    (CounterMetricFamily, "prefix_cache_queries", "Prefix cache queries, in tokens.",
     lambda r: r.prompt_tokens_total),
    (CounterMetricFamily, "prefix_cache_hits", "Prefix cache hits, in tokens.",
     lambda r: r.scheduler.num_cached_tokens),
)  # fmt: skip
_CACHE = ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"]


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
        ("tensor_parallel_communicate", w.communicate_seconds),
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
