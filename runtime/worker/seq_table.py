"""The worker's mirror of the scheduler's sequences, kept up to date from `StepPlan` deltas.

The scheduler sends a sequence's tokens once (`NewSeq`) and then only what changed: new blocks,
how many tokens to compute, which sequences are gone. The worker appends the tokens it samples
itself, so decode steps carry no token ids at all. Pure Python, so tests can check the protocol
without a model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from runtime.config.pooling import PoolingParams
from runtime.config.sampling import SamplingParams
from runtime.wire.messages import StepPlan


@dataclass(slots=True)
class WorkerSeq:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    params: SamplingParams
    seed: int  # the request's, or drawn once here: sampling hashes it with the position
    pooling: PoolingParams | None = None  # an embedding: its prompt is pooled, not sampled

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class SeqTable:
    def __init__(self) -> None:
        self.seqs: dict[int, WorkerSeq] = {}

    def apply(self, plan: StepPlan) -> list[WorkerSeq]:
        """Bring the table up to date with `plan`; return the scheduled sequences in order."""
        for seq_id in plan.released:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            assert new.seq_id not in self.seqs, f"sequence {new.seq_id} sent twice"
            seed = new.params.seed if new.params.seed is not None else random.getrandbits(64)
            self.seqs[new.seq_id] = WorkerSeq(
                list(new.token_ids),
                new.num_prompt_tokens,
                new.num_computed_tokens,
                [],
                new.params,
                seed,
                new.pooling,
            )
        for seq_id, block_id in zip(plan.block_seq_ids, plan.block_ids, strict=True):
            self.seqs[seq_id].block_table.append(block_id)
        return [self.seqs[seq_id] for seq_id in plan.seq_ids]

    @staticmethod
    def samples(seq: WorkerSeq, num_tokens: int) -> bool:
        """Whether computing `num_tokens` more tokens reaches the end, so a token is sampled
        (or, for an embedding, its vector is pooled: the scheduler counts that as its sample)."""
        return seq.num_computed_tokens + num_tokens == len(seq.token_ids)

    @staticmethod
    def commit(seq: WorkerSeq, num_tokens: int, sampled: int | None) -> None:
        seq.num_computed_tokens += num_tokens
        if sampled is not None:
            seq.token_ids.append(sampled)
