"""A pure decode step's decoder layers in one call to the CPU kernels (cpu_decode.cpp).

The model's Python calls a dozen kernels a layer; at a decode step's few rows what surrounds
each call (a module's dispatch, a wrapper's checks, the views between them) costs more than
the kernel itself. `DecodeLayers` describes every layer once, as the addresses of its weights
and how each linear multiplies (the kernel `Linear.product` would pick for those rows), and a
step hands the C++ loop only what changes: the rows, the rotary tables, the cache's layout.
The same kernels run with the same arguments, so the results are the same bits as the
layer-by-layer path (tests/test_decode_layers.py compares them).

Where every row samples (a decode step's rows are its sequences' last tokens) and the model
is float32, the call goes on through the final norm and the LM head to the logits, so that
a step's threads share the head in the same region as the layers (cpu_team.h).

It covers what the kernels cover: one tensor-parallel rank, no q/k norms (Qwen3 keeps the
Python path), linears the CPU kernels multiply. It is rebuilt whenever the weights are packed
again (a weight update replaces their tensors); `plan` returns None where it does not apply.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from runtime.kernels.cpu_library import DTYPES
from runtime.kernels.cpu_matmul import quant_scratch_bytes, streamed_scratch_floats
from runtime.layers.attention import AttentionMetadata
from runtime.layers.basic import KIND_BLOCKS, KIND_REPACKED, KIND_STREAMED, Linear, LinearSpec
from runtime.layers.rotary import Rope

if TYPE_CHECKING:
    from runtime.kernels.cpu import CpuKernels
    from runtime.models.llama import DecoderLayer, LlamaForCausalLM

SPEC_WORDS = 26  # int64 words of cpu_decode.cpp's LayerSpec
HEAD_WORDS = 7  # and of its HeadSpec: the final norm's weight, then the head's LinearSpec


class DecodeLayers:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kernels: CpuKernels,
        linears: list[list[LinearSpec]],
        head: LinearSpec | None,
    ) -> None:
        args, first = model.args, decoder_layers(model)[0]
        self.kernels = kernels
        self.dtype = first.input_layernorm.weight.dtype
        self.layers = len(linears)
        words = []
        for layer, specs in zip(decoder_layers(model), linears, strict=True):
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            words += [norm.data_ptr() for norm in norms]
            words += [word for spec in specs for word in spec[:6]]
        self.spec = torch.tensor(words, dtype=torch.int64).view(self.layers, SPEC_WORDS)
        self.linears = [spec for specs in linears for spec in specs]
        self.max_rows = min(spec.max_rows for spec in self.linears)
        attention = first.self_attn
        self.heads, self.kv_heads = attention.num_heads, attention.num_kv_heads
        self.dim, self.scale = attention.head_dim, attention.scale
        self.hidden, self.eps = args.hidden_size, first.input_layernorm.eps
        qkv, gate_up = linears[0][0], linears[0][2]
        # the step's buffers (cpu_decode.cpp's Work), each [rows, width], in one tensor
        widths = (self.hidden, qkv.n, self.heads * self.dim, gate_up.n, gate_up.n // 2)
        self.width, self.starts = sum(widths), list(itertools.accumulate((0, *widths[:-1])))
        self.scratch = scratch_sizes(self.linears + ([head] if head else []), self.dtype)
        self._work = torch.empty(0, dtype=self.dtype)  # _buffers: the largest step's so far
        self._addresses: dict[int, torch.Tensor] = {}  # by rows, into self._work
        # the final norm and the LM head, where the step ends in every row's logits
        self.head = head
        if head is not None:
            norm = model.model.norm.weight.data_ptr()
            self.head_spec = torch.tensor([norm, *head[: HEAD_WORDS - 1]], dtype=torch.int64)

    def runs(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one the loop computes: decode rows only, with the kernels."""
        return (
            meta.kernels is self.kernels
            and not meta.prefills
            and meta.num_decodes == x.shape[0] <= self.max_rows
            and x.dtype == self.dtype
            and x.is_contiguous()
            and meta.decode_tables is not None
            and meta.decode_lens is not None
        )

    def ends_in_logits(self, x: torch.Tensor, logit_rows: torch.Tensor) -> bool:
        """Whether the step's call can end in the logits too: every row samples (a decode
        step's rows are its sequences' last tokens, in order) and the head takes them."""
        head = self.head
        return head is not None and logit_rows.shape[0] == x.shape[0] <= head.max_rows

    def logits(
        self, x: torch.Tensor, rope: Rope, kv_caches: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [rows, vocab] float32
        """The layers, the final norm and the LM head in one call (`ends_in_logits`)."""
        assert self.head is not None
        logits = torch.empty((x.shape[0], self.head.n), dtype=torch.float32)
        self._run(x, torch.empty_like(x), rope, kv_caches, meta, logits)
        return logits

    def __call__(
        self, x: torch.Tensor, rope: Rope, kv_caches: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream before it), as the layers return
        them; x (the embeddings) becomes the residual stream, in place."""
        y = torch.empty_like(x)
        self._run(x, y, rope, kv_caches, meta, None)
        return y, x

    def _run(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        rope: Rope,
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
        logits: torch.Tensor | None,
    ) -> None:
        assert meta.decode_tables is not None and meta.decode_lens is not None
        rows, threads = x.shape[0], torch.get_num_threads()
        buffers = self._buffers(rows)
        cos, sin = rope
        _, kv_heads, num_blocks, block_size, dim = kv_caches.shape[1:]
        steps = (cos, sin, meta.slot_mapping, meta.decode_tables, meta.decode_lens, kv_caches)
        if (kv_heads, dim) != (self.kv_heads, self.dim) or not all(
            t.is_contiguous() for t in steps
        ):
            raise ValueError("decode_layers takes contiguous step tensors of the model's shape")
        self.kernels.decode_layers(
            DTYPES[self.dtype], self.spec.data_ptr(), self.layers, x.data_ptr(), y.data_ptr(),
            rows, self.hidden, self.heads, self.kv_heads, self.dim, self.eps, self.scale,
            cos.data_ptr(), sin.data_ptr(), kv_caches.data_ptr(), kv_caches.stride(0),
            num_blocks, block_size, meta.slot_mapping.data_ptr(), meta.decode_tables.data_ptr(),
            meta.decode_tables.shape[1], meta.decode_lens.data_ptr(), buffers.data_ptr(),
            self.kernels._scratch(self._scratch_bytes(rows, threads)), threads,
            None if logits is None else self.head_spec.data_ptr(),
            None if logits is None else logits.data_ptr(),
        )  # fmt: skip

    def _buffers(self, rows: int) -> torch.Tensor:
        """The addresses of the step's buffers for `rows` rows (cpu_decode.cpp's Work), in
        one tensor kept from step to step (only the worker's torch thread runs steps). Every
        batch size shares one block of memory, the largest step's: a block a size would
        hold one for each of up to max_num_seqs sizes."""
        if self._work.numel() < rows * self.width:
            self._work = torch.empty(rows * self.width, dtype=self.dtype)
            self._addresses.clear()  # they pointed into the old block
        buffers = self._addresses.get(rows)
        if buffers is None:
            base, step = self._work.data_ptr(), self._work.element_size() * rows
            buffers = torch.tensor([base + step * start for start in self.starts])
            self._addresses[rows] = buffers
        return buffers

    def _scratch_bytes(self, rows: int, threads: int) -> int:
        return max(per_row * rows + per_thread * threads for per_row, per_thread in self.scratch)


def scratch_sizes(linears: list[LinearSpec], dtype: torch.dtype) -> set[tuple[int, int]]:
    """The scratch bytes each linear's kernel needs, as (per row, per thread): the step's
    need is the largest, as cpu_matmul.py sizes it per call."""
    sizes = {(0, 64)}
    for spec in linears:
        if spec.kind in (KIND_BLOCKS, KIND_REPACKED):
            sizes.add((quant_scratch_bytes(1, spec.k), 0))
        elif spec.kind == KIND_STREAMED and dtype == torch.bfloat16:
            per_row = streamed_scratch_floats(1, spec.n, spec.k, 0)
            sizes.add((4 * per_row, 4 * streamed_scratch_floats(0, spec.n, spec.k, 1)))
    return sizes


def install(model: nn.Module, kernels: Any) -> None:
    """Give a Llama-family model the loop for its layers as now packed (or take it away,
    where it does not apply: module docstring)."""
    from runtime.models.llama import LlamaForCausalLM

    if isinstance(model, LlamaForCausalLM):
        model.decode_layers = plan(model, kernels)


def plan(model: LlamaForCausalLM, kernels: Any) -> DecodeLayers | None:
    from runtime.kernels.cpu import CpuKernels

    if not isinstance(kernels, CpuKernels):
        return None
    layers = decoder_layers(model)
    if model.args.qk_norm or not layers or layers[0].self_attn.o_proj.tp.size != 1:
        return None
    dtype = layers[0].input_layernorm.weight.dtype
    linears = []
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        modules: list[Linear] = [
            attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
        ]  # fmt: skip
        specs = [module.decode_spec(dtype) for module in modules]
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(s is None for s in specs) or any(n.dtype != dtype for n in norms):
            return None
        linears.append([s for s in specs if s is not None])
    return DecodeLayers(model, kernels, linears, head_spec(model, dtype))


def head_spec(model: LlamaForCausalLM, dtype: torch.dtype) -> LinearSpec | None:
    """The LM head as the one call may end with it: float32 logits, as the Python path's,
    from a norm of the layers' eps and dtype (None: the step ends with the layers)."""
    norm, head = model.model.norm, model.lm_head
    layer_norm = decoder_layers(model)[0].input_layernorm
    if dtype != torch.float32 or norm.weight.dtype != dtype or norm.eps != layer_norm.eps:
        return None
    return head.decode_spec(dtype) if head.bias is None else None


def decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.model.layers))
