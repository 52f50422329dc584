"""Drive the pure scheduler like the actor does, with a fake model, checking invariants each step.

`depth` is how many steps may be in flight (`StepPipeline`, the same rule the scheduler actor
runs): 1 waits for each result before scheduling the next step, 2 keeps one step queued ahead of
the worker. Plans go through the codec and the worker's real `SeqTable`.
"""

from __future__ import annotations

import random
from collections import Counter, deque

from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.scheduler.actor import plan_message
from runtime.scheduler.block_manager import BlockManager
from runtime.scheduler.pipeline import StepPipeline
from runtime.scheduler.scheduler import SampledToken, ScheduledStep, Scheduler
from runtime.scheduler.sequence import Sequence, SequenceStatus
from runtime.wire.codec import decode, encode
from runtime.wire.messages import StepPlan
from runtime.worker.seq_table import SeqTable

EOS = 0


class CoreHarness:
    def __init__(
        self,
        *,
        num_blocks: int = 32,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        max_model_len: int = 64,
        seed: int = 0,
        prefix_caching: bool = True,
        depth: int = 1,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(
            self.bm,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            eos_token_ids=frozenset({EOS}),
            vocab_size=64,
        )
        self.depth = depth
        self.pipeline = StepPipeline(self.sched, depth)
        self.worker = SeqTable()
        self.rng = random.Random(seed)
        self.next_seq_id = 0
        self.outputs: dict[str, list[SampledToken]] = {}
        self.finished: dict[str, str] = {}
        self.plans: deque[StepPlan] = deque()  # sent to the worker, not yet computed

    def add(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int,
        ignore_eos: bool = True,
        session: str = "",
        fork_of: str = "",
        pooling: PoolingParams | None = None,
    ) -> None:
        """A request; with `pooling` an embedding (`max_tokens` 1, as the frontend sends)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        seq = Sequence(
            self.next_seq_id,
            rid,
            prompt,
            params,
            max_tokens=max_tokens,
            session=session,
            pooling=pooling,
        )
        self.sched.add(seq, fork_of)
        self.next_seq_id += 1
        self.outputs[rid] = []
        self.finished.pop(rid, None)  # an id may be reused once its request has ended

    def abort(self, rid: str) -> None:
        if self.sched.abort(rid):
            self.finished[rid] = "abort"

    def step(self, abort_in_flight: tuple[str, ...] = ()) -> ScheduledStep | None:
        """One turn of the actor's loop: maybe schedule a step, maybe retire the oldest."""
        scheduled = self.pipeline.schedule_next()
        assert scheduled is None or self.sched.pause_mode != "keep", "computed while paused"
        if scheduled is not None:
            plan = decode(encode(plan_message(scheduled)))  # what the worker gets
            assert isinstance(plan, StepPlan)
            self.plans.append(plan)
        if self.pipeline.must_retire(scheduled):
            self._retire(abort_in_flight)
        else:  # nothing computes this turn: they arrive before the next one
            for rid in abort_in_flight:
                self.abort(rid)
        self.check_invariants()
        return scheduled

    def _retire(self, abort_in_flight: tuple[str, ...]) -> None:
        """The worker runs the oldest step in flight; then its result reaches the scheduler."""
        scheduled, plan = self.pipeline.in_flight[0], self.plans.popleft()
        worker_seqs = self.worker.apply(plan)
        sampled, pooled = {}, {}
        for i, (seq_id, ws, n) in enumerate(
            zip(plan.seq_ids, worker_seqs, plan.num_tokens, strict=True)
        ):
            assert ws.num_computed_tokens == scheduled.starts[i]
            assert len(ws.block_table) * self.bm.block_size >= ws.num_computed_tokens + n
            assert SeqTable.samples(ws, n) == scheduled.samples[i]
            token = None
            if scheduled.samples[i] and ws.pooling is not None:  # an embedding's vector
                pooled[seq_id] = bytes(ws.token_ids[:4])
            elif scheduled.samples[i]:
                token = self.rng.randrange(0, 8)  # small vocab: EOS (0) comes up often
                sampled[seq_id] = (token, -1.0, None, None)
            SeqTable.commit(ws, n, token)
        for rid in abort_in_flight:  # arrive while the worker computes
            self.abort(rid)
        for out in self.pipeline.retire(plan.step, sampled, pooled):
            self.outputs[out.rid].append(out)
            if out.finish_reason is not None:
                assert out.rid not in self.finished, f"{out.rid} finished twice"
                self.finished[out.rid] = out.finish_reason
        for seq, ws in zip(scheduled.seqs, worker_seqs, strict=True):
            if seq.status is not SequenceStatus.FINISHED:  # same tokens on both sides
                assert seq.token_ids == ws.token_ids

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if self.pipeline.idle:
                return
            self.step()
        raise AssertionError("scheduler made no progress")

    def check_invariants(self) -> None:
        bm, sched = self.bm, self.sched
        live = list(sched.running) + list(sched.waiting) + list(sched.held)
        forking = [fork for seq in live for fork in seq.forks]
        for fork in forking:
            assert fork.status is SequenceStatus.FORKING and not fork.block_table
            assert fork.fork_parent is not None and fork in fork.fork_parent.forks
        pinned = sched.pins.pinned_blocks()
        refs = Counter(b for seq in live for b in seq.block_table) + Counter(pinned)
        for block in bm.blocks:
            assert block.ref_count == refs[block.block_id], (block.block_id, block.ref_count)
            assert (block.ref_count == 0) == (block.block_id in bm.free)
        for h, block_id in bm.cached.items():
            assert bm.blocks[block_id].hash == h
        for seq in [*sched.waiting, *sched.held]:  # a fork may hold its sibling's prompt
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.HELD)
            assert seq.num_computed_tokens == len(seq.block_table) * bm.block_size
            assert seq.num_computed_tokens < seq.num_tokens
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) == -(-seq.num_computed_tokens // bm.block_size)
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert 0 <= seq.num_pending_tokens <= self.depth
        for seq in sched.held:
            assert not seq.block_table and sched.pause_mode is not None
        assert len(sched.running) <= sched.max_num_seqs
        queued = [*sched.waiting, *sched.held, *forking]
        assert sched.num_forking == len(forking)
        assert sched.queued_tokens == sum(s.num_tokens - s.num_computed_tokens for s in queued)
        assert set(sched.by_rid) == {s.rid for s in live + forking}
        if self.pipeline.idle and sched.pause_mode != "keep":
            assert bm.num_free_blocks == bm.num_blocks - len(set(pinned))
