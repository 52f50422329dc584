"""The engine's load as routers read it: SGLang's `/v1/loads` entry and legacy `/get_load`."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from runtime.engine_client import EngineStats


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


def load_entry(stats: EngineStats, block_size: int, throughput: float) -> dict[str, Any]:
    """One data-parallel rank's load, in SGLang's `/v1/loads` shape.

    Tokens are KV slots: `num_used_tokens` counts the blocks requests hold (cached prefixes
    nobody holds are free). `utilization` is the larger of the batch's fill and the KV's
    (SGLang leaves it 0 unless an SLO is configured).
    """
    s = stats.scheduler
    total = s.num_total_blocks * block_size
    used = (s.num_total_blocks - s.num_free_blocks) * block_size
    token_usage = used / total if total else 0.0
    waiting = s.num_waiting + s.num_held
    prompts = stats.frontend.prompt_tokens_total
    return {
        "dp_rank": 0,
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


def legacy_load(entry: dict[str, Any]) -> dict[str, Any]:
    """SGLang's older `/get_load` entry (0.5.10's keys)."""
    return {
        "dp_rank": entry["dp_rank"],
        "num_reqs": entry["num_total_reqs"],
        "num_waiting_reqs": entry["num_waiting_reqs"],
        "num_tokens": entry["num_used_tokens"] + entry["num_waiting_uncached_tokens"],
        "ts_tic": time.perf_counter(),
    }
