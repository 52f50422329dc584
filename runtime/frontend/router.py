"""Which data-parallel group takes a new request: the least loaded, unless another group
already holds a cached prefix of its prompt that is worth more than the difference in load.

The rule, for a prompt and the groups' loads `L(g)` (tokens of their open requests: prompts
plus tokens generated so far):

    M(g)     = tokens of the prompt's leading full blocks last sent to group g
    score(g) = L(g) - M(g)
    choose     the smallest score; ties: the smaller load, then the smaller rank

So a group holding a cached prefix of M tokens wins over the least-loaded group exactly when
its load is less than M tokens above that group's: a prefix pulls requests only as far as the
work it saves. A shared system prompt therefore cannot pile every request onto one group;
once the others are M tokens lighter, requests spill over, those groups learn the prefix too,
and from then on plain balancing decides.

The map of prefixes is a hint, not the scheduler's cache: an evicted block costs a prefill,
never correctness. It is bounded (least recently routed prefixes go first) and forgotten when
any group drops its cache (a flush, a weight update, released memory).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class Router:
    def __init__(
        self, num_groups: int, block_size: int, max_entries: int = 65_536, max_blocks: int = 256
    ) -> None:
        self.num_groups = num_groups
        self.block_size = block_size
        self.max_entries = max_entries
        self.max_blocks = max_blocks  # a longer prompt is told apart by its first blocks
        self._groups_of: OrderedDict[int, int] = OrderedDict()  # block digest -> group bits

    def route(self, token_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The group for a prompt (see the module's rule); it is remembered as holding the
        prompt's full blocks from now on."""
        digests = self._digests(token_ids)
        matched = self._matched_tokens(digests)
        group = min(range(self.num_groups), key=lambda g: (loads[g] - matched[g], loads[g], g))
        for digest in digests:
            self._groups_of[digest] = self._groups_of.get(digest, 0) | 1 << group
            self._groups_of.move_to_end(digest)
        while len(self._groups_of) > self.max_entries:
            self._groups_of.popitem(last=False)
        return group

    def least_loaded(self, loads: Sequence[int]) -> int:
        return min(range(self.num_groups), key=lambda g: (loads[g], g))

    def forget(self) -> None:
        self._groups_of.clear()

    def _digests(self, token_ids: Sequence[int]) -> list[int]:
        """One digest per full block, each over the whole prefix up to its block's end."""
        size = self.block_size
        num_blocks = min(len(token_ids) // size, self.max_blocks)
        digests, digest = [], 0
        for start in range(0, num_blocks * size, size):
            digest = hash((digest, tuple(token_ids[start : start + size])))
            digests.append(digest)
        return digests

    def _matched_tokens(self, digests: list[int]) -> list[int]:
        """Per group, the tokens of the leading blocks it was sent."""
        matched = [0] * self.num_groups
        holding = (1 << self.num_groups) - 1  # groups that hold every block so far
        for digest in digests:
            holding &= self._groups_of.get(digest, 0)
            if not holding:
                break
            for group in range(self.num_groups):
                if holding >> group & 1:
                    matched[group] += self.block_size
        return matched
