"""One step's input tensors, built from its plan and the worker's mirror of the sequences:
the flattened token ids and positions, the attention metadata (cache slots, the gather rows
and key masks of single-query sequences, the prefill slices), the logit rows to compute, the
sampling parameters of the rows that sample, and the rows embedding sequences pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

from runtime.checkpoints.model_info import ModelInfo
from runtime.kernels.select import Kernels
from runtime.layers.attention import (
    AttentionMetadata,
    ExtendLayout,
    PrefillSlice,
    causal_mask,
    gather_rows,
)
from runtime.wire.messages import StepPlan
from runtime.worker.logprobs import PromptLogprobs
from runtime.worker.pooling import PoolSlice, pool_slice
from runtime.worker.sampler import SamplingBatch, make_sampling_batch
from runtime.worker.seq_table import SeqTable, WorkerSeq
from runtime.worker.transfer import device_tensor


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [S] rows whose logits are sampled
    sampled: list[int]  # indices into the plan's sequences, in logit-row order
    sampling: SamplingBatch | None
    # after the sampled rows: rows scoring prompt tokens, per (seq id, seq, positions)
    prompt_rows: list[tuple[int, WorkerSeq, range]]
    pool_rows: torch.Tensor  # [P] rows whose final-norm output embedding sequences pool
    pool_slices: list[PoolSlice]  # each embedding sequence's part of them (none: no pooling)


GreedyRow = tuple[float, int, float, float]  # temperature (0), top_k, top_p, min_p


class DecodeLayout(TypedDict, total=False):
    """AttentionMetadata's decode fields: the kernels' two, or the torch path's two."""

    decode_tables: torch.Tensor
    decode_lens: torch.Tensor
    decode_rows: torch.Tensor
    decode_bias: torch.Tensor


