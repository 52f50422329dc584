"""Progress of a long step: a bar on a terminal, a few log lines anywhere else (a bar's
carriage-return frames make a log file unreadable)."""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType

from tqdm import tqdm

logger = logging.getLogger("runtime")

# Seconds between log lines when stderr is not a terminal.
LOG_INTERVAL = 10.0


class Progress:
    """`with Progress(total, "Converting", "tensor") as progress: ... progress.advance()`"""

    def __init__(self, total: int, description: str, unit: str) -> None:
        self.total, self.description, self.unit = total, description, unit
        self.done = 0
        self.bar = tqdm(total=total, desc=description, unit=unit) if sys.stderr.isatty() else None
        self.started = self.logged = time.monotonic()

    def __enter__(self) -> Progress:
        if self.bar is None:
            logger.info("%s: %d %ss", self.description, self.total, self.unit)
        return self

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update()
        elif time.monotonic() - self.logged >= LOG_INTERVAL:
            self.logged = time.monotonic()
            logger.info("%s: %d/%d %ss", self.description, self.done, self.total, self.unit)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self.bar is not None:
            self.bar.close()
        elif kind is None:
            elapsed = time.monotonic() - self.started
            logger.info("%s: done in %.1f s", self.description, elapsed)
