"""Latency figures of streamed requests, as `benchmarks/serve.py` and `runtime replay` print
them: TTFT, ITL (gap between streamed chunks), TPOT ((end - first token) / (tokens - 1)) and
end-to-end percentiles, request and output-token throughput, and errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any


@dataclass
class RequestRecord:
    start: float = 0.0
    first_token: float | None = None
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    sample_tokens: dict[int, int] = field(default_factory=dict)  # /generate, n > 1: by sample


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def latency_summary(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.first_token is not None]
    itl = [b - a for r in ok for a, b in pairwise(r.chunk_times)]
    tpot = [
        (r.end - r.first_token) / (r.output_tokens - 1)  # type: ignore[operator]
        for r in ok
        if r.output_tokens > 1
    ]
    ttft = [r.first_token - r.start for r in ok]  # type: ignore[operator]
    ms = 1000.0
    return {
        "duration_s": duration,
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "error_samples": [r.error for r in records if r.error][:5],
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "ttft_ms": {k: v * ms for k, v in percentiles(ttft).items()},
        "itl_ms": {k: v * ms for k, v in percentiles(itl).items()},
        "tpot_ms": {k: v * ms for k, v in percentiles(tpot).items()},
        "e2e_ms": {k: v * ms for k, v in percentiles([r.end - r.start for r in ok]).items()},
    }


def print_latency(s: dict[str, Any]) -> None:
    print(
        f"  completed {s['completed']}, errors {s['errors']} in {s['duration_s']:.1f} s: "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s"
    )
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        p = s[name]
        print(
            f"  {name:8} mean {p['mean']:8.1f}  p50 {p['p50']:8.1f}  p90 {p['p90']:8.1f}  "
            f"p99 {p['p99']:8.1f}"
        )
    for sample in s["error_samples"]:
        print(f"  error: {sample}")
