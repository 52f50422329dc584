"""Continuous batching: which sequences compute how many tokens in the next step.

There is no prefill or decode phase, only a per-sequence count of tokens still to compute (as in
vLLM v1): a fresh prompt has all of its tokens to compute, a decoding sequence has one (the token
sampled last step). Each step first serves running sequences in arrival order, then admits waiting
ones, within a token budget and `max_num_seqs`; a prompt larger than what is left of the budget
is computed in chunks over several steps. When the KV pool runs dry, the newest running sequence
is preempted: its blocks are freed and it waits to be recomputed from its tokens.

`schedule()` commits to its step at once (counters advance, sampled tokens count as pending), and
`update()` later fills in what the step sampled. Steps are executed in order, so the next step may
be scheduled before the previous one's result is back (`StepPipeline` keeps one step queued ahead
of the worker, hiding scheduling and messaging behind the model's forward). A sequence that hits
EOS costs at most one wasted token that way; length limits are known ahead and cost nothing.

An embedding request (`Sequence.pooling`) is a prefill and nothing more: the step that
computes its last prompt token counts as its sample, and its result brings the pooled vector
instead of a token; the request then ends and frees its blocks at once.

A pause holds new requests back (in arrival order) until `resume`: in mode "keep" nothing is
computed meanwhile (running sequences keep their KV, so they continue exactly where they were);
in mode "wait" the requests admitted before the pause run to their end; in mode "retract"
nothing is computed and the running sequences are preempted (recomputed on resume).

Pure Python: no trio, nng, torch or wire messages, so tests drive it step by step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeAlias

from runtime.scheduler.block_manager import BlockManager
from runtime.scheduler.forks import Forks
from runtime.scheduler.sequence import Sequence, SequenceStatus
from runtime.scheduler.session_pins import SessionPins


@dataclass(slots=True)
class ScheduledStep:
    """What one step computes, plus the bookkeeping the worker must hear about."""

    step_id: int
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # computed tokens before this step
    samples: list[bool] = field(default_factory=list)  # the step samples a token for it
    new_seqs: list[Sequence] = field(default_factory=list)  # worker has no state for these yet
    new_blocks: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, block_id)
    released: list[int] = field(default_factory=list)  # seq ids whose worker state must go
    queued: bool = False  # scheduled while an earlier step was still computing


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sampled token handed back to a request (with its finish reason, if it ended)."""

    rid: str
    token_id: int
    logprob: float
    finish_reason: str | None
    num_cached_tokens: int
    top: object = None  # the worker's top log-probabilities for it, passed on as they are
    prompt: object = None  # the prompt's log-probabilities, with a request's first token
    embedding: object = None  # an embedding request's vector (its token id is -1)


# What the worker sampled for one sequence: (token id, logprob, top log-probabilities, prompt
# log-probabilities); the last two are passed on as they are. A tuple: one per sequence per step.
Sample: TypeAlias = tuple[int, float, object, object]


