"""Embedding sequences' vectors, pooled from the final norm's output as their prompt computes.

A long prompt computes in chunks over several steps, and a step keeps no hidden states, so
each chunk leaves what the vector needs of it: "mean" adds its rows to a running sum, "cls"
keeps its first row (in the first chunk), "last" needs only the last chunk's last row. The
step that computes the last prompt token finishes the vector: averaged over the prompt's
own tokens, cut to the asked dimensions, normalized, as little-endian float32 bytes.

Mean and cls pooling take nothing from the prefix cache (`PoolingParams.reads_every_token`),
so every prompt row passes through here; a sequence preempted midway is released (its
partial vector dropped) and computes again from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.config.pooling import PoolingParams
from runtime.worker.seq_table import WorkerSeq


@dataclass(frozen=True, slots=True)
class PoolSlice:
    """One embedding sequence's part of a step: its rows among the step's pooled rows."""

    seq_id: int
    seq: WorkerSeq
    first: int  # its first row among the pooled rows
    count: int
    finishes: bool  # the step computes its last prompt token: the vector is done


def pool_slice(
    seq_id: int, seq: WorkerSeq, num_tokens: int, start: int, pool_rows: list[int]
) -> PoolSlice | None:
    """An embedding sequence's part of a step that computes its next `num_tokens` tokens in
    the rows from `start` on: the rows it needs are appended to `pool_rows` (None: it
    needs none this step, and does not finish)."""
    rows = rows_to_pool(seq, num_tokens)
    finishes = seq.num_computed_tokens + num_tokens == seq.num_prompt_tokens
    if not rows and not finishes:
        return None
    piece = PoolSlice(seq_id, seq, len(pool_rows), len(rows), finishes)
    pool_rows.extend(start + r for r in rows)
    return piece


def rows_to_pool(seq: WorkerSeq, num_tokens: int) -> range:
    """Which of the `num_tokens` positions the step computes for `seq` (0 is its first) its
    vector needs."""
    assert seq.pooling is not None
    kind = seq.pooling.pooling_type
    if kind == "mean":
        return range(num_tokens)
    if kind == "cls":
        return range(1) if seq.num_computed_tokens == 0 else range(0)
    finishes = seq.num_computed_tokens + num_tokens == seq.num_prompt_tokens
    return range(num_tokens - 1, num_tokens) if finishes else range(0)


class Pooler:
    """Partial vectors (a running sum, or the first row) of the embedding sequences whose
    prompt is still computing, by seq id."""

    def __init__(self) -> None:
        self._partial: dict[int, torch.Tensor] = {}

    def leave(self, seq_id: int) -> None:
        self._partial.pop(seq_id, None)

    def add(
        self, hidden: torch.Tensor, slices: list[PoolSlice]
    ) -> tuple[tuple[int, ...], tuple[bytes, ...]]:
        """Take a step's pooled rows (`hidden`: [rows, hidden], the final norm's output);
        return the sequences whose vector it finished, and their vectors."""
        hidden = hidden.float()
        seq_ids: list[int] = []
        vectors: list[bytes] = []
        for piece in slices:
            rows = hidden[piece.first : piece.first + piece.count]
            self._keep(piece, rows)
            if piece.finishes:
                seq_ids.append(piece.seq_id)
                vectors.append(self._vector(piece, rows))
        return tuple(seq_ids), tuple(vectors)

    def _keep(self, piece: PoolSlice, rows: torch.Tensor) -> None:
        assert piece.seq.pooling is not None
        kind = piece.seq.pooling.pooling_type
        if kind == "mean":
            partial = self._partial.get(piece.seq_id)
            total = rows.sum(dim=0)
            self._partial[piece.seq_id] = total if partial is None else partial + total
        elif kind == "cls" and piece.count:
            self._partial[piece.seq_id] = rows[0].clone()

    def _vector(self, piece: PoolSlice, rows: torch.Tensor) -> bytes:
        pooling = piece.seq.pooling
        assert pooling is not None
        if pooling.pooling_type == "last":
            vector = rows[-1]
        else:
            vector = self._partial.pop(piece.seq_id)
            if pooling.pooling_type == "mean":
                vector = vector / piece.seq.num_prompt_tokens
        return to_bytes(shaped(vector, pooling))


def shaped(vector: torch.Tensor, pooling: PoolingParams) -> torch.Tensor:
    """Cut to `dimensions`, then normalized (vLLM's order: a matryoshka model's leading
    values are an embedding of their own, normalized as one)."""
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        vector = F.normalize(vector, dim=0)
    return vector


def to_bytes(vector: torch.Tensor) -> bytes:
    """Little-endian float32, as OpenAI's base64 embeddings are."""
    return bytes(vector.detach().float().cpu().numpy().astype("<f4").tobytes())
