"""Request logs and dumps: what each request asked for and got, one JSON line each.

With `log_requests` every finished request is logged at `log_requests_level`:
0, metadata (time, path, request ids, token counts, finish reasons, latency); 1, and the
sampling parameters (the body without its prompt); 2, and the prompt and outputs, each cut
at 2,048 characters; 3, and both whole. With `dump_requests_folder` every finished request
is written whole into JSONL files of `dump_requests_threshold` requests each, which
`runtime replay` re-sends with their original timing. A request refused before it started
(a 400) is in neither. Headers are never recorded, so the API key cannot leak through them.

Dumps are written by one task, off the event loop, from a bounded queue: a writer that falls
behind drops records (counted and logged), it never holds requests up. Each file is new and
private (api/http/files.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import trio

from api.http.files import NEW_PRIVATE
from runtime.protocol import Embedding, RequestOutput

PROMPT_FIELDS = ("prompt", "messages", "text", "input_ids", "input")
CUT = 2048  # characters of prompt and output kept at level 2

logger = logging.getLogger("runtime.requests")


@dataclass(frozen=True, slots=True)
class LogConfig:
    log_requests: bool = False
    log_requests_level: int = 0
    dump_requests_folder: str | None = None
    dump_requests_threshold: int = 1000


@dataclass(slots=True)
class Entry:
    """One request while it runs; its record once every prompt of it has ended."""

    time: float  # the epoch second it arrived
    started: float  # monotonic
    path: str
    body: dict[str, Any]
    rids: list[str]
    outputs: list[dict[str, Any]] = field(default_factory=list)
    open: int = 0

    def add(self, index: int, out: RequestOutput) -> None:
        o = self.outputs[index] if out.index == 0 else self._sample(index, out.index)
        o["text"] += out.text
        o["completion_tokens"] += len(out.token_ids)
        o["prompt_tokens"] = out.num_prompt_tokens
        o["cached_tokens"] = out.num_cached_tokens
        o["finish_reason"] = out.finish_reason

    def _sample(self, index: int, sample: int) -> dict[str, Any]:
        """Sample i > 0 of prompt `index` (n > 1): an output of its own, after the prompts'."""
        for o in self.outputs:
            if o.get("prompt_index") == index and o.get("sample") == sample:
                return o
        o = _empty_output() | {"prompt_index": index, "sample": sample}
        self.outputs.append(o)
        return o

    def record(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "path": self.path,
            "rids": self.rids,
            "latency_s": round(time.monotonic() - self.started, 6),
            "body": self.body,
            "outputs": self._in_choice_order(),
        }

    def _in_choice_order(self) -> list[dict[str, Any]]:
        """Each prompt's samples after it, as the API numbers choices (prompt * n + sample)."""
        prompts, samples = self.outputs[: len(self.rids)], self.outputs[len(self.rids) :]
        ordered = []
        for index, first in enumerate(prompts):
            ordered.append(first)
            mine = [o for o in samples if o["prompt_index"] == index]
            ordered += sorted(mine, key=lambda o: o["sample"])
        return ordered


