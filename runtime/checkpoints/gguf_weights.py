"""A GGUF file's tensors as a Hugging Face safetensors checkpoint: dequantized to float32 with
gguf-py, llama.cpp's rotary row order undone, under Hugging Face names. Or, to keep its blocks
(`--quantization gguf`), the matrices in the formats our kernels multiply stay the file's
bytes (uint8 [rows, row_bytes]; the row order undone on whole rows of blocks), named with their
formats in quantization.json; any other type is dequantized, and the log says which."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file

from runtime.checkpoints.gguf import BLOCKS_FILE
from runtime.checkpoints.gguf_file import GGUFFile
from runtime.checkpoints.progress import Progress
from runtime.kernels.quant_formats import FORMATS

log = logging.getLogger(__name__)

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Float32 bytes per safetensors file: one file's tensors are in memory at a time.
SHARD_BYTES = 2 * 1024**3
# Tensors our model fuses into one matrix: kept as blocks only if all share one format.
_FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    match = _BLOCK.fullmatch(name)
    if match is None or match[2] not in _LAYER:
        return None
    return f"model.layers.{match[1]}.{_LAYER[match[2]]}.{match[3]}"


def check_names(file: GGUFFile) -> None:
    unknown = [t.name for t in file.tensors if hf_name(t.name) is None]
    if unknown:
        raise ValueError(
            f"{file.path.name}: tensor(s) {', '.join(unknown[:5])} have no place in a "
            f"{file.architecture} model"
        )


def unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp rotates interleaved pairs of
    each head's rows, Hugging Face (and we) rotate the two halves."""
    shape = weights.shape
    halves = weights.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
    return halves.swapaxes(1, 2).reshape(shape)


def kept_formats(file: GGUFFile) -> dict[str, str]:
    """The matrices that keep their blocks: each in a format we multiply, and a projection we
    fuse only with its partners in that same format. Logs what is dequantized instead."""
    types = {t.name: t.tensor_type.name for t in file.tensors if len(t.shape) == 2}
    kept = {name: kind for name, kind in types.items() if kind in FORMATS}
    for layer in {m[1] for name in types if (m := _BLOCK.fullmatch(name))}:
        for group in _FUSED:
            names = [f"blk.{layer}.{part}.weight" for part in group]
            if len({kept.get(name) for name in names if name in types}) > 1:
                for name in names:
                    kept.pop(name, None)  # our fused matrix has one format
    dropped = Counter(types[name] for name in types if name not in kept)
    floats = {"F32", "F16", "BF16"}
    if any(kind not in floats for kind in dropped):
        log.warning(
            "%s: dequantized to float32 (no kernel for the format, or a fused projection's "
            "parts differ): %s; kept as blocks: %s",
            file.path.name, _counts(dropped.elements()), _counts(kept.values()),
        )  # fmt: skip
    return kept


def _counts(kinds: Iterable[str]) -> str:
    return ", ".join(f"{kind} x{n}" for kind, n in Counter(kinds).most_common()) or "none"


def hf_tensor(tensor: ReaderTensor, config: dict[str, Any], keep: bool = False) -> torch.Tensor:
    if keep:  # rows of blocks, as the file has them
        weights = np.asarray(tensor.data)
    else:
        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = weights.reshape([int(d) for d in reversed(tensor.shape)])  # innermost first
    if config["model_type"] == "llama":  # llama.cpp permutes llama's Q and K only
        if ".attn_q." in tensor.name:
            weights = unpermute(weights, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            weights = unpermute(weights, config["num_key_value_heads"])
    dtype = np.uint8 if keep else np.float32
    return torch.from_numpy(np.array(weights, dtype=dtype))  # a copy: the file is mapped


def shards(tensors: list[ReaderTensor]) -> list[list[ReaderTensor]]:
    groups: list[list[ReaderTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + 4 * int(tensor.n_elements) > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += 4 * int(tensor.n_elements)
    return groups


def write_weights(
    file: GGUFFile, config: dict[str, Any], out_dir: Path, keep_blocks: bool = False
) -> None:
    """model.safetensors (or shards and their index) in `out_dir`: all float32, or with the
    matrices `kept_formats` names as blocks (and quantization.json naming their formats)."""
    kept = kept_formats(file) if keep_blocks else {}
    groups = shards(file.tensors)
    count = len(groups)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    names = ["model.safetensors"] if count == 1 else names
    weight_map: dict[str, str] = {}
    with Progress(len(file.tensors), f"Converting {file.path.name}", "tensor") as progress:
        for filename, group in zip(names, groups, strict=True):
            tensors = {}
            for tensor in group:
                tensors[str(hf_name(tensor.name))] = hf_tensor(tensor, config, tensor.name in kept)
                progress.advance()
            save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, filename)
    if count > 1:
        total = 4 * sum(int(t.n_elements) for t in file.tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if keep_blocks:
        formats = {str(hf_name(name)): kind for name, kind in sorted(kept.items())}
        plan = {"method": "gguf", "tensors": formats}
        (out_dir / BLOCKS_FILE).write_text(json.dumps(plan, indent=2) + "\n")
