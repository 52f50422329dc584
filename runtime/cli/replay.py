"""`runtime replay DUMP --url URL [--speed X]`: re-send the requests of a dump
(`--dump-requests-folder`) with their original timing, and print their latencies.

Each request goes to the route it came to, with the body it had, streamed (`stream: true` is
set, so that first tokens can be timed; the tokens are the same). Greedy requests must give
the text they gave when dumped: the summary counts those that did.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from runtime.cli.latency import RequestRecord, latency_summary, print_latency

STREAMED_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")


def load_dump(path: Path) -> list[dict[str, Any]]:
    """The dumped requests of a file, or of every `*.jsonl` in a folder, in arrival order."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    records = [json.loads(line) for f in files for line in f.read_text().splitlines() if line]
    return sorted(records, key=lambda r: r["time"])


def greedy(body: dict[str, Any]) -> bool:
    """Whether the request's texts must come out the same (an echo's hold its prompt too,
    which the dump leaves out)."""
    params = body.get("sampling_params", body)
    return params.get("temperature") == 0 and not body.get("echo")


async def replay_one(
    http: httpx.AsyncClient, dumped: dict[str, Any]
) -> tuple[RequestRecord, list[str]]:
    """Send one dumped request, streamed; its timings and its texts, per choice."""
    path, body = dumped["path"], dict(dumped["body"])
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
    if path == "/generate":  # SGLang's events carry the sample's whole text so far
        i = event.get("index", 0)  # which sample, with n > 1
        grew = len(event["text"]) > len(texts.get(i, ""))
        texts[i] = event["text"]
        record.sample_tokens[i] = event["meta_info"]["completion_tokens"]
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
    dump: list[dict[str, Any]], url: str, speed: float, api_key: str | None
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[tuple[dict[str, Any], RequestRecord, list[str]]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as http:

        async def send(dumped: dict[str, Any]) -> None:
            record, texts = await replay_one(http, dumped)
            results.append((dumped, record, texts))

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            first = dump[0]["time"] if dump else 0.0
            for dumped in dump:
                if dumped["path"] not in STREAMED_PATHS:
                    continue
                await trio.sleep_until(trio.current_time() + _wait(dumped, first, speed, started))
                nursery.start_soon(send, dumped)
        duration = time.perf_counter() - started
    summary = latency_summary([record for _, record, _ in results], duration)
    checked = [(d, texts) for d, record, texts in results if greedy(d["body"]) and not record.error]
    same = sum(texts == [o["text"] for o in d["outputs"]] for d, texts in checked)
    return summary | {"greedy_checked": len(checked), "greedy_same": same}


def _wait(dumped: dict[str, Any], first: float, speed: float, started: float) -> float:
    """Seconds from now until the request is due: its offset in the dump, sped up."""
    due = started + (dumped["time"] - first) / speed
    return max(0.0, due - time.perf_counter())


def main(dump_path: str, url: str, speed: float, api_key: str | None) -> int:
    dump = load_dump(Path(dump_path))
    if not dump:
        print(f"no requests in {dump_path}")
        return 1
    summary = trio.run(replay, dump, url, speed, api_key)
    print(f"replayed {len(dump)} requests from {dump_path} against {url} at {speed:g}x")
    print_latency(summary)
    print(
        f"  greedy requests with the dumped output: {summary['greedy_same']} of "
        f"{summary['greedy_checked']}"
    )
    return 0
