"""Refused clients (a wrong API key, no connection slot), logged with their address at most
once per INTERVAL seconds with the count since: a flood cannot flood the log."""

from __future__ import annotations

import logging
import math
import time


class RefusalLog:
    INTERVAL = 10.0

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._last = -math.inf
        self._since = 0

    def note(self, what: str, peer: str) -> None:
        self._since += 1
        now = time.monotonic()
        if now - self._last < self.INTERVAL:
            return
        self._logger.warning("%s (from %s; %d refused since the last line)", what, peer,
                             self._since)  # fmt: skip
        self._last, self._since = now, 0
