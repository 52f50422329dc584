"""What the tests of the HTTP layer share (their `engine` and `client` fixtures are in conftest)."""

from __future__ import annotations

import json
from typing import Any

MODEL = "fake-model"


def sse_payloads(body: bytes) -> list[Any]:
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]
