"""What a GGUF file holds (llama.cpp's format), read with gguf-py: metadata and tensors, and
whether we can serve it, said before anything is converted."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor

# GGUF's architecture names -> the Hugging Face architecture our model implements for it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
Q = GGMLQuantizationType
# What gguf.quants.dequantize reads that llama.cpp writes for these models (tested: F32, F16,
# Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and Q4_1 + Q8_0 in SmolLM2; the K-quants go through the
# same gguf-py call).
READABLE_TYPES = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
    | {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)
_MISSING = object()


class GGUFFile:
    """One open GGUF file. `get` reads a metadata value as Python data; `param` one of the
    architecture's hyper-parameters (`llama.block_count` is `param("block_count")`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GGUFReader(path)
        except (ValueError, KeyError, IndexError) as exc:  # gguf-py's words for a bad file
            raise ValueError(f"{path}: not a GGUF file we can read ({exc})") from None
        self.architecture: str = self.get("general.architecture", "?")
        self.tensors: list[ReaderTensor] = list(self.reader.tensors)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ValueError(f"{self.path.name}: metadata {key!r} is missing")
            return default
        return field_value(field)

    def param(self, key: str, default: Any = _MISSING) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def has_tensor(self, name: str) -> bool:
        return any(tensor.name == name for tensor in self.tensors)

    def quantization(self) -> str:
        """The tensor types it holds, most used first: 'Q4_1 x210, F32 x61, Q8_0 x1'."""
        counts = Counter(tensor.tensor_type.name for tensor in self.tensors)
        return ", ".join(f"{name} x{n}" for name, n in counts.most_common())

    def check(self) -> None:
        """A ValueError naming the architecture and the quantization types, for a file whose
        architecture or any tensor's type we cannot read."""
        where = f"{self.path.name} (architecture {self.architecture!r}; {self.quantization()})"
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{where}: we serve GGUF architectures {sorted(ARCHITECTURES)} only")
        unreadable = sorted({t.tensor_type.name for t in self.tensors} - _names(READABLE_TYPES))
        if unreadable:
            raise ValueError(
                f"{where}: cannot read quantization type(s) {', '.join(unreadable)}; "
                f"we read {', '.join(sorted(_names(READABLE_TYPES)))}"
            )


def field_value(field: ReaderField) -> Any:
    """A metadata field as Python data: str, int, float, bool or a list of them."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [_scalar(field.parts[i]) for i in field.data]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return _scalar(field.parts[field.data[0]])


def _scalar(part: np.ndarray) -> Any:
    """A float32 as the shortest decimal that is that float32: rms_eps 1e-05, as the original
    config.json said, rather than 9.999999747378752e-06."""
    if part.dtype == np.float32:
        return float(str(part[0]))
    return part[0].item()


def _names(types: frozenset[GGMLQuantizationType]) -> set[str]:
    return {t.name for t in types}
