"""Which of the served model's matrices are kept as GGUF blocks (`--quantization`), decided once
at startup from the flag and the checkpoint folder, and applied to every copy of the model
the worker builds (at startup, and for each checkpoint loaded in its place), before its
weights are loaded.

- `gguf`: the folder is a GGUF file converted with its blocks kept (runtime/checkpoints/
  gguf.py writes `quantization.json` there, naming each kept tensor's format); those
  matrices stay blocks, the rest is float.
- `int8`: every matrix (the linears, the embedding, an untied LM head) becomes Q8_0, int8 per
  block of 32 with a float16 scale, quantized as the float checkpoint is loaded.

With tied embeddings the LM head is the embedding's matrix: it reads the same blocks, as
llama.cpp's does (runtime/layers/quantized.py multiplies them).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from runtime.checkpoints.gguf import BLOCKS_FILE, check_folder
from runtime.kernels.quant_formats import BLOCK, FORMATS, QuantFormat, quant_format
from runtime.layers.basic import Linear
from runtime.layers.parallel import VocabParallelEmbedding

log = logging.getLogger(__name__)

METHODS = ("gguf", "int8")
INT8 = FORMATS["Q8_0"]


@dataclass(frozen=True, slots=True)
class QuantPlan:
    method: str  # "gguf" or "int8"
    kept: Mapping[str, str] = field(default_factory=dict)  # gguf: checkpoint name -> format

    def apply(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Give each planned layer empty blocks of its format, for the loader to fill."""
        tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
        packed = getattr(model, "packed_modules", {})
        for name, module in model.named_modules():
            if tied and name == "lm_head":
                continue  # the embedding's matrix
            fmt = self._format(name, module, packed)
            if fmt is None:
                continue
            if isinstance(module, VocabParallelEmbedding):
                module.quantize_(fmt, dtype)
            else:
                assert isinstance(module, Linear)
                module.quantize_(fmt)
        embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
        head = getattr(model, "lm_head", None)
        if tied and isinstance(embedding, VocabParallelEmbedding) and isinstance(head, Linear):
            head.weight = embedding.weight  # tied again, to the blocks
            head.quant = embedding.quant

    def _format(
        self, name: str, module: nn.Module, packed: Mapping[str, tuple[str, int]]
    ) -> QuantFormat | None:
        if not isinstance(module, Linear | VocabParallelEmbedding):
            return None
        if self.method == "int8":
            k = module.in_features if isinstance(module, Linear) else module.hidden
            if k % BLOCK:
                log.warning("%s stays float: its rows are not whole blocks of %d", name, BLOCK)
                return None
            return INT8
        formats = {self.kept.get(f"{source}.weight") for source in _sources(name, packed)}
        if len(formats) > 1:
            raise ValueError(f"{name}: its parts are kept in different formats {formats}")
        kept = formats.pop()
        return None if kept is None else quant_format(kept)


def _sources(name: str, packed: Mapping[str, tuple[str, int]]) -> list[str]:
    """The checkpoint's names of our module `name`: its parts, for a fused one."""
    parent, _, last = name.rpartition(".")
    parts = [(index, source) for source, (fused, index) in packed.items() if fused == last]
    return [f"{parent}.{source}" for _, source in sorted(parts)] or [name]


def plan_for(quantization: str | None, model_dir: str) -> QuantPlan | None:
    """The plan `--quantization` asks for with this checkpoint folder; a ValueError saying
    what to do instead where they do not go together."""
    if quantization is not None and quantization not in METHODS:
        raise ValueError(f"--quantization {quantization!r} is not one of {', '.join(METHODS)}")
    check_folder(Path(model_dir), quantization)
    if quantization is None:
        return None
    if quantization == "int8":
        return QuantPlan("int8")
    kept = read_kept(Path(model_dir))
    assert kept is not None  # check_folder: the folder keeps blocks
    return QuantPlan("gguf", kept)


def read_kept(model_dir: Path) -> dict[str, str] | None:
    """The formats of a folder's tensors kept as GGUF blocks; None: the folder keeps none."""
    path = model_dir / BLOCKS_FILE
    if not path.is_file():
        return None
    kept = json.loads(path.read_text())["tensors"]
    for fmt in kept.values():
        quant_format(fmt)  # one we have a kernel for, or a ValueError
    return dict(kept)


def describe(model: nn.Module, plan: QuantPlan | None) -> str:
    """What the model runs, read off its layers: 'gguf (Q4_1 x120, Q8_0 x1)', or 'none'."""
    if plan is None:
        return "none"
    seen: dict[int, str] = {}
    for module in model.modules():
        fmt = getattr(module, "quant", None)
        weight = getattr(module, "weight", None)
        if fmt is not None and isinstance(weight, torch.Tensor):
            seen[weight.data_ptr()] = fmt.name  # a tied head's blocks counted once
    counts = Counter(seen.values())
    return f"{plan.method} ({', '.join(f'{name} x{n}' for name, n in counts.most_common())})"
