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


async def post_streamed(client: Any, path: str, body: dict[str, Any]) -> bytes:
    """A POST's whole body, read as it comes: the test client's `post` reads it only after
    the route has finished, and its channel holds 10 pieces, so a longer stream would wait
    forever for a reader."""
    import trio

    headers = {"Content-Type": "application/json"}
    data = b""
    async with client.request(path, method="POST", headers=headers) as connection:
        await connection.send(json.dumps(body).encode())
        await connection.send_complete()
        while True:
            try:
                data += await connection.receive()
            except trio.EndOfChannel:
                return data
