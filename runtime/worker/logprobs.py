"""Log-probabilities a request asked for: the top tokens at each generated position, and the
prompt's own tokens (computed only for requests that ask, chunk by chunk).

Prompt log-probabilities are held here until the sequence samples its first token and then
travel with it, so a sequence preempted before that simply computes them again, and one
preempted after never needs them twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.wire.messages import Logprobs
from runtime.worker.seq_table import WorkerSeq


def top_logprobs(
    logprobs: torch.Tensor, counts: Sequence[int | None], positions: Sequence[int]
) -> tuple[Logprobs | None, ...]:
    """Row i's `counts[i]` most likely tokens (None: not asked), from [rows, vocab]."""
    k = max(c or 0 for c in counts)
    values, ids = (x.tolist() for x in logprobs.topk(k, dim=-1)) if k else ([], [])
    return tuple(
        [
            None
            if c is None
            else Logprobs(
                p, (), c, tuple(ids[i][:c]) if k else (), tuple(values[i][:c]) if k else ()
            )
            for i, (c, p) in enumerate(zip(counts, positions, strict=True))
        ]
    )


@dataclass(slots=True)
class _PromptBuffer:
    first_position: int  # the first prompt position with a value (position 0 has none)
    num_top: int
    token_logprobs: list[float] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def message(self) -> Logprobs:
        return Logprobs(
            self.first_position,
            tuple(self.token_logprobs),
            self.num_top,
            tuple(self.top_ids),
            tuple(self.top_logprobs),
        )


class PromptLogprobs:
    """Per-sequence buffers of prompt log-probabilities, filled as prompt chunks compute."""

    def __init__(self) -> None:
        self._buffers: dict[int, _PromptBuffer] = {}

    @property
    def waiting(self) -> bool:
        """Some sequence has prompt log-probabilities to compute or to hand over."""
        return bool(self._buffers)

    def arrive(self, seq_id: int, seq: WorkerSeq) -> None:
        params = seq.params
        if params.prompt_logprobs is not None and seq.num_output_tokens == 0:
            first = max(params.prompt_logprobs_start, 1)
            self._buffers[seq_id] = _PromptBuffer(first, params.prompt_logprobs)

    def leave(self, seq_id: int) -> None:
        self._buffers.pop(seq_id, None)

    def positions(self, seq_id: int, seq: WorkerSeq, num_tokens: int) -> range:
        """Positions among the `num_tokens` computed next whose logits score a prompt token
        (the one after each)."""
        buffer = self._buffers.get(seq_id)
        if buffer is None:
            return range(0)
        computed = seq.num_computed_tokens
        return range(
            max(computed, buffer.first_position - 1),
            min(computed + num_tokens, seq.num_prompt_tokens - 1),
        )

    def add(self, logits: torch.Tensor, wanted: Sequence[tuple[int, WorkerSeq, range]]) -> None:
        """Score rows of `logits` [rows, vocab]: `wanted` lists, in row order, each sequence
        with the positions its rows stand for."""
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = [seq.token_ids[p + 1] for _, seq, positions in wanted for p in positions]
        index = torch.tensor(targets, dtype=torch.long, device=logits.device)[:, None]
        token_logprobs = logprobs.gather(-1, index).squeeze(-1).tolist()
        k = max(self._buffers[seq_id].num_top for seq_id, _, _ in wanted)
        values, ids = (x.tolist() for x in logprobs.topk(k, dim=-1)) if k else ([], [])
        row = 0
        for seq_id, _, positions in wanted:
            buffer = self._buffers[seq_id]
            for i in range(row, row + len(positions)):
                buffer.token_logprobs.append(token_logprobs[i])
                if buffer.num_top:
                    buffer.top_ids.extend(ids[i][: buffer.num_top])
                    buffer.top_logprobs.extend(values[i][: buffer.num_top])
            row += len(positions)

    def take(self, seq_id: int) -> Logprobs | None:
        """Everything for a sequence that samples its first token now (None: not asked)."""
        buffer = self._buffers.pop(seq_id, None)
        return buffer.message() if buffer is not None else None