class Scheduler(Forks):
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        vocab_size: int,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # arrived during a pause
        self.num_forking = 0  # samples waiting for their first sibling's prompt (forks.py)
        # tokens the waiting, held and forking sequences have to compute, kept as they come
        # and go (such a sequence's counts do not change while it waits)
        self.queued_tokens = 0
        self.pause_mode: str | None = None  # "keep" or "wait" while paused
        self.by_rid: dict[str, Sequence] = {}
        self.pins = SessionPins(block_manager)  # KV kept for open sessions
        self._released: list[int] = []  # seq ids to report to the worker with the next step
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # tokens the prefix cache saved from recomputation, in total
        self.num_embeddings = 0  # embedding requests that got their vector
        self.num_embedding_tokens = 0  # and their prompts' tokens

    # -- intake --------------------------------------------------------------------------

    def add(self, seq: Sequence, fork_of: str = "") -> None:
        """Queue a new sequence; ValueError (and nothing changes) if it cannot be served.

        `fork_of`: a request with the same prompt (a sibling sample of n > 1); `seq` waits
        until that one's prompt is computed and then shares its KV blocks.
        """
        if seq.rid in self.by_rid:
            raise ValueError(f"request id {seq.rid!r} is already in use")
        if not all(0 <= t < self.vocab_size for t in seq.token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        seq.params.check_vocabulary(self.vocab_size)  # the frontend did; the worker relies on it
        if seq.pooling is not None:  # an embedding: its prompt may fill the context
            if seq.num_prompt_tokens > self.max_model_len:
                raise ValueError(
                    f"the input ({seq.num_prompt_tokens} tokens) exceeds max_model_len "
                    f"({self.max_model_len})"
                )
        elif seq.num_prompt_tokens + seq.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({seq.num_prompt_tokens}) + max_tokens ({seq.max_tokens}) "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        self.by_rid[seq.rid] = seq
        if seq.session:
            self.pins.touch(seq.session)
        parent = self.by_rid.get(fork_of) if fork_of else None
        if parent is not None and self._prompt_pending(parent, seq):
            seq.status = SequenceStatus.FORKING
            seq.fork_parent = parent
            parent.forks.append(seq)
            self.num_forking += 1
            self.queued_tokens += seq.num_uncomputed_tokens
            return
        self._queue(seq)

    def abort(self, rid: str) -> bool:
        """Drop a request wherever it is; returns False if it is unknown or already finished."""
        seq = self.by_rid.get(rid)
        if seq is None:
            return False
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return self.pause_mode != "keep" and bool(self.waiting or self.running)

    # -- pause ---------------------------------------------------------------------------

    def pause(self, mode: str) -> None:
        """Hold new requests back; "keep": compute nothing either, "wait": let the admitted
        ones finish, "retract": compute nothing and give back the running ones' KV (they go
        back to the head of the queue with their output so far, recomputed on resume).
        Pausing again changes the mode."""
        if mode not in ("keep", "wait", "retract"):
            raise ValueError(f"pause mode must be 'keep', 'wait' or 'retract', got {mode!r}")
        if mode == "retract":
            for seq in reversed(self.running):  # the queue's head keeps their order
                self._preempt(seq, self._released)
        self.pause_mode = "keep" if mode == "retract" else mode

    def resume(self) -> None:
        """Go on: held requests queue behind the waiting ones, in their arrival order."""
        self.pause_mode = None
        for seq in self.held:
            seq.status = SequenceStatus.WAITING
        self.waiting.extend(self.held)
        self.held.clear()

    def flush_cache(self, *, allow_open: bool = False) -> int:
        """Drop the prefix cache; how many cached blocks were dropped. ValueError if any
        request runs, waits or is held, unless `allow_open` (a weight update): then running
        sequences keep their KV, computed with other weights, and never share it."""
        if not allow_open and (self.running or self.waiting or self.held):
            raise ValueError(
                f"cannot flush the cache while requests are open: {len(self.running)} running, "
                f"{len(self.waiting)} waiting, {len(self.held)} held by a pause"
            )
        for seq in self.running:
            seq.cacheable = False
        for seq in self.waiting:  # a fork has computed nothing yet: all of it with new weights
            if seq.block_table:
                self._unshare(seq)
        self.pins.release_all()  # their KV is stale too
        return self.block_manager.reset_prefix_cache()

    @property
    def drained(self) -> bool:
        """Nothing admitted before the pause is left (held requests do not count)."""
        return not self.waiting and not self.running

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """The next step, or None if nothing can be computed now (its releases wait)."""
        step = ScheduledStep(self.num_steps, released=self._released)
        self._released = []
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if self._reaches_limit(seq):
                continue  # its last token is pending: it finishes when that arrives
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_tokens, step):
                break  # `seq` itself was preempted, and everything behind it before that
            self._allocate(seq, num_tokens, step)
            budget -= num_tokens
        if self.num_preemptions == preemptions_before:  # admitting now would only thrash
            self._admit(budget, step)
        if not step.seqs:  # nothing to send: keep the releases for the next step
            self._released = step.released + self._released
            return None
        self.num_steps += 1
        return step

    def _reaches_limit(self, seq: Sequence) -> bool:
        if seq.pooling is not None:  # an embedding is done once its whole prompt is scheduled
            return seq.num_computed_tokens >= seq.num_prompt_tokens
        return seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len

    def _make_room(self, seq: Sequence, num_tokens: int, step: ScheduledStep) -> bool:
        """Preempt from the tail of `running` until `seq` fits; False if `seq` was preempted."""
        needed = self.block_manager.blocks_needed(seq, num_tokens)
        while not self.block_manager.can_allocate(needed):
            # idle sessions' KV, and what waiting forks share, go before running requests'
            if self.pins.release_oldest() or self._unshare_waiting():
                continue
            victim = self.running[-1]
            if victim is seq and self._unshare_waiting(head=True):
                continue  # the last one left running goes before a waiting fork's share
            self._preempt(victim, step.released)
            if victim is seq:
                return False
        return True

    def _admit(self, budget: int, step: ScheduledStep) -> None:
        bs = self.block_manager.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while a step samples for it: wait for that token
            shared = len(seq.block_table)  # a fork holds its sibling's prompt blocks already
            cached = [] if shared else self.block_manager.match_prefix(seq)
            held = shared or len(cached)
            num_tokens = min(seq.num_tokens - held * bs, budget)
            fresh = -(-(held * bs + num_tokens) // bs) - held
            if not self.block_manager.can_allocate(fresh + self.block_manager.num_revived(cached)):
                # no request waits on an idle session's KV, nor on a waiting fork's
                if self.pins.release_oldest() or self._unshare_waiting():
                    continue
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.queued_tokens -= seq.num_uncomputed_tokens
            if not shared:
                self.block_manager.take_prefix(seq, cached)
            self.num_cached_tokens += seq.num_computed_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.new_seqs.append(seq)
            step.new_blocks.extend((seq.seq_id, block_id) for block_id in seq.block_table)
            self._allocate(seq, num_tokens, step)
            budget -= num_tokens

    def _allocate(self, seq: Sequence, num_tokens: int, step: ScheduledStep) -> None:
        """Commit `seq` to computing `num_tokens` more tokens in `step`."""
        needed = self.block_manager.blocks_needed(seq, num_tokens)
        for block_id in self.block_manager.allocate(seq, needed):
            step.new_blocks.append((seq.seq_id, block_id))
        step.seqs.append(seq)
        step.num_tokens.append(num_tokens)
        step.starts.append(seq.num_computed_tokens)
        seq.num_computed_tokens += num_tokens
        samples = seq.num_computed_tokens == seq.num_tokens
        step.samples.append(samples)
        seq.num_pending_tokens += samples

    def _preempt(self, seq: Sequence, released: list[int]) -> None:
        """Recompute later: free the KV, keep the tokens, go back to the head of the queue
        (`released`: where the worker hears that its state for `seq` must go)."""
        self.running.remove(seq)
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.queued_tokens += seq.num_tokens
        released.append(seq.seq_id)
        self.num_preemptions += 1

    # -- results -------------------------------------------------------------------------

    def update(
        self,
        step: ScheduledStep,
        sampled: dict[int, Sample],
        pooled: Mapping[int, object] = MappingProxyType({}),
    ) -> list[SampledToken]:
        """Apply a step's results (steps in order); `sampled`: tokens by seq_id, `pooled`:
        the vectors of embedding sequences whose prompt the step finished, by seq_id."""
        outputs = []
        for seq, num_tokens, start, samples in zip(
            step.seqs, step.num_tokens, step.starts, step.samples, strict=True
        ):
            if samples:
                seq.num_pending_tokens -= 1
            if seq.status is SequenceStatus.FINISHED:
                continue  # aborted, or stopped by an earlier step, while this one ran
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq, start, start + num_tokens)
            if not samples:
                continue  # a prefill chunk: nothing sampled yet
            if seq.pooling is not None:
                outputs.append(self._embedded(seq, pooled[seq.seq_id]))
                continue
            token_id, logprob, top, prompt = sampled[seq.seq_id]
            seq.token_ids.append(token_id)  # also when preempted meanwhile: the token is valid
            if seq.forks:  # the prompt is computed: its siblings may share it now
                self._release_forks(seq, share=seq.status is SequenceStatus.RUNNING)
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(
                SampledToken(seq.rid, token_id, logprob, reason, seq.num_cached_tokens, top, prompt)
            )
        return outputs

    def _embedded(self, seq: Sequence, vector: object) -> SampledToken:
        """An embedding request's vector came (also when preempted meanwhile: its step ran
        whole): it ends here, and its blocks are free at once."""
        if seq.status is SequenceStatus.WAITING:  # queued with that vector counted as a
            self.queued_tokens -= 1  # pending token, which now never comes
        self._finish(seq, "stop")
        self.num_embeddings += 1
        self.num_embedding_tokens += seq.num_prompt_tokens
        return SampledToken(seq.rid, -1, 0.0, "stop", seq.num_cached_tokens, embedding=vector)

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in seq.stop_token_ids:
            return "stop"
        known = len(seq.token_ids)
        if known - seq.num_prompt_tokens >= seq.max_tokens or known >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._released.append(seq.seq_id)  # a waiting one has no state in the worker
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.queued_tokens -= seq.num_uncomputed_tokens
        elif seq.status is SequenceStatus.HELD:
            self.held.remove(seq)
            self.queued_tokens -= seq.num_uncomputed_tokens
        elif seq.status is SequenceStatus.FORKING:
            assert seq.fork_parent is not None
            seq.fork_parent.forks.remove(seq)
            seq.fork_parent = None
            self.num_forking -= 1
            self.queued_tokens -= seq.num_uncomputed_tokens
        if seq.forks:  # it ends before its prompt was computed: its siblings go on alone
            self._release_forks(seq, share=False)
        if seq.session:
            self.pins.pin(seq.session, seq)
        self.block_manager.free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.by_rid[seq.rid]
