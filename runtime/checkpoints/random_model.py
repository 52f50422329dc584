"""Small, deterministic Hugging Face checkpoints for tests (`runtime make-model`).

Each checkpoint is a real HF directory (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a ChatML template) that both `transformers` and our
loader read. Weights are random from a fixed seed; the tokenizer is a byte-level BPE trained on
the text of Python's own `pydoc_data`, so no download is ever needed. Same seed, same bytes.

    runtime make-model --arch llama OUT_DIR
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyArch:
    model_type: str
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0


VOCAB_SIZE = 4096
ARCHS: dict[str, TinyArch] = {
    # ~5.1 M parameters, head_dim 64, GQA 4:2; the built-in default model.
    "llama": TinyArch(
        model_type="llama",
        architecture="LlamaForCausalLM",
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=704,
        max_position_embeddings=2048,
    ),
    # qkv bias, tied embeddings, multi-query attention (one kv head).
    "qwen2": TinyArch(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        hidden_size=192,
        num_layers=3,
        num_heads=6,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=512,
        max_position_embeddings=1024,
        qkv_bias=True,
        tie_embeddings=True,
        rope_theta=1_000_000.0,
    ),
    # per-head RMSNorm on q and k; head_dim * heads != hidden_size.
    "qwen3": TinyArch(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        hidden_size=192,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=512,
        max_position_embeddings=1024,
        qk_norm=True,
        rope_theta=1_000_000.0,
    ),
    # ~80 M parameters: big enough that matmuls, not op dispatch, fill a CPU step (for
    # benchmarks; too slow for the tests)
    "llama-80m": TinyArch(
        model_type="llama",
        architecture="LlamaForCausalLM",
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
        max_position_embeddings=2048,
    ),
}


def hf_config(arch: TinyArch) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": arch.rope_theta,
        "tie_word_embeddings": arch.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "torch_dtype": "float32",
    }
    if arch.model_type == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    return config


def random_weights(arch: TinyArch, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    # Larger than the usual 0.02 so that the next token really depends on the context: a broken
    # KV cache then changes greedy outputs instead of hiding behind a repeated token.
    def normal(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight(dim: int) -> torch.Tensor:
        return 1.0 + normal(dim, std=0.1)  # not all ones, so a missed norm shows in parity tests

    h, d = arch.hidden_size, arch.head_dim
    q_out, kv_out = arch.num_heads * d, arch.num_kv_heads * d
    weights = {
        "model.embed_tokens.weight": normal(VOCAB_SIZE, h),
        "model.norm.weight": norm_weight(h),
    }
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm_weight(h),
            p + "post_attention_layernorm.weight": norm_weight(h),
            p + "self_attn.q_proj.weight": normal(q_out, h),
            p + "self_attn.k_proj.weight": normal(kv_out, h),
            p + "self_attn.v_proj.weight": normal(kv_out, h),
            p + "self_attn.o_proj.weight": normal(h, q_out),
            p + "mlp.gate_proj.weight": normal(arch.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(arch.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, arch.intermediate_size),
        }
        if arch.qkv_bias:
            for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                weights[p + f"self_attn.{name}_proj.bias"] = normal(size, std=0.1)
        if arch.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm_weight(d)
            weights[p + "self_attn.k_norm.weight"] = norm_weight(d)
    if not arch.tie_embeddings:
        weights["lm_head.weight"] = normal(VOCAB_SIZE, h)
    return weights


def training_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n".join(topics[name] for name in sorted(topics))


def train_tokenizer() -> str:
    """A byte-level BPE (GPT-2 style) trained on local text; returns tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = training_text()
    chunks = [text[i : i + 10_000] for i in range(0, len(text), 10_000)]
    tokenizer.train_from_iterator(chunks, trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    return tokenizer.to_str(pretty=True)


def tokenizer_config() -> dict[str, object]:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0) -> Path:
    """Write a deterministic checkpoint of the named architecture into `out_dir`."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHS)}")
    spec = ARCHS[arch]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", hf_config(spec))
    write_json(
        out / "generation_config.json",
        {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID},
    )
    save_file(random_weights(spec, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "tokenizer.json").write_text(train_tokenizer())
    write_json(out / "tokenizer_config.json", tokenizer_config())
    return out
