"""Bodies too large to hold in memory: the safetensors file of `/update_weights_from_tensor`.

Quart refuses a body whose Content-Length is over MAX_CONTENT_LENGTH (32 MiB here) when the
request is made, before routing. For the upload routes, `request_class` lifts that check and
keeps Quart's other one, which counts only the bytes received but not yet read: UNREAD_LIMIT
for a request with the right API key, the usual 32 MiB for one without (it gets a 401 and
parks no more than on any route). The handler streams the body to a private temporary file
and enforces its own cap on the total and a deadline between pieces. Uploads run one at a
time.
"""

from __future__ import annotations

import hmac
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from quart import request
from quart_trio.wrappers.request import TrioRequest
from werkzeug.datastructures import Headers

from api.http.errors import APIError

UNREAD_LIMIT = 128 * 2**20  # received but not yet written to the file
MAX_UPLOAD_BYTES = 64 * 2**30  # an 8B-parameter model in float32 is 32 GiB
PIECE_TIMEOUT = 60.0  # seconds the client may take to send the next piece of the body


def request_class(upload_paths: frozenset[str], api_key: str | None) -> type[TrioRequest]:
    """Quart's request, with no Content-Length limit on `upload_paths`."""

    class UploadingRequest(TrioRequest):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.path in upload_paths:
                authorized = api_key is None or _bearer_is(self.headers, api_key)
                limit = UNREAD_LIMIT if authorized else kwargs.get("max_content_length")
                self.body = self.body_class(None, limit)

    return UploadingRequest


def _bearer_is(headers: Headers, key: str) -> bool:
    scheme, _, given = headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), key.encode())


@asynccontextmanager
async def body_in_file(suffix: str, one_at_a_time: trio.Lock) -> AsyncIterator[str]:
    """The request's body, streamed into a fresh file only we can read (mode 0600), removed
    afterwards; 413 past MAX_UPLOAD_BYTES."""
    async with one_at_a_time:
        fd, path = tempfile.mkstemp(prefix="rt-upload-", suffix=suffix)
        try:
            async with await trio.open_file(fd, "wb") as file:
                size = 0
                while (chunk := await _next_piece()) is not None:
                    size += len(chunk)
                    if size > MAX_UPLOAD_BYTES:
                        raise APIError(
                            413, f"the body is over {MAX_UPLOAD_BYTES} bytes", code="body_too_large"
                        )
                    await file.write(chunk)
            yield path
        finally:
            os.unlink(path)


async def _next_piece() -> bytes | None:
    with trio.move_on_after(PIECE_TIMEOUT):
        try:
            return await request.body.__anext__()
        except StopAsyncIteration:
            return None
    raise APIError(408, f"no part of the body came for {PIECE_TIMEOUT:g} s", code="timeout")
