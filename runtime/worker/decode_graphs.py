"""CUDA graphs of the decode step: one per batch-size bucket, captured at startup, replayed
with the step's inputs copied into static buffers and padded up to the bucket.

A decode step launches a few hundred small kernels; replaying a graph launches them all with
one call, so the step costs what the GPU takes, not what Python and the driver take. Prefill
steps, and batches larger than the largest bucket, run eagerly.

Padding rows are harmless by construction: token 0 at position 0, slot -1 (the store skips
it), context length 0 (decode attention gives zeros), and their logits are never read.
Without CUDA (the tests) the same padded forward runs eagerly, so the padding is proven on the
CPU; only the capture itself needs a GPU.
"""

from __future__ import annotations

import torch

from runtime.kernels.select import Kernels
from runtime.layers.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (vLLM's spacing), and max_batch."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
    buckets += list(range(16, max_batch, 16))
    return [*buckets, max_batch]


class DecodeGraphs:
    """The decode forward of `model` over `kv_caches` for every bucket up to `max_batch`
    sequences of up to `max_width` blocks each."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: torch.Tensor,
        kernels: Kernels,
        max_batch: int,
        max_width: int,
        buckets: list[int] | None = None,  # default: batch_buckets(max_batch)
    ) -> None:
        self.model, self.kv_caches, self.kernels = model, kv_caches, kernels
        self.buckets = buckets or batch_buckets(max_batch)
        device = kv_caches.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros((max_batch, max_width), dtype=torch.long, device=device)
        self.lens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.rows = torch.arange(max_batch, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def records(self, model: torch.nn.Module, kv_caches: torch.Tensor) -> bool:
        """Whether these graphs read this model's weights and this KV pool."""
        return self.model is model and self.kv_caches is kv_caches

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()  # no autograd records in the graphs' outputs
    def capture(self) -> None:
        """Record every bucket's graph, the largest first so the others reuse its memory."""
        pool = None
        for bucket in reversed(self.buckets):
            self._forward(bucket)  # warm-up: Triton compiles, allocators settle
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def fits(self, meta: AttentionMetadata, num_sampled: int, scores_prompts: bool) -> bool:
        """A pure decode step, small enough, in which every sequence samples and none scores
        its prompt: then its logit rows are its rows, in order, as the graphs compute them.
        (A one-token prompt chunk is a decode row that may score but not sample.)"""
        tables = meta.decode_tables
        return (
            not meta.prefills
            and 0 < meta.num_decodes <= self.max_batch
            and num_sampled == meta.num_decodes
            and not scores_prompts
            and tables is not None
            and tables.shape[1] <= self.tables.shape[1]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The step's logits [n, vocab], by the smallest bucket that holds its n sequences."""
        assert meta.decode_tables is not None and meta.decode_lens is not None
        n, width = meta.decode_tables.shape
        bucket = next(b for b in self.buckets if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, :width].copy_(meta.decode_tables)
        self.lens[:n].copy_(meta.decode_lens)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slots[n:bucket].fill_(-1)
        self.lens[n:bucket].zero_()
        graph = self.graphs.get(bucket)
        if graph is None:  # not captured (no CUDA): the same padded step, eagerly
            return self._forward(bucket)[:n]
        graph.replay()
        return self.outputs[bucket][:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bucket],
            num_decodes=bucket,
            prefills=[],
            kernels=self.kernels,
            decode_tables=self.tables[:bucket],
            decode_lens=self.lens[:bucket],
        )
        logits = self.model(
            self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, meta,
            self.rows[:bucket],
        )  # fmt: skip
        assert logits is not None, "decode graphs run without tensor parallelism"
        return logits
