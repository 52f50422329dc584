"""KV that open sessions keep: each finished turn's cached blocks, so that the next turn (or a
branch from an earlier one) finds its whole history in the prefix cache.

A turn's pin is one extra reference on the leading blocks of its sequence that are in the
prefix cache, taken as the sequence finishes: they cannot be evicted, and they count as used KV.
Turns of one session share most blocks (each history extends the last), so pinning every turn
costs little more than pinning the latest. Pins go when the frontend says (a turn it did not
keep, a branch replaced, the session closed or idle past its timeout), when the prefix cache is
flushed (their KV is stale), and, least recently used first, when live requests need the
blocks: a session's next turn then recomputes what it lost, and no request ever waits on a pin.
"""

from __future__ import annotations

from runtime.scheduler.block_manager import BlockManager
from runtime.scheduler.sequence import Sequence


class SessionPins:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.open: set[str] = set()
        self._pins: dict[tuple[str, str], list[int]] = {}  # (session, rid) -> blocks; LRU order

    @property
    def num_pinned_turns(self) -> int:
        return len(self._pins)

    def pinned_blocks(self) -> list[int]:
        """Every pinned block, once per pin that holds it."""
        return [block for blocks in self._pins.values() for block in blocks]

    def pin(self, session: str, seq: Sequence) -> None:
        """Keep the cached blocks of a session's finished turn (nothing if it was closed)."""
        if session not in self.open:
            return
        blocks = self.block_manager.cached_prefix(seq)
        if blocks:
            self.block_manager.hold(blocks)
            self._pins[session, seq.rid] = blocks

    def touch(self, session: str) -> None:
        """The session is in use: its pins are the last to go under pressure."""
        for key in [key for key in self._pins if key[0] == session]:
            self._pins[key] = self._pins.pop(key)

    def release(self, session: str, rids: tuple[str, ...]) -> None:
        for rid in rids:
            blocks = self._pins.pop((session, rid), None)
            if blocks is not None:
                self.block_manager.release(blocks)

    def close(self, session: str) -> None:
        self.open.discard(session)
        self.release(session, tuple([rid for s, rid in self._pins if s == session]))

    def release_oldest(self) -> bool:
        """Give up the least recently used pin; False if there is none."""
        if not self._pins:
            return False
        key = next(iter(self._pins))
        self.block_manager.release(self._pins.pop(key))
        return True

    def release_all(self) -> None:
        while self.release_oldest():
            pass
