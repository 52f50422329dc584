"""What the frontend sends the scheduler next: new requests, aborts, pings and control calls.

Every method but `take` is synchronous, so a request's `finally` can queue its abort even while
its task is being cancelled. The frontend's sender task `take`s everything pending: the requests
and aborts queued since the last ping or control message go as one `Submit`, so a burst of
requests costs one message, and everything leaves in the order it was queued. That order is a
promise: a request queued after a `Pause` is held by it; one queued before is not.
"""

from __future__ import annotations

import trio

from runtime.wire.messages import AddRequest, Submit


class Outbox:
    def __init__(self) -> None:
        self._adds: dict[str, tuple[int, AddRequest]] = {}  # rid -> (call order, add)
        self._aborts: list[str] = []
        self._sealed: list[object] = []  # ready to go, in order: Submits, pings, controls
        self._ready = trio.Event()

    def add(self, order: int, add: AddRequest) -> None:
        """Queue a request; `order` (the `generate` call's) decides who is served first
        among the requests of one `Submit` (the samples of one call: in the order added)."""
        self._adds[add.rid] = (order, add)
        self._ready.set()

    def abort(self, rid: str) -> None:
        """Withdraw a request: dropped here if it was never sent, else aborted upstream."""
        if self._adds.pop(rid, None) is None:
            self._aborts.append(rid)
            self._ready.set()

    def send_after(self, msg: object) -> None:
        """Queue a ping or a control message: it leaves after everything queued before it,
        and before everything queued after it."""
        self._seal()
        self._sealed.append(msg)
        self._ready.set()

    async def take(self) -> list[object]:
        """Wait until something is queued, then take all of it, in order."""
        await self._ready.wait()
        self._ready = trio.Event()
        self._seal()
        sealed, self._sealed = self._sealed, []
        return sealed

    def _seal(self) -> None:
        """Close the current `Submit`: first come (first `generate` call), first served,
        whatever order tasks ran in."""
        if self._adds or self._aborts:
            adds = tuple([add for _, add in sorted(self._adds.values(), key=_call_order)])
            self._sealed.append(Submit(adds, tuple(self._aborts)))
            self._adds, self._aborts = {}, []


def _call_order(entry: tuple[int, AddRequest]) -> int:
    return entry[0]
