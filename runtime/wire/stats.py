"""The actors' statistics, as they travel in `Pong` and with every step's outputs."""

from __future__ import annotations

from runtime.wire.codec import message


@message(15)
class WorkerStats:
    """The worker's counters since it started."""

    num_steps: int = 0
    """Steps computed."""
    prepare_seconds: float = 0.0
    """Building each step's input tensors from its plan."""
    forward_seconds: float = 0.0
    """The model's forward passes."""
    sample_seconds: float = 0.0
    """Sampling, and reading the sampled tokens back."""
    idle_seconds: float = 0.0
    """Waiting for a plan that was queued behind the previous step (so could have been there);
    what messaging and the scheduler cost the worker."""
    communicate_seconds: float = 0.0
    """Tensor parallelism: in collectives with the other ranks (rank 0's view; inside the
    forward's and preparation's time, not in addition to it)."""


@message(21)
class SchedulerStats:
    """Gauges (now) and counters (since start) of the scheduler."""

    num_running: int
    """Sequences in the running batch."""
    num_waiting: int
    """Sequences queued: new, preempted and waiting to be recomputed, or samples of n > 1
    waiting for their first sibling's prompt."""
    num_free_blocks: int
    """KV blocks held by no sequence (they may still hold a cached prefix)."""
    num_total_blocks: int
    """KV blocks in the pool."""
    num_steps: int
    """Steps scheduled."""
    num_preemptions: int
    """Sequences preempted to free KV blocks."""
    num_aborts: int
    """Abort messages received, including ones for already finished requests."""
    num_generated_tokens: int
    """Tokens handed back to requests."""
    num_cached_tokens: int
    """Prompt tokens the prefix cache saved from recomputation."""
    schedule_seconds: float
    """Deciding what each step computes."""
    update_seconds: float
    """Applying each step's sampled tokens: stops, freeing, prefix-cache registration."""
    wait_seconds: float
    """Waiting for the worker's results."""
    num_held: int = 0
    """Sequences that arrived during a pause, waiting for the resume."""
    num_waiting_uncached_tokens: int = 0
    """Tokens the waiting and held sequences still have to compute (before prefix-cache
    matches, which are found at admission)."""
    max_num_seqs: int = 0
    """The running batch's limit now (`set_internal_state` may change it)."""
    num_embeddings: int = 0
    """Embedding requests that handed back their vector (not in `num_generated_tokens`)."""
    num_embedding_tokens: int = 0
    """Prompt tokens of those embedding requests (cached ones included)."""

    @classmethod
    def idle(cls, num_blocks: int) -> SchedulerStats:
        """The figures of a scheduler that has done nothing yet."""
        return cls(
            num_running=0,
            num_waiting=0,
            num_free_blocks=num_blocks,
            num_total_blocks=num_blocks,
            num_steps=0,
            num_preemptions=0,
            num_aborts=0,
            num_generated_tokens=0,
            num_cached_tokens=0,
            schedule_seconds=0.0,
            update_seconds=0.0,
            wait_seconds=0.0,
        )
