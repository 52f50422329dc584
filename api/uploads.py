"""Bodies too large to hold in memory: the safetensors file of `/update_weights_from_tensor`.

Quart refuses a body whose Content-Length is over MAX_CONTENT_LENGTH (32 MiB here) when the
request is made, before routing. For the upload routes, `request_class` lifts that check and
keeps Quart's other one, which counts only the bytes received but not yet read; the handler
streams the body to a private temporary file and enforces its own cap on the total. A client
that is answered without its body being read (a 401, or the route switched off) can still
park no more than the unread cap in memory.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from quart import request
from quart_trio.wrappers.request import TrioRequest

from api.errors import APIError

UNREAD_LIMIT = 128 * 2**20  # received but not yet written to the file
MAX_UPLOAD_BYTES = 64 * 2**30  # an 8B-parameter model in float32 is 32 GiB


def request_class(upload_paths: frozenset[str]) -> type[TrioRequest]:
    """Quart's request, with no Content-Length limit on `upload_paths`."""

    class UploadingRequest(TrioRequest):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.path in upload_paths:
                self.body = self.body_class(None, UNREAD_LIMIT)

    return UploadingRequest


@asynccontextmanager
async def body_in_file(suffix: str) -> AsyncIterator[str]:
    """The request's body, streamed into a fresh file only we can read (mode 0600), removed
    afterwards; 413 past MAX_UPLOAD_BYTES."""
    fd, path = tempfile.mkstemp(prefix="rt-upload-", suffix=suffix)
    try:
        async with await trio.open_file(fd, "wb") as file:
            size = 0
            async for chunk in request.body:
                size += len(chunk)
                if size > MAX_UPLOAD_BYTES:
                    raise APIError(
                        413, f"the body is over {MAX_UPLOAD_BYTES} bytes", code="body_too_large"
                    )
                await file.write(chunk)
        yield path
    finally:
        os.unlink(path)
