"""What the frontend sends the scheduler next: new requests, aborts and pings.

Every method but `take` is synchronous, so a request's `finally` can queue its abort even while
its task is being cancelled. The frontend's sender task `take`s everything pending and sends it
as one `Submit` (and the pings after it), so a burst of requests costs one message.
"""

from __future__ import annotations

import trio

from runtime.wire.messages import AddRequest, Ping, Probe, Submit


class Outbox:
    def __init__(self) -> None:
        self._adds: dict[str, tuple[int, AddRequest]] = {}  # rid -> (call order, add)
        self._aborts: list[str] = []
        self._pings: list[Ping | Probe] = []
        self._ready = trio.Event()

    def add(self, order: int, add: AddRequest) -> None:
        """Queue a request; `order` (the `generate` call's) decides who is served first."""
        self._adds[add.rid] = (order, add)
        self._ready.set()

    def abort(self, rid: str) -> None:
        """Withdraw a request: dropped here if it was never sent, else aborted upstream."""
        if self._adds.pop(rid, None) is None:
            self._aborts.append(rid)
            self._ready.set()

    def ping(self, nonce: int, *, through_worker: bool = True) -> None:
        """Queue a ping (or a probe the scheduler answers alone): it leaves after everything
        queued before it."""
        self._pings.append(Ping(nonce) if through_worker else Probe(nonce))
        self._ready.set()

    async def take(self) -> tuple[Submit | None, list[Ping | Probe]]:
        """Wait until something is queued, then take all of it."""
        await self._ready.wait()
        self._ready = trio.Event()
        # first come (first `generate` call), first served, whatever order tasks ran in
        adds = tuple(add for _, add in sorted(self._adds.values()))
        aborts = tuple(self._aborts)
        pings = self._pings
        self._adds, self._aborts, self._pings = {}, [], []
        return (Submit(adds, aborts) if adds or aborts else None), pings
