"""What every actor needs to know about a checkpoint, read from its JSON files alone."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from runtime.config.engine import EngineConfig
from runtime.models import MODELS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    architecture: str
    hf_config: PretrainedConfig
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    dtype: torch.dtype

    def kv_bytes_per_block(self, block_size: int, num_kv_heads: int = 0) -> int:
        """Of a block holding `num_kv_heads` heads (default: all, i.e. one rank's share
        without tensor parallelism)."""
        per_token = 2 * self.num_layers * (num_kv_heads or self.num_kv_heads) * self.head_dim
        return per_token * block_size * self.dtype.itemsize


def load_model_info(config: EngineConfig) -> ModelInfo:
    path = Path(config.model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    hf = AutoConfig.from_pretrained(path)
    architecture = (getattr(hf, "architectures", None) or ["?"])[0]
    if architecture not in MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODELS)}")
    heads = hf.num_attention_heads
    return ModelInfo(
        architecture=architecture,
        hf_config=hf,
        vocab_size=hf.vocab_size,
        num_layers=hf.num_hidden_layers,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        max_position_embeddings=_context_limit(hf),
        eos_token_ids=_eos_token_ids(path, hf),
        dtype=_dtype(config, hf),
    )


def resolve_max_model_len(config: EngineConfig, info: ModelInfo) -> int:
    limit = info.max_position_embeddings
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len or limit


def _context_limit(hf: PretrainedConfig) -> int:
    limit = int(hf.max_position_embeddings)
    window = getattr(hf, "sliding_window", None)
    if window and getattr(hf, "use_sliding_window", True):
        limit = min(limit, int(window))  # within the window, full attention is exact
    return limit


def _eos_token_ids(path: Path, hf: PretrainedConfig) -> frozenset[int]:
    ids: set[int] = set()
    sources = [getattr(hf, "eos_token_id", None)]
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        sources.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(i for i in source if isinstance(i, int))
    return frozenset(ids)


def _dtype(config: EngineConfig, hf: PretrainedConfig) -> torch.dtype:
    """ "auto" serves the checkpoint's dtype, except as vLLM does: float32 runs in bfloat16
    where the hardware computes bf16 natively, and float16 runs in float32 on CPUs. Quantized
    weights compute in float32, as llama.cpp's do: the activations and the rest."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    if config.quantization is not None:
        return torch.float32
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.float32)
    if dtype == torch.float32 and native_bf16(config.device):
        return torch.bfloat16
    if dtype == torch.float16 and config.device == "cpu":
        return torch.float32  # fp16 matmuls on CPU are slow and lose precision
    return dtype


def native_bf16(device: str) -> bool:
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
