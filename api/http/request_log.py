"""Request logs and dumps: what each request asked for and got, one JSON line each.

With `log_requests` every finished request is logged at `log_requests_level`:
0, metadata (time, path, request ids, token counts, finish reasons, latency); 1, and the
sampling parameters (the body without its prompt); 2, and the prompt and outputs, each cut
at 2,048 characters; 3, and both whole. With `dump_requests_folder` every finished request
is written whole into JSONL files of `dump_requests_threshold` requests each, which
`runtime replay` re-sends with their original timing. A request refused before it started
(a 400) is in neither. Headers are never recorded, so the API key cannot leak through them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runtime.protocol import RequestOutput

PROMPT_FIELDS = ("prompt", "messages", "text", "input_ids")
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
    def __init__(self, config: LogConfig) -> None:
        self.config = LogConfig()
        self._dump: list[str] = []
        self._files = 0
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
        if config.dump_requests_folder is not None:
            Path(config.dump_requests_folder).mkdir(parents=True, exist_ok=True)
        self.flush()  # what the old folder was waiting for
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

    def _finish(self, record: dict[str, Any]) -> None:
        if self.config.log_requests:
            logger.info("%s", json.dumps(at_level(record, self.config.log_requests_level)))
        if self.config.dump_requests_folder is not None:
            self._dump.append(json.dumps(record))
            if len(self._dump) >= self.config.dump_requests_threshold:
                self.flush()

    def flush(self) -> None:
        """Write the dumped requests waiting in memory to a new file of the dump folder."""
        folder = self.config.dump_requests_folder
        if not self._dump or folder is None:
            self._dump.clear()
            return
        self._files += 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(folder) / f"requests-{stamp}-{os.getpid()}-{self._files}.jsonl"
        lines, self._dump = self._dump, []
        try:
            path.write_text("\n".join(lines) + "\n")
        except OSError as exc:  # a dump is never worth failing requests for: say it, go on
            logger.error("could not write %d dumped requests to %s: %s", len(lines), path, exc)


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
