"""KV that open sessions keep: each finished turn's cached blocks, so that the next turn (or a
branch from an earlier one) finds its whole history in the prefix cache.

A turn's pin is one extra reference on the leading blocks of its sequence that are in the
prefix cache, taken as the sequence finishes: they cannot be evicted, and they count as used KV.
Turns of one session share most blocks (each history extends the last), so pinning every turn
costs little more than pinning the latest. Pins go when the frontend says (a turn it did not
keep, a branch replaced, the session closed or idle past its timeout), when the prefix cache is
flushed (their KV is stale), and, least recently used session first, when live requests need
the blocks: a session's next turn then recomputes what it lost, and no request ever waits on a
pin. Sessions are keyed by the frontend's key for one opening, so a session closed and opened
again under the same id never shares pins with its old self.
"""

from __future__ import annotations

from runtime.scheduler.block_manager import BlockManager
from runtime.scheduler.sequence import Sequence


class SessionPins:
    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.open: set[str] = set()
        # session -> rid -> pinned blocks; sessions in least recently used order, and each
        # session's turns oldest first
        self._pins: dict[str, dict[str, list[int]]] = {}

    @property
    def num_pinned_turns(self) -> int:
        return sum(len(turns) for turns in self._pins.values())

    def pinned_blocks(self) -> list[int]:
        """Every pinned block, once per pin that holds it."""
        return [b for turns in self._pins.values() for blocks in turns.values() for b in blocks]

    def pin(self, session: str, seq: Sequence) -> None:
        """Keep the cached blocks of a session's finished turn (nothing if it was closed)."""
        if session not in self.open:
            return
        self.release(session, (seq.rid,))  # a rid used twice keeps its latest turn
        blocks = self.block_manager.cached_prefix(seq)
        if blocks:
            self.block_manager.hold(blocks)
            self._pins.setdefault(session, {})[seq.rid] = blocks
            self.touch(session)

    def touch(self, session: str) -> None:
        """The session is in use: its pins are the last to go under pressure."""
        turns = self._pins.pop(session, None)
        if turns is not None:
            self._pins[session] = turns

    def release(self, session: str, rids: tuple[str, ...]) -> None:
        turns = self._pins.get(session, {})
        for rid in rids:
            blocks = turns.pop(rid, None)
            if blocks is not None:
                self.block_manager.release(blocks)
        if not turns:
            self._pins.pop(session, None)

    def close(self, session: str) -> None:
        self.open.discard(session)
        self.release(session, tuple(self._pins.get(session, {})))

    def release_oldest(self) -> bool:
        """Give up the least recently used session's oldest pin; False if there is none."""
        if not self._pins:
            return False
        session = next(iter(self._pins))
        self.release(session, (next(iter(self._pins[session])),))
        return True

    def release_all(self) -> None:
        while self.release_oldest():
            pass
