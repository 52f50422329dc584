"""Write a GGUF file from one of our tiny Hugging Face checkpoints, as llama.cpp's
convert_hf_to_gguf.py would: its metadata keys, its tensor names, Q/K rows permuted for llama
(llama.cpp rotates interleaved pairs), matrices quantized with gguf-py, norms and biases in F32.
For tests: the product reads GGUF files (runtime/checkpoints/gguf.py) but never writes them.

    python -m tools.gguf_writer CHECKPOINT_DIR OUT.gguf [--type Q4_0] [--pre qwen2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # HF model_type -> GGUF arch
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    _, _, layer, part = stem.split(".", 3)  # model.layers.N.part
    return f"blk.{layer}.{LAYER_NAMES[part]}.{suffix}"


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half layout to llama.cpp's
    interleaved pairs, per head."""
    shape = weights.shape
    pairs = weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
    return pairs.swapaxes(1, 2).reshape(shape)


def tensor_type(name: str, weights: np.ndarray, qtype: Q) -> Q:
    """Vectors stay F32, as llama.cpp keeps them; the embedding gets Q8_0 when quantizing, as in
    the SmolLM2 file."""
    if weights.ndim == 1 or qtype == Q.F32:
        return Q.F32
    return Q.Q8_0 if name == "token_embd.weight" else qtype


def add_tensors(writer: GGUFWriter, model_dir: Path, config: dict[str, Any], qtype: str) -> None:
    wanted = Q[qtype]
    for hf_name, weights in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        name = gguf_name(hf_name)
        if config["model_type"] == "llama" and ".attn_q." in name:
            weights = permute(weights, config["num_attention_heads"])
        elif config["model_type"] == "llama" and ".attn_k." in name:
            weights = permute(weights, config["num_key_value_heads"])
        kind = tensor_type(name, weights, wanted)
        data = weights.astype(np.float32)
        if kind == Q.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)


def add_hyper_parameters(writer: GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def add_tokenizer(writer: GGUFWriter, model_dir: Path, pre: str) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    types = [TokenType.CONTROL if token in special else TokenType.NORMAL for token in tokens]
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for role, add in (("eos", writer.add_eos_token_id), ("pad", writer.add_pad_token_id)):
        if tokenizer_config.get(f"{role}_token"):
            add(vocab[tokenizer_config[f"{role}_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])


def write_gguf(
    model_dir: str | Path, out: str | Path, qtype: str = "F32", pre: str = "gpt2"
) -> Path:
    """Write `model_dir` (a checkpoint `runtime make-model` wrote) as the GGUF file `out`, its
    matrices in `qtype` (F32, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: what gguf-py can quantize)."""
    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    writer = GGUFWriter(str(out), ARCHS[config["model_type"]])
    writer.add_name(model_dir.name)
    add_hyper_parameters(writer, config)
    add_tokenizer(writer, model_dir, pre)
    add_tensors(writer, model_dir, config, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out")
    parser.add_argument("--type", default="F32", help="F32, Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1")
    parser.add_argument("--pre", default="gpt2", help="tokenizer.ggml.pre: gpt2, qwen2, ...")
    args = parser.parse_args()
    print(f"wrote {write_gguf(args.model_dir, args.out, args.type, args.pre)}")


if __name__ == "__main__":
    main()
