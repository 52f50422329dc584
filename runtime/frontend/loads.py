"""The engine's load as routers read it: SGLang's `/v1/loads` entry (`get_load`) and the
`internal_states` entry of its server info (`get_internal_state`)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from runtime.protocol import EngineStats, RankStats


class ThroughputMeter:
    """Generated tokens per second over about the last WINDOW seconds, from the engine's token
    counter as read at each poll (a scrape, a load report)."""

    WINDOW = 10.0
    SPACING = 0.1  # reads closer together than this share a sample

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def rate(self, generated: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if not self._samples or now - self._samples[-1][0] >= self.SPACING:
            self._samples.append((now, generated))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.WINDOW:
            self._samples.popleft()
        then, before = self._samples[0]
        return (generated - before) / (now - then) if now > then else 0.0


def load_entry(rank: RankStats, block_size: int, throughput: float) -> dict[str, Any]:
    """One data-parallel rank's load, in SGLang's `/v1/loads` shape.

    Tokens are KV slots: `num_used_tokens` counts the blocks requests hold (cached prefixes
    nobody holds are free). `utilization` is the larger of the batch's fill and the KV's
    (SGLang leaves it 0 unless an SLO is configured).
    """
    s = rank.scheduler
    total = s.num_total_blocks * block_size
    used = (s.num_total_blocks - s.num_free_blocks) * block_size
    token_usage = used / total if total else 0.0
    waiting = s.num_waiting + s.num_held
    prompts = rank.prompt_tokens_total
    return {
        "dp_rank": rank.dp_rank,
        "num_running_reqs": s.num_running,
        "num_waiting_reqs": waiting,
        "num_waiting_uncached_tokens": s.num_waiting_uncached_tokens,
        "num_total_reqs": s.num_running + waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": round(token_usage, 4),
        "gen_throughput": round(throughput, 3),
        "cache_hit_rate": round(s.num_cached_tokens / prompts, 4) if prompts else 0.0,
        "utilization": round(max(s.num_running / max(s.max_num_seqs, 1), token_usage), 4),
        "max_running_requests": s.max_num_seqs,
    }


def internal_state(load: dict[str, Any]) -> dict[str, Any]:
    """SGLang's `internal_states` entry, from a `load_entry`."""
    return {
        "last_gen_throughput": load["gen_throughput"],
        "#running": load["num_running_reqs"],
        "#queue-req": load["num_waiting_reqs"],
        "token_usage": load["token_usage"],
        "memory_usage": {"token_capacity": load["max_total_num_tokens"]},
        "effective_max_running_requests_per_dp": load["max_running_requests"],
    }


class LoadReports:
    """`get_loads` and `get_internal_state` from the engine's statistics, with a throughput
    meter per data-parallel group."""

    def __init__(self, block_size: int, num_groups: int) -> None:
        self.block_size = block_size
        self._meters = [ThroughputMeter() for _ in range(num_groups)]

    def loads(self, stats: EngineStats) -> list[dict[str, Any]]:
        loads = []
        for rank, meter in zip(stats.per_rank(), self._meters, strict=True):
            throughput = meter.rate(rank.scheduler.num_generated_tokens)
            loads.append(load_entry(rank, self.block_size, throughput))
        return loads

    def internal_state(self, stats: EngineStats) -> list[dict[str, Any]]:
        return [internal_state(load) for load in self.loads(stats)]
