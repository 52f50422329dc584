"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a flattened batch with a paged KV cache.

The four differ only in switches: Qwen2 adds a bias to q/k/v, Qwen3 normalizes q and k per head,
Qwen2 and small Qwen3s tie the LM head to the embeddings, and Llama may bias every projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from runtime.layers.attention import AttentionMetadata, paged_attention
from runtime.layers.basic import RMSNorm
from runtime.layers.decode_layers import DecodeLayers
from runtime.layers.parallel import (
    SINGLE,
    ColumnParallelLinear,
    GatedMLP,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    divide,
    kv_heads_per_rank,
)
from runtime.layers.rotary import Rope, RotaryEmbedding, apply_rope_


@dataclass(frozen=True, slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, config: PretrainedConfig, architecture: str) -> ModelArgs:
        heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=attention_bias or architecture == "Qwen2ForCausalLM",
            o_bias=attention_bias and architecture != "Qwen2ForCausalLM",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


class Attention(nn.Module):
    """Each tensor-parallel rank computes its share of the query heads and of the KV heads
    (or one replicated KV head, when there are fewer than ranks), and keeps that KV shard."""

    def __init__(self, args: ModelArgs, tp: TPGroup) -> None:
        super().__init__()
        self.num_heads = divide(args.num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(args.num_kv_heads, tp.size)
        self.head_dim = d = args.head_dim
        q = Part.split(args.num_heads * d, tp, "num_attention_heads")
        if self.num_kv_heads * tp.size == args.num_kv_heads:
            kv = Part.split(args.num_kv_heads * d, tp, "num_key_value_heads")
        else:  # replicated: rank r serves the KV head its query heads belong to
            head = tp.rank * args.num_kv_heads // tp.size
            kv = Part(args.num_kv_heads * d, head * d, d)
        self.qkv_proj = ColumnParallelLinear(args.hidden_size, [q, kv, kv], args.qkv_bias)
        self.o_proj = RowParallelLinear(args.num_heads * d, args.hidden_size, args.o_bias, tp)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Rope,  # cos, sin: [T, 1, head_dim]
        kv_cache: torch.Tensor,  # [2, kv_heads, blocks, block_size, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        heads = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q_and_k = heads[:, : self.num_heads + self.num_kv_heads]  # [T, heads + kv_heads, D]
        if self.q_norm is not None and self.k_norm is not None:
            q_and_k[:, : self.num_heads] = self.q_norm(q_and_k[:, : self.num_heads])
            q_and_k[:, self.num_heads :] = self.k_norm(q_and_k[:, self.num_heads :])
        # in place: q and k stay next to v, ready for the cache
        if meta.kernels is None:
            apply_rope_(rope, q_and_k)
        else:
            meta.kernels.rotary_(q_and_k, *rope)
        out = paged_attention(heads, self.num_heads, kv_cache, meta, self.scale)
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, tp)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.mlp_bias, tp)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,  # None in the first layer: x is the embedding
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): the next layer adds them,
        fused with its norm, as the residual stream's `x + f(norm(x))` asks."""
        kernels = meta.kernels
        if residual is None:
            residual, h = x, self.input_layernorm(x, kernels)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual, kernels)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual, kernels)
        return self.mlp(h, kernels), residual


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(args, tp) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Hugging Face parameter names (`model.layers.0.self_attn...`), q/k/v and gate/up fused."""

    # checkpoint module name -> (our fused module name, shard index)
    packed_modules: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, args: ModelArgs, config: PretrainedConfig, max_len: int, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.args = args
        self.rotary = RotaryEmbedding(config, args.head_dim, max_len)
        self.model = LlamaModel(args, tp)
        self.lm_head = ParallelLMHead(args.hidden_size, args.vocab_size, tp)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # a pure decode step's layers in one call to the CPU kernels, where they cover them:
        # set (or cleared) each time the weights are packed for them
        self.decode_layers: DecodeLayers | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [layers, 2, kv_heads, blocks, block_size, head_dim]
        meta: AttentionMetadata,
        logit_rows: torch.Tensor,  # rows whose next-token logits are wanted
    ) -> torch.Tensor | None:  # [len(logit_rows), vocab] on tensor-parallel rank 0
        x = self.model.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        one_call = self.decode_layers
        if (
            one_call is not None
            and one_call.runs(x, meta)
            and one_call.ends_in_logits(x, logit_rows)
        ):
            return one_call.logits(x, rope, kv_caches, meta)
        x, residual = self._layers(x, rope, kv_caches, meta)
        return self.logits(x, residual, logit_rows, meta)

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the final norm's inputs, [T, hidden] each
        """The last layer's output and the residual stream before it (every rank has them
        whole: the layers end in all-reduces)."""
        x = self.model.embed_tokens(input_ids)
        return self._layers(x, self.rotary.lookup(positions, x.dtype), kv_caches, meta)

    def _layers(
        self, x: torch.Tensor, rope: Rope, kv_caches: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.decode_layers is not None and self.decode_layers.runs(x, meta):
            return self.decode_layers(x, rope, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        assert residual is not None
        return x, residual

    def final_norm(
        self, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [len(rows), hidden]
        """The final norm of some rows only (it is per row): Hugging Face's last_hidden_state
        there. Indexing copies them, so the fused kernel may write its residual in place."""
        normed, _ = self.model.norm.add_and_norm(x[rows], residual[rows], meta.kernels)
        return normed

    def logits(
        self, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:  # [len(rows), vocab] on tensor-parallel rank 0
        return self.lm_head.logits(self.final_norm(x, residual, rows, meta))
