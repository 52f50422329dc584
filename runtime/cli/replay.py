"""`runtime replay DUMP --url URL [--speed X]`: re-send the requests of a dump
(`--dump-requests-folder`) with their original timing, and print their latencies.

Each request goes to the route it came to, with the body it had, streamed (`stream: true` is
set, so that first tokens can be timed; the tokens are the same). Greedy requests must give
the text they gave when dumped: the summary counts those that did. No wait between two
requests is longer than `--max-wait`, and a long one is announced. The exit status is 1 if
any request failed, 2 for a dump or a key that cannot be read (the error names the line).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from runtime.cli.latency import RequestRecord, latency_summary, print_latency
from runtime.cli.parser import api_key

STREAMED_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
NOTICE_WAIT = 5.0  # seconds: a wait this long between two requests is announced


class DumpError(ValueError):
    """A line of the dump is not a dumped request; the message says which."""


@dataclass(frozen=True, slots=True)
class Dumped:
    """One dumped request: where it is in the dump, when it came, what it was and got."""

    where: str  # "FILE:LINE"
    time: float  # the epoch second it arrived
    path: str
    body: dict[str, Any]
    texts: list[str]  # its outputs' texts, in choice order


def load_dump(path: Path) -> list[Dumped]:
    """The dumped requests of a file, or of every `*.jsonl` in a folder, in arrival order."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    records = []
    for file in files:
        try:
            lines = file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise DumpError(f"cannot read {file}: {exc}") from None
        records += [parse_line(line, f"{file}:{n}") for n, line in enumerate(lines, 1) if line]
    return sorted(records, key=lambda r: r.time)


def parse_line(line: str, where: str) -> Dumped:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DumpError(f"{where}: not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise DumpError(f"{where}: not a dumped request (a JSON object)")
    arrived, path, body = record.get("time"), record.get("path"), record.get("body")
    outputs = record.get("outputs", [])
    if not isinstance(arrived, int | float) or not math.isfinite(arrived):
        raise DumpError(f"{where}: 'time' must be a number of seconds, not {arrived!r}")
    if not isinstance(path, str) or not isinstance(body, dict):
        raise DumpError(f"{where}: a dumped request has a 'path' string and a 'body' object")
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("text"), str) for o in outputs
    ):
        raise DumpError(f"{where}: 'outputs' must be a list of objects with a 'text'")
    return Dumped(where, float(arrived), path, body, [o["text"] for o in outputs])


def greedy(body: dict[str, Any]) -> bool:
    """Whether the request's texts must come out the same (an echo's hold its prompt too,
    which the dump leaves out)."""
    params = body.get("sampling_params", body)
    return params.get("temperature") == 0 and not body.get("echo")


async def replay_one(http: httpx.AsyncClient, dumped: Dumped) -> tuple[RequestRecord, list[str]]:
    """Send one dumped request, streamed; its timings and its texts, per choice."""
    path, body = dumped.path, dict(dumped.body)
    body["stream"] = True
    if path != "/generate":
        body["stream_options"] = {"include_usage": True}
    texts: dict[int, str] = {}
    record = RequestRecord(start=time.perf_counter())
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record, []
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if _take_event(json.loads(line[6:]), path, texts, record):
                    now = time.perf_counter()
                    record.first_token = record.first_token or now
                    record.chunk_times.append(now)
    except (httpx.HTTPError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    return record, [texts[i] for i in sorted(texts)]


def _take_event(
    event: dict[str, Any], path: str, texts: dict[int, str], record: RequestRecord
) -> bool:
    """Fold one SSE event into the texts so far; True if it carried text."""
    if "error" in event:
        record.error = str(event["error"])
        return False
    if path == "/generate":
        i = event.get("index", 0)  # which sample, with n > 1
        made = event["meta_info"]["completion_tokens"]
        # an event carries what is new, or (--cumulative-streaming-output, as SGLang's) the
        # sample's whole output so far: then its ids are all the tokens made
        whole = len(event["output_ids"]) == made
        grew = bool(event["text"]) and (not whole or len(event["text"]) > len(texts.get(i, "")))
        texts[i] = event["text"] if whole else texts.get(i, "") + event["text"]
        record.sample_tokens[i] = made
        record.output_tokens = sum(record.sample_tokens.values())
        return grew
    if event.get("usage"):
        record.output_tokens = event["usage"]["completion_tokens"]
    carried = False
    for choice in event.get("choices", []):
        piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        texts[choice["index"]] = texts.get(choice["index"], "") + piece
        carried = carried or bool(piece)
    return carried


async def replay(
    dump: list[Dumped], url: str, speed: float, max_wait: float, key: str | None
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    results: list[tuple[Dumped, RequestRecord, list[str]]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:

        async def send(dumped: Dumped) -> None:
            record, texts = await replay_one(http, dumped)
            results.append((dumped, record, texts))

        started, start = time.perf_counter(), trio.current_time()
        async with trio.open_nursery() as nursery:
            for offset, gap, dumped in schedule(dump, speed, max_wait):
                _announce(start + offset - trio.current_time(), gap > max_wait, gap, dumped)
                await trio.sleep_until(start + offset)
                nursery.start_soon(send, dumped)
        duration = time.perf_counter() - started
    summary = latency_summary([record for _, record, _ in results], duration)
    checked = [(d, texts) for d, record, texts in results if greedy(d.body) and not record.error]
    same = sum(texts == d.texts for d, texts in checked)
    return summary | {"greedy_checked": len(checked), "greedy_same": same}


def schedule(
    dump: list[Dumped], speed: float, max_wait: float
) -> list[tuple[float, float, Dumped]]:
    """(when, gap, request) for each request to send: seconds from the start of the replay,
    after the one before it in the dump (sped up), no more than `max_wait` later."""
    sent = [dumped for dumped in dump if dumped.path in STREAMED_PATHS]
    plan, offset = [], 0.0
    for i, dumped in enumerate(sent):
        gap = (dumped.time - sent[max(i - 1, 0)].time) / speed
        offset += min(gap, max_wait)
        plan.append((offset, gap, dumped))
    return plan


def _announce(wait: float, capped: bool, gap: float, dumped: Dumped) -> None:
    if wait < NOTICE_WAIT and not capped:
        return
    why = f", not the {gap:.0f} s of the dump (--max-wait)" if capped else ""
    print(f"waiting {wait:.0f} s for the request of {dumped.where}{why}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    try:
        key = api_key(args)
        dump = load_dump(Path(args.dump))
    except ValueError as exc:
        print(f"runtime replay: error: {exc}", file=sys.stderr)
        return 2
    if not dump:
        print(f"runtime replay: no requests in {args.dump}", file=sys.stderr)
        return 1
    summary = trio.run(replay, dump, args.url, args.speed, args.max_wait, key)
    sent = summary["completed"] + summary["errors"]
    print(f"replayed {sent} requests from {args.dump} against {args.url} at {args.speed:g}x")
    print_latency(summary)
    print(
        f"  greedy requests with the dumped output: {summary['greedy_same']} of "
        f"{summary['greedy_checked']}"
    )
    if summary["errors"]:
        print(f"runtime replay: {summary['errors']} requests failed", file=sys.stderr)
        return 1
    return 0
