"""Bodies too large to hold in memory: the safetensors file of `/update_weights_from_tensor`.

Their routes have no limit on the whole body (api/http/budget.py): only the bytes received
but not yet written count, and only for a request with the right API key (one without gets a
401 and parks no more than on any route). The handler streams the body to a private
temporary file and enforces its own cap on the total, a deadline between pieces and one for
the whole body. Uploads run one at a time.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
from quart import request

from api.http.errors import APIError

MAX_UPLOAD_BYTES = 64 * 2**30  # an 8B-parameter model in float32 is 32 GiB
PIECE_TIMEOUT = 60.0  # seconds the client may take to send the next piece of the body
UPLOAD_TIMEOUT = 1800.0  # seconds the whole body may take: 32 GiB at 18 MiB/s
MAX_HEADER_BYTES = 16 * 2**20  # safetensors' own limit is 100 MB; a 1000-tensor header is 100 kB
# What a tensor's element takes, by safetensors' dtype name: the floating point ones, which
# are all weights can be (others are refused as soon as the header is in).
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


@asynccontextmanager
async def body_in_file(suffix: str, one_at_a_time: trio.Lock) -> AsyncIterator[str]:
    """The request's body, a safetensors file, streamed into a fresh file only we can read
    (mode 0600), removed afterwards. Its header is checked as soon as it is in, before any
    tensor data is stored (400: not a safetensors file of weights; 413: over
    MAX_UPLOAD_BYTES); then the body must be exactly as long as the header says, and all of
    it must come within UPLOAD_TIMEOUT (408)."""
    async with one_at_a_time:
        fd, path = tempfile.mkstemp(prefix="rt-upload-", suffix=suffix)
        try:
            with trio.move_on_after(UPLOAD_TIMEOUT) as upload:
                async with await trio.open_file(fd, "wb") as file:
                    await _store(file.write)
            if upload.cancelled_caught:
                raise APIError(
                    408, f"the body did not all come within {UPLOAD_TIMEOUT:g} s", code="timeout"
                )
            yield path
        finally:
            os.unlink(path)


async def _store(write: Callable[[bytes], Awaitable[object]]) -> None:
    head = bytearray()  # the header's length and the header, until they are in
    size, expected = 0, None
    while (chunk := await _next_piece()) is not None:
        size += len(chunk)
        if expected is None:
            head += chunk
            expected = header_says(bytes(head))
        if expected is not None and size > expected:
            raise APIError(400, f"the body is longer than its header says ({expected} bytes)",
                           code="invalid_body")  # fmt: skip
        await write(chunk)
    if expected is None or size < expected:
        raise APIError(400, "the body ended before the safetensors file it begins did",
                       code="invalid_body")  # fmt: skip


def header_says(head: bytes) -> int | None:
    """The whole file's length, from its beginning, once the header is in (None before);
    an APIError if it is no safetensors header of floating point tensors."""
    if len(head) < 8:
        return None
    length = int.from_bytes(head[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise _not_safetensors(f"a header of {length} bytes (at most {MAX_HEADER_BYTES})")
    if len(head) < 8 + length:
        return None
    try:
        header = json.loads(head[8 : 8 + length])
    except ValueError:
        raise _not_safetensors("its header is not JSON") from None
    if not isinstance(header, dict):
        raise _not_safetensors("its header is not a JSON object")
    header.pop("__metadata__", None)
    data = sum(_tensor_bytes(name, entry) for name, entry in header.items())
    _check_offsets(header)
    total = 8 + length + data
    if total > MAX_UPLOAD_BYTES:
        raise APIError(413, f"the body would be {total} bytes, over {MAX_UPLOAD_BYTES}",
                       code="body_too_large")  # fmt: skip
    return total


def _tensor_bytes(name: str, entry: object) -> int:
    if not isinstance(entry, dict):
        raise _not_safetensors(f"{name!r} is not described by an object")
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if dtype not in ITEM_BYTES:
        raise _not_safetensors(f"{name!r} has dtype {dtype!r}: weights are floating point "
                               f"({', '.join(ITEM_BYTES)})")  # fmt: skip
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _not_safetensors(f"{name!r} has no valid shape")
    return math.prod(shape) * ITEM_BYTES[dtype]


def _check_offsets(header: dict[str, dict[str, Any]]) -> None:
    """The tensors' data must tile the data section, in order, each its own size."""
    spans = []
    for name, entry in header.items():
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets)):  # fmt: skip
            raise _not_safetensors(f"{name!r} has no valid data_offsets")
        spans.append((offsets[0], offsets[1], name, _tensor_bytes(name, entry)))
    end = 0
    for begin, stop, name, size in sorted(spans):
        if begin != end or stop - begin != size:
            raise _not_safetensors(f"{name!r}'s data_offsets do not fit its shape and dtype")
        end = stop


def _not_safetensors(why: str) -> APIError:
    return APIError(400, f"the body is not a safetensors file of weights: {why}",
                    code="invalid_body")  # fmt: skip


async def _next_piece() -> bytes | None:
    with trio.move_on_after(PIECE_TIMEOUT):
        try:
            return await request.body.__anext__()
        except StopAsyncIteration:
            return None
    raise APIError(408, f"no part of the body came for {PIECE_TIMEOUT:g} s", code="timeout")