class InputBuilder:
    def __init__(
        self,
        device: torch.device,
        block_size: int,
        num_kv_heads: int,
        num_blocks: int,
        info: ModelInfo,
        prompt_logprobs: PromptLogprobs,
        kernels: Kernels | None = None,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.num_blocks = num_blocks
        self.info = info
        self.prompt_logprobs = prompt_logprobs  # which sequences score their prompt
        self.kernels = kernels  # None: the torch attention path
        self._greedy: tuple[tuple[GreedyRow, ...], SamplingBatch] | None = None

    def build(self, plan: StepPlan, seqs: list[WorkerSeq]) -> ModelInputs:
        """The step's inputs; `seqs`: the plan's sequences, as the table holds them."""
        # single-query sequences first: the attention computes them as one gathered batch
        order = sorted(range(len(seqs)), key=lambda i: plan.num_tokens[i] != 1)
        num_decodes = sum(1 for n in plan.num_tokens if n == 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampled: list[int] = []
        prefills: list[PrefillSlice] = []
        prefill_seqs: list[WorkerSeq] = []
        prompt_rows: list[tuple[int, WorkerSeq, range]] = []
        prompt_logit_rows: list[int] = []
        pool_rows: list[int] = []
        pool_slices: list[PoolSlice] = []
        scoring = self.prompt_logprobs.waiting  # once per step: usually nobody asks
        extends = self.kernels is not None and self.kernels.extends
        for i in order:
            seq, n = seqs[i], plan.num_tokens[i]
            start, computed = len(input_ids), seq.num_computed_tokens
            context = computed + n
            input_ids.extend(seq.token_ids[computed:context])
            positions.extend(range(computed, context))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(computed, context))
            if n > 1:
                rows = mask = None
                if computed and not extends:  # part of the context is already in the cache
                    blocks = self._tensor(table[: -(-context // bs)])
                    rows = gather_rows(blocks, self.num_kv_heads, self.num_blocks)
                    mask = causal_mask(n, context, self.device, self.info.dtype)
                prefills.append(PrefillSlice(start, n, context, rows, mask))
                prefill_seqs.append(seq)
            if seq.pooling is not None:  # an embedding: pooled, never sampled
                piece = pool_slice(plan.seq_ids[i], seq, n, start, pool_rows)
                if piece is not None:
                    pool_slices.append(piece)
            elif SeqTable.samples(seq, n):
                logit_rows.append(start + n - 1)
                sampled.append(i)
            if scoring:
                scored = self.prompt_logprobs.positions(plan.seq_ids[i], seq, n)
                if scored:
                    prompt_rows.append((plan.seq_ids[i], seq, scored))
                    prompt_logit_rows.extend(start + p - computed for p in scored)
        logit_rows += prompt_logit_rows  # after the sampled rows
        decode_seqs = [seqs[i] for i in order[:num_decodes]]
        context_lens = [s.num_computed_tokens + 1 for s in decode_seqs]
        width = max((-(-c // bs) for c in context_lens), default=0)
        tables = [b for s in decode_seqs for b in self._padded(s.block_table, width)]
        ids, where, slot_mapping, logits_at, pooled_at, lens, flat_tables = self._tensors(
            input_ids, positions, slots, logit_rows, pool_rows, context_lens, tables
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decodes=num_decodes,
            prefills=prefills,
            kernels=self.kernels,
            **self._decode_layout(flat_tables.view(num_decodes, width), lens),
        )
        if extends and prefills:
            meta.extend = self._extend_layout(prefills, prefill_seqs)
        return ModelInputs(
            input_ids=ids,
            positions=where,
            meta=meta,
            logit_rows=logits_at,
            sampled=sampled,
            sampling=self._sampling([seqs[i] for i in sampled]) if sampled else None,
            prompt_rows=prompt_rows,
            pool_rows=pooled_at,
            pool_slices=pool_slices,
        )

    def _decode_layout(self, tables: torch.Tensor, context_lens: torch.Tensor) -> DecodeLayout:
        """The single-query sequences' block tables [B, width] and lengths (the kernels read
        the cache in place), or for the torch path the cache rows to gather and an additive
        key mask."""
        if self.kernels is not None:
            return {"decode_tables": tables, "decode_lens": context_lens}
        if not tables.shape[0]:
            return {
                "decode_rows": self._tensor([]),
                "decode_bias": torch.zeros((0, 1, 1), device=self.device),
            }
        rows = gather_rows(tables, self.num_kv_heads, self.num_blocks)
        keys = torch.arange(tables.shape[1] * self.block_size, device=self.device)
        padding = keys[None, :] >= context_lens[:, None]  # [B, width * bs]
        bias = torch.zeros(padding.shape, dtype=self.info.dtype, device=self.device)
        bias.masked_fill_(padding, -torch.inf)
        # one row per (sequence, kv head), as the decode's batched matmul sees them
        bias = bias.repeat_interleave(self.num_kv_heads, dim=0).unsqueeze(1)
        return {"decode_rows": rows, "decode_bias": bias}

    def _extend_layout(self, prefills: list[PrefillSlice], seqs: list[WorkerSeq]) -> ExtendLayout:
        """The prefill slices' block tables, query rows and context lengths, as tensors."""
        width = max(-(-p.context_len // self.block_size) for p in prefills)
        tables = [self._padded(s.block_table, width) for s in seqs]
        return ExtendLayout(
            tables=self._tensor(tables).view(len(seqs), width),
            q_starts=self._tensor([p.start for p in prefills]),
            q_lens=self._tensor([p.num_queries for p in prefills]),
            context_lens=self._tensor([p.context_len for p in prefills]),
            max_queries=max(p.num_queries for p in prefills),
        )

    def _sampling(self, seqs: list[WorkerSeq]) -> SamplingBatch:
        rows = []
        vocab = self.info.vocab_size
        for seq in seqs:
            p = seq.params
            top_k = p.top_k if p.top_k < vocab else 0  # all of them: keep all, unfiltered
            rows.append((p.temperature, top_k, p.top_p, p.min_p, seq.seed, seq.num_output_tokens))
        # greedy rows draw nothing (their seeds and positions do not matter): the same rows
        # as the last step's, as in a greedy decode, reuse its batch
        greedy = tuple(row[:4] for row in rows)
        if all(row[0] == 0.0 for row in greedy) and self._greedy and self._greedy[0] == greedy:
            return self._greedy[1]
        batch = make_sampling_batch(rows, self.device)
        self._greedy = (greedy, batch) if batch.all_greedy else None
        return batch

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return device_tensor(values, torch.long, self.device)

    def _tensors(self, *lists: list[int]) -> tuple[torch.Tensor, ...]:
        """Each list as an int64 tensor on the device: views of one tensor, made (and on
        CUDA copied) at once, where each of a decode step's ~7 would cost as much again."""
        flat = [value for values in lists for value in values]
        return self._tensor(flat).split_with_sizes([len(values) for values in lists])

    @staticmethod
    def _padded(table: list[int], width: int) -> list[int]:
        return table[:width] + [0] * (width - len(table))
