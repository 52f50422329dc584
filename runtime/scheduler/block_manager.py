"""Paged KV blocks: a free list, ref counts and a prefix cache keyed by chained block hashes.

A block holds `block_size` consecutive tokens of one or more sequences' KV. A *full* block whose
KV is computed is registered under a digest chained over the whole prefix: BLAKE2b of (the
previous block's digest, its tokens). Python's `hash()` would be faster, but its collisions can
be built on purpose, and a collision serves one user's KV to another prompt (vLLM's
CVE-2025-25183); a hit also compares the stored tokens.

Freed blocks keep their hash and contents until they are handed out again, so a later request
with the same prefix can revive them. The free list is ordered oldest-freed first, and sequences
free their blocks tail first, so the blocks evicted first are the ends of old prefixes.
"""

from __future__ import annotations

import hashlib
from array import array

from runtime.scheduler.sequence import Sequence


def block_digest(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """128-bit digest of a full block and, through `parent`, of every token before it."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class Block:
    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out KV blocks to sequences. Pair every `x()` with its `can_x()` check first."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one token")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion-ordered set
        self.cached: dict[bytes, int] = {}  # block digest -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks `seq` needs before computing `num_new_tokens` more tokens."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def allocate(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Append `num_blocks` fresh blocks to `seq`'s table and return their ids."""
        assert self.can_allocate(num_blocks), "allocate() without can_allocate()"
        new_ids = []
        for _ in range(num_blocks):
            block = self.blocks[next(iter(self.free))]
            self._take(block)
            self._evict(block)
            new_ids.append(block.block_id)
        seq.block_table.extend(new_ids)
        return new_ids

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold a prefix of `seq`'s tokens (verified token by token).

        The last token is never matched: its logits are needed, so it must be computed; nor
        are tokens past `seq.max_cached_tokens`.
        """
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        parent: bytes | None = None
        known = min(len(seq.token_ids) - 1, seq.max_cached_tokens)
        for start in range(0, known - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            block_id = self.cached.get(block_digest(parent, tokens))
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
            parent = self.blocks[block_id].hash
        return matched

    def num_revived(self, block_ids: list[int]) -> int:
        """How many of these cached blocks sit in the free list (taking them uses free blocks)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def take_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give an unallocated `seq` the cached blocks from `match_prefix` as computed tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        assert self.can_allocate(self.num_revived(block_ids)), "take_prefix() over capacity"
        for block_id in block_ids:
            self._take(self.blocks[block_id])
        seq.block_table.extend(block_ids)
        seq.num_computed_tokens = len(block_ids) * self.block_size

    def cache_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Register the blocks of `seq` filled by computing its tokens [start, end)."""
        if not self.enable_prefix_caching or not seq.cacheable:
            return
        first = start // self.block_size
        parent = self.blocks[seq.block_table[first - 1]].hash if first > 0 else None
        for i in range(first, end // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                start = i * self.block_size
                block.token_ids = tuple(seq.token_ids[start : start + self.block_size])
                block.hash = block_digest(parent, block.token_ids)
                held = self.cached.get(block.hash)
                # two sequences computed the same block: the one in use keeps the entry (a
                # session may have pinned it), a free copy gives it up
                if held is None or self.blocks[held].ref_count == 0:
                    self.cached[block.hash] = block.block_id
            parent = block.hash

    def free_blocks(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (tail first) and forget its computed tokens."""
        self.release(seq.block_table)
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """`seq`'s leading blocks that are registered in the prefix cache."""
        blocks = []
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            if block.hash is None or self.cached.get(block.hash) != block_id:
                break
            blocks.append(block_id)
        return blocks

    def hold(self, block_ids: list[int]) -> None:
        """One more reference on blocks some sequence holds (a session keeps them)."""
        for block_id in block_ids:
            self._take(self.blocks[block_id])

    def release(self, block_ids: list[int]) -> None:
        """Drop a reference on each block, tail first; unreferenced ones go to the free list,
        still cached."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free[block_id] = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (stale after a weight update); how many blocks held one.

        Blocks in use keep their hash, which chains their sequence's later blocks, but nobody
        can match them any more; the scheduler stops such sequences registering blocks at all.
        """
        flushed = len(self.cached)
        for block in self.blocks:
            if block.ref_count == 0:
                block.hash = None
                block.token_ids = ()
        self.cached.clear()
        return flushed

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def _evict(self, block: Block) -> None:
        """Forget a block's cached contents because it is about to be overwritten."""
        if block.hash is not None and self.cached.get(block.hash) == block.block_id:
            del self.cached[block.hash]
        block.hash = None
        block.token_ids = ()
