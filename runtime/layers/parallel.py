"""Megatron-style tensor parallelism: the layers that split a model over the ranks of a
`TPGroup`, and the one group object they talk through.

A column-parallel layer holds a slice of the output rows (q/k/v heads, gate/up rows) and needs
no communication; a row-parallel layer holds a slice of the input columns (o, down) and
all-reduces its partial sums. The embedding and the LM head split the vocabulary. With one
rank every layer computes exactly what a plain one does, with the same operations, so TP=1
keeps today's numbers bit for bit.

Each sharded parameter says where its share of a checkpoint tensor lies (`Slot`), so the
loader reads only that share (`safetensors`' `get_slice`): no rank ever holds the whole model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import distributed as dist
from torch import nn

from runtime.kernels.quant_formats import QuantFormat, dequantize, quantize
from runtime.kernels.select import Kernels
from runtime.layers.basic import Linear
from runtime.layers.quantized import QuantKernels, empty_blocks, float_rows

# How long one collective of a step may wait for the other ranks before the engine is
# declared dead: a rank that hangs this long is not coming back in time to serve anyone.
STEP_TIMEOUT = timedelta(seconds=120)


class TPGroup:
    """The tensor-parallel ranks of one model replica. `backend` is a torch process group
    (gloo or NCCL, built by `runtime.worker.tp_group.join`); with one rank it is None and every
    collective is a no-op."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        backend: Any = None,
        device: str = "cpu",
        store: Any = None,
    ) -> None:
        self.rank, self.size, self.backend = rank, size, backend
        self.device = torch.device(device)  # where collectives' tensors live (NCCL: a GPU)
        self.store = store  # where the ranks met (a torch.distributed Store): small messages
        self.calls = 0  # roll calls so far (tp_group.agree), the same count on every rank
        self.timeout = STEP_TIMEOUT
        self.communicate_seconds = 0.0  # time spent in collectives, for the step-time split

    def all_reduce_(self, x: torch.Tensor, timeout: timedelta | None = None) -> None:
        if self.size > 1:
            options = dist.AllreduceOptions()
            self._run(self.backend.allreduce, [x], options, timeout)

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape on all) on rank 0, in rank order; None on the others."""
        if self.size == 1:
            return [x]
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self._run(self.backend.gather, [parts] if parts else [], options, None, [x])
        return parts or None

    def broadcast_(self, x: torch.Tensor, timeout: timedelta | None = None) -> None:
        """Rank 0's `x` into every rank's `x`."""
        if self.size > 1:
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor = 0, 0
            self._run(self.backend.broadcast, [x], options, timeout)

    def _run(
        self,
        collective: Any,
        tensors: list[Any],
        options: Any,
        timeout: timedelta | None,
        inputs: list[torch.Tensor] | None = None,
    ) -> None:
        """Run one collective and wait for it. The timeout goes into the operation itself,
        not only into the wait: gloo would otherwise fail it at the group's default timeout,
        and a group's destructor waits for operations still running."""
        options.timeout = timeout or self.timeout
        start = time.perf_counter()
        try:
            work = collective(tensors, inputs, options) if inputs else collective(tensors, options)
            work.wait()
        except RuntimeError as exc:
            raise TPGroupError(
                f"tensor-parallel rank {self.rank}: a collective failed ({exc}); a rank died "
                "or hangs"
            ) from None
        self.communicate_seconds += time.perf_counter() - start


SINGLE = TPGroup()


class TPGroupError(RuntimeError):
    """A collective failed or timed out: another rank of the model is gone or stuck."""


def divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"{what} ({total}) is not divisible by --tensor-parallel-size {size}")
    return total // size


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads split over the ranks, or, when there are fewer than ranks, one replicated
    head per rank (each rank's query heads all belong to it)."""
    if num_kv_heads >= size:
        return divide(num_kv_heads, size, "num_key_value_heads")
    if size % num_kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {size} is neither a divisor nor a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    return 1


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a rank's share of a checkpoint tensor of `full_shape` goes: `dest`, which holds
    the `dest.shape[dim]` entries from `start` along `dim`. With `quant`, `dest` holds the
    whole matrix as blocks of that format (quantized layers are never split over ranks): a
    float source is quantized into it, a uint8 one is blocks of that format already."""

    dest: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int = 0
    start: int = 0
    quant: QuantFormat | None = None

    def take(self, source: Any) -> torch.Tensor:
        """This rank's share of `source`: a tensor, or a safetensors slice (read lazily)."""
        if self.quant is not None or tuple(self.dest.shape) == self.full_shape:
            return source[:] if not isinstance(source, torch.Tensor) else source
        length = self.dest.shape[self.dim]
        return source[(slice(None),) * self.dim + (slice(self.start, self.start + length),)]

    def source_shape(self, dtype: torch.dtype) -> tuple[int, ...]:
        """The shape a source of `dtype` must have: blocks' bytes, or the float matrix."""
        if self.quant is not None and dtype == torch.uint8:
            return self.quant.packed_shape(self.full_shape)
        return self.full_shape

    def write(self, source: Any) -> None:
        """Copy this rank's share of `source` into `dest` (quantized, for blocks)."""
        part = self.take(source)
        if self.quant is not None and part.dtype != torch.uint8:
            part = quantize(part, self.quant.name)
        self.dest.copy_(part)

    def floats(self, part: torch.Tensor) -> torch.Tensor:
        """Rows of `dest` (or of its share) as the float values they hold."""
        return part.float() if self.quant is None else dequantize(part, self.quant.name)


def whole(param: torch.Tensor) -> Slot:
    return Slot(param, tuple(param.shape))


@dataclass(frozen=True, slots=True)
class Part:
    """One projection of a fused column-parallel layer: `full` rows in the checkpoint, of
    which this rank holds `size` from `start`."""

    full: int
    start: int
    size: int

    @classmethod
    def split(cls, full: int, tp: TPGroup, what: str) -> Part:
        size = divide(full, tp.size, what)
        return cls(full, tp.rank * size, size)


class ColumnParallelLinear(Linear):
    """Several projections of one input in one matmul (q/k/v, or gate/up), each holding its
    `Part` of the output rows; the loader copies each checkpoint tensor into its part."""

    def __init__(self, in_features: int, parts: list[Part], bias: bool) -> None:
        super().__init__(in_features, sum(p.size for p in parts), bias=bias)
        self.parts = parts

    def slot(self, param: str, part: int | None) -> Slot:
        tensor = getattr(self, param).data
        if part is None:  # the fused parameter by our own name: whole only on one rank
            if any(p.size != p.full for p in self.parts):
                raise KeyError(f"fused {param} split over ranks: name its parts instead")
            return whole(tensor)
        p = self.parts[part]
        offset = sum(q.size for q in self.parts[:part])
        full = (p.full, self.in_features) if param == "weight" else (p.full,)
        return Slot(tensor.narrow(0, offset, p.size), full, 0, p.start)


class RowParallelLinear(Linear):
    """Input columns split over the ranks; the partial products are all-reduced, and the
    bias (kept whole on every rank) is added once, after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(divide(in_features, tp.size, "the o/down input size"), out_features, bias)
        self.tp, self.full_in = tp, in_features

    def slot(self, param: str, part: int | None) -> Slot:
        if param == "bias":
            return whole(self.bias.data)
        full = (self.out_features, self.full_in)
        return Slot(self.weight.data, full, 1, self.tp.rank * self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.product(x, None)
        self.tp.all_reduce_(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous range of the vocabulary's rows; a token outside it
    contributes zeros, and the all-reduce assembles every token's row. Or (one rank) the rows
    are GGUF blocks (`quantize_`), each token's dequantized as it is looked up."""

    quant: QuantFormat | None = None
    quant_kernels: QuantKernels | None = None

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        rows = divide(vocab_size, tp.size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.tp, self.vocab_size, self.hidden, self.start = tp, vocab_size, hidden, tp.rank * rows
        self.lookup_dtype = torch.float32  # of the rows looked up in blocks

    def quantize_(self, fmt: QuantFormat, dtype: torch.dtype) -> None:
        """Hold the rows as (empty) blocks of `fmt`, looked up as `dtype`."""
        self.weight = empty_blocks(self.weight.shape[0], self.hidden, fmt, self.weight.device)
        self.quant, self.lookup_dtype = fmt, dtype

    def slot(self, param: str, part: int | None) -> Slot:
        return Slot(self.weight.data, (self.vocab_size, self.hidden), 0, self.start)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            rows = self.weight.index_select(0, input_ids)
            return float_rows(rows, self.quant, self.quant_kernels).to(self.lookup_dtype)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        self.tp.all_reduce_(x)
        return x


class ParallelLMHead(Linear):
    """The LM head over the same vocabulary range as the embedding (so tying still works);
    rank 0 gathers every rank's logits into the full row, the others get None."""

    def __init__(self, hidden: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__(hidden, divide(vocab_size, tp.size, "vocab_size"), bias=False)
        self.tp, self.vocab_size = tp, vocab_size

    def slot(self, param: str, part: int | None) -> Slot:
        full = (self.vocab_size, self.in_features)
        return Slot(self.weight.data, full, 0, self.tp.rank * self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        local = self(x).float()
        parts = self.tp.gather_to_first(local)
        if parts is None:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): the SwiGLU feed-forward of Llama and friends, with the
    intermediate rows split over the ranks."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        part = Part.split(intermediate, tp, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden, [part, part], bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp)

    def forward(self, x: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels is not None and gate_up.is_contiguous():
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