class RequestLog:
    MAX_QUEUED = 4096  # dumped records waiting for the writer; more are dropped, and logged

    def __init__(self, config: LogConfig) -> None:
        self.config = LogConfig()
        self._queue, self._queued = trio.open_memory_channel[tuple[str, str, int]](self.MAX_QUEUED)
        self.dropped = 0  # records the writer could not take in time
        self.written = trio.Event()  # the writer has ended: every queued record is written
        self.configure(config)

    @property
    def active(self) -> bool:
        return self.config.log_requests or self.config.dump_requests_folder is not None

    def configure(self, config: LogConfig) -> None:
        """Switch to `config`; what was waiting for the old dump folder is written first."""
        if not 0 <= config.log_requests_level <= 3:
            raise ValueError("log_requests_level must be 0, 1, 2 or 3")
        if config.dump_requests_threshold < 1:
            raise ValueError("dump_requests_threshold must be at least 1")
        if config.dump_requests_folder is not None:  # the operator's (a route checks its own)
            Path(config.dump_requests_folder).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.config = config

    def update(self, **changes: Any) -> LogConfig:
        self.configure(replace(self.config, **changes))
        return self.config

    def begin(self, path: str, body: dict[str, Any], rids: list[str]) -> Entry:
        entry = Entry(time.time(), time.monotonic(), path, body, rids, open=len(rids))
        entry.outputs = [_empty_output() for _ in rids]
        return entry

    async def observe(
        self, stream: AsyncGenerator[RequestOutput, None], entry: Entry, index: int
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs, recorded as they pass; the entry ends with its last one."""
        try:
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    entry.add(index, out)
                    yield out
        finally:
            entry.open -= 1
            if entry.open == 0:
                self._finish(entry.record())

    def embedded(self, entry: Entry, results: Sequence[Embedding]) -> None:
        """An embedding request's record, once every input has its vector (the vectors are
        not recorded: numbers, not text)."""
        for output, result in zip(entry.outputs, results, strict=True):
            output["prompt_tokens"] = result.num_prompt_tokens
            output["cached_tokens"] = result.num_cached_tokens
            output["finish_reason"] = "stop"
        self._finish(entry.record())

    def _finish(self, record: dict[str, Any]) -> None:
        if self.config.log_requests:
            logger.info("%s", json.dumps(at_level(record, self.config.log_requests_level)))
        folder = self.config.dump_requests_folder
        if folder is not None:
            try:
                self._queue.send_nowait(
                    (folder, json.dumps(record), self.config.dump_requests_threshold)
                )
            except trio.WouldBlock:
                self.dropped += 1
                if self.dropped % 1000 == 1:  # a log line per thousand, not per request
                    logger.error("the dump writer is behind: %d requests not dumped", self.dropped)

    async def write_dumps(self) -> None:
        """The writer task: appends records to files of `threshold` records each, until the
        queue is closed (`close`) and drained."""
        files = DumpFiles()
        try:
            async with self._queued:
                async for folder, line, threshold in self._queued:
                    await trio.to_thread.run_sync(files.append, folder, line, threshold)
        finally:
            files.close()
            self.written.set()

    def close(self) -> None:
        """No more records: the writer writes what is queued, then ends."""
        self._queue.close()


class DumpFiles:
    """The dump file being filled, in the writer's thread."""

    def __init__(self) -> None:
        self._file: BinaryIO | None = None
        self._folder = ""
        self._count = 0
        self._files = 0

    def append(self, folder: str, line: str, threshold: int) -> None:
        try:
            if self._file is None or folder != self._folder or self._count >= threshold:
                self._open(folder)
            assert self._file is not None
            self._file.write(line.encode() + b"\n")
            self._file.flush()
            self._count += 1
        except OSError as exc:  # a dump is never worth failing requests for: say it, go on
            logger.error("could not dump a request into %s: %s", folder, exc)

    def _open(self, folder: str) -> None:
        self.close()
        self._files += 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(folder) / f"requests-{stamp}-{os.getpid()}-{self._files}.jsonl"
        self._file = os.fdopen(os.open(path, NEW_PRIVATE, 0o600), "wb")
        self._folder, self._count = folder, 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def at_level(record: dict[str, Any], level: int) -> dict[str, Any]:
    """What `log_requests_level` shows of a request's record."""
    body, outputs = record["body"], record["outputs"]
    shown = {k: v for k, v in record.items() if k not in ("body", "outputs")}
    shown["outputs"] = [{k: v for k, v in o.items() if k != "text"} for o in outputs]
    if level >= 1:
        shown["params"] = {k: v for k, v in body.items() if k not in PROMPT_FIELDS}
    if level >= 2:
        prompt = {k: body[k] for k in PROMPT_FIELDS if k in body}
        texts = [o["text"] for o in outputs]
        if level == 2:
            prompt = {k: _cut(json.dumps(v)) for k, v in prompt.items()}
            texts = [_cut(t) for t in texts]
        shown["prompt"] = prompt
        for o, text in zip(shown["outputs"], texts, strict=True):
            o["text"] = text
    return shown


def _cut(text: str) -> str:
    return text if len(text) <= CUT else text[:CUT] + f"... ({len(text)} characters)"


def _empty_output() -> dict[str, Any]:
    return {
        "text": "",
        "completion_tokens": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "finish_reason": None,
    }
