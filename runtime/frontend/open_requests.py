"""The requests the engine is serving: their streams by the engine's own ids, and the callers'
labels (`rid`) for them.

A label is unique among open requests and free again once its request has ended, even while
the scheduler is still finishing with the old one. Every way a request ends goes through
`end_upstream`, which tells the scheduler exactly once (or not at all, if the scheduler is done
with it already).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from runtime.frontend.outbox import Outbox
from runtime.frontend.request_stream import RequestStream
from runtime.protocol import EngineDeadError
from runtime.wire.messages import AddRequest


class OpenRequests:
    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox
        self.streams: dict[str, RequestStream] = {}  # by the engine's own request id
        self._labels: dict[str, list[str]] = {}  # the caller's rid -> the engine's ids (one
        # per sample), while open
        self._none = trio.Event()
        self._none.set()

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def num_generating(self) -> int:
        """Open requests the actors still work on (the others wait for their reader)."""
        return sum(not stream.upstream_done for stream in self.streams.values())

    def check_label_free(self, label: str) -> None:
        if label in self._labels:
            raise ValueError(
                f"request id {label!r} is already in use by a request that has not ended"
            )

    def open(
        self, label: str, order: int, adds: Sequence[AddRequest], streams: list[RequestStream]
    ) -> None:
        """Register a call's requests (one per sample) and queue them for the scheduler."""
        for add, stream in zip(adds, streams, strict=True):
            self.streams[add.rid] = stream
            self._outbox.add(order, add)
        self._labels[label] = [add.rid for add in adds]
        if self._none.is_set():  # a task waiting on the unset one must still be woken
            self._none = trio.Event()

    def close(self, label: str, adds: Sequence[AddRequest]) -> None:
        """A call's requests have ended, however they ended."""
        for add in adds:
            self.end_upstream(add.rid, self.streams.pop(add.rid))
        del self._labels[label]
        if not self.streams:
            self._none.set()

    def end_upstream(self, request_id: str, stream: RequestStream) -> None:
        """Tell the scheduler to drop the request, unless it is done with it: exactly once."""
        if not stream.upstream_done:
            stream.upstream_done = True
            self._outbox.abort(request_id)

    def abort(self, label: str) -> bool:
        """End a call's requests now, with the output they have; False if none is open."""
        request_ids = self._labels.get(label, ())
        for request_id in request_ids:
            self._abort(request_id)
        return bool(request_ids)

    def abort_all(self) -> int:
        """End every open call's requests; how many calls there were."""
        count = len(self._labels)
        for request_id in list(self.streams):
            self._abort(request_id)
        return count

    def _abort(self, request_id: str) -> None:
        stream = self.streams[request_id]
        stream.end("abort")
        self.end_upstream(request_id, stream)

    def refused(self, request_id: str, reason: str) -> None:
        """The scheduler would not take a request: it fails alone."""
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.upstream_done = True  # the scheduler holds nothing of it
            stream.fail(ValueError(f"the request was refused: {reason}"))

    def fail(self, error: BaseException) -> None:
        """The engine is dead: every open request ends with `error`."""
        for stream in self.streams.values():
            stream.fail(EngineDeadError(str(error)))

    async def wait_none(self) -> None:
        await self._none.wait()
