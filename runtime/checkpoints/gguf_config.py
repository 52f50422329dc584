"""A Hugging Face config.json and generation_config.json from a GGUF file's metadata."""

from __future__ import annotations

from typing import Any

from runtime.checkpoints.gguf_file import ARCHITECTURES, GGUFFile

# Token ids a generation stops at, in the order llama.cpp names them (end of sequence, of turn,
# of message).
_STOP_TOKENS = ("eos", "eot", "eom")
# Our role names -> llama.cpp's (tokenizer.ggml.<name>_token_id)
_KEYS = {"bos": "bos", "eos": "eos", "pad": "padding", "eot": "eot", "eom": "eom"}


def hf_config(file: GGUFFile) -> dict[str, Any]:
    heads = file.param("attention.head_count")
    hidden = file.param("embedding_length")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[file.architecture]],
        "model_type": file.architecture,
        "vocab_size": vocab_size(file),
        "hidden_size": hidden,
        "intermediate_size": file.param("feed_forward_length"),
        "num_hidden_layers": file.param("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": file.param("attention.head_count_kv", heads),
        "head_dim": head_dim(file, hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": file.param("context_length"),
        "rms_norm_eps": file.param("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta(file),
        "tie_word_embeddings": not file.has_tensor("output.weight"),
        "torch_dtype": "float32",
    } | special_token_ids(file, ("bos", "eos", "pad"))
    if not isinstance(config["num_key_value_heads"], int):
        raise ValueError(f"{file.path.name}: a KV head count per layer is not supported")
    if file.architecture == "llama":
        config |= {"attention_bias": file.has_tensor("blk.0.attn_q.bias"), "mlp_bias": False}
    if file.architecture == "qwen2":
        config["use_sliding_window"] = False
    return config


def generation_config(file: GGUFFile) -> dict[str, Any]:
    stops = list(dict.fromkeys(special_token_ids(file, _STOP_TOKENS).values()))
    config: dict[str, Any] = special_token_ids(file, ("bos", "pad"))
    if stops:
        config["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return config


def special_token_ids(file: GGUFFile, roles: tuple[str, ...]) -> dict[str, int]:
    """{"eos_token_id": 2, ...} for the roles the file names a token for."""
    ids = {role: file.get(f"tokenizer.ggml.{_KEYS[role]}_token_id", None) for role in roles}
    return {f"{role}_token_id": int(i) for role, i in ids.items() if i is not None}


def vocab_size(file: GGUFFile) -> int:
    """The embedding's rows: what the weights need, whatever the metadata says."""
    for tensor in file.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists dimensions innermost first
    raise ValueError(f"{file.path.name}: no token_embd.weight tensor")


def head_dim(file: GGUFFile, default: int) -> int:
    """attention.key_length where given (Qwen3's head_dim * heads != hidden); our attention
    rotates whole heads with equal K and V widths."""
    size = file.param("attention.key_length", default)
    if file.param("attention.value_length", size) != size:
        raise ValueError(f"{file.path.name}: key and value head sizes differ")
    if file.param("rope.dimension_count", size) != size:
        raise ValueError(f"{file.path.name}: rotary embedding over part of each head")
    return int(size)


def rope_theta(file: GGUFFile) -> float:
    scaling = file.param("rope.scaling.type", "none")
    if scaling != "none" and file.param("rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(f"{file.path.name}: RoPE scaling {scaling!r} is not supported yet")
    if file.has_tensor("rope_freqs.weight"):
        raise ValueError(
            f"{file.path.name}: RoPE frequency factors (Llama 3.1 scaling) are not supported yet"
        )
    return float(file.param("rope.freq_base", 10000.0))
