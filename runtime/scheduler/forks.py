"""The samples of a request with n > 1 share its prompt's KV: sample 0 computes the prompt,
and the others (`FORKING` meanwhile) then hold its full blocks by reference count. A waiting
fork lets go of them whenever they are in anyone's way. Part of `Scheduler`."""

from __future__ import annotations

from collections import Counter, deque

from runtime.scheduler.block_manager import BlockManager
from runtime.scheduler.sequence import Sequence, SequenceStatus


class Forks:
    block_manager: BlockManager
    waiting: deque[Sequence]
    running: list[Sequence]
    held: list[Sequence]
    queued_tokens: int
    num_forking: int
    pause_mode: str | None

    def _queue(self, seq: Sequence, *, first: bool = False) -> None:
        """Into the waiting queue (or held, while paused: holding no KV, which a paused
        engine may release)."""
        if self.pause_mode is not None:
            self.block_manager.free_blocks(seq)
            seq.status = SequenceStatus.HELD
            self.held.append(seq)
        else:
            seq.status = SequenceStatus.WAITING
            if first:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
        self.queued_tokens += seq.num_uncomputed_tokens

    @staticmethod
    def _prompt_pending(parent: Sequence, seq: Sequence) -> bool:
        """Whether `seq` can wait to share `parent`'s prompt: the same, not computed yet."""
        return (
            parent.status is not SequenceStatus.FORKING
            and parent.num_tokens == parent.num_prompt_tokens
            and parent.token_ids == seq.token_ids
        )

    def _release_forks(self, parent: Sequence, *, share: bool) -> None:
        """Queue `parent`'s waiting siblings first in line. With `share` (its prompt is
        computed and its blocks held), each holds the prompt's full blocks, all but the one
        with the last token, whose logits each sibling needs; else they stand alone (and may
        hit the prefix cache)."""
        forks, parent.forks = parent.forks, []
        bs = self.block_manager.block_size
        shared = parent.block_table[: (parent.num_prompt_tokens - 1) // bs] if share else []
        for seq in reversed(forks):
            seq.fork_parent = None
            self.num_forking -= 1
            self.queued_tokens -= seq.num_uncomputed_tokens
            self.block_manager.hold(shared)
            seq.block_table = list(shared)
            seq.num_computed_tokens = len(shared) * bs
            self._queue(seq, first=True)

    def _unshare_waiting(self, *, head: bool = False) -> bool:
        """Free the blocks that only waiting forks hold (their siblings' prompt): those forks
        let go of what they share and will compute it, or find it in the prefix cache. False
        if that frees nothing. The head of the queue lets go only with nothing running, or
        when told to (`head`: the alternative is preempting the last running sequence)."""
        forks = [
            seq
            for seq in self.waiting
            if seq.block_table and (seq is not self.waiting[0] or head or not self.running)
        ]
        holders = Counter(block for seq in forks for block in seq.block_table)
        blocks = self.block_manager.blocks
        freed = {b for b, count in holders.items() if blocks[b].ref_count == count}
        if not freed:
            return False
        for seq in forks:
            if not freed.isdisjoint(seq.block_table):
                self._unshare(seq)
        return True

    def _unshare(self, seq: Sequence) -> None:
        """A waiting fork lets go of its sibling's blocks."""
        self.queued_tokens += seq.num_computed_tokens
        self.block_manager.free_blocks(seq)
