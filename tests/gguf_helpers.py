"""The tests' own GGUF files (written from the tiny checkpoints by tools/gguf_writer.py), the
texts the tokenizers are compared on, and transformers' GGUF loader as the reference."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from tests.engine_helpers import random_prompts


@dataclass(frozen=True)
class GGUFCase:
    arch: str
    qtype: str  # the matrices' type; the embedding is Q8_0 when quantized (as in SmolLM2)
    pre: str  # tokenizer.ggml.pre


# One per architecture, each with another of the types gguf-py can write, and the
# pre-tokenizer its family uses; F32 files are written by the round-trip tests.
GGUF_CASES = {
    "llama-q4_0": GGUFCase("llama", "Q4_0", "llama-bpe"),
    "qwen2-q4_1": GGUFCase("qwen2", "Q4_1", "qwen2"),
    "qwen3-q8_0": GGUFCase("qwen3", "Q8_0", "qwen2"),
}
PROMPTS = random_prompts([1, 7, 16, 33, 100], seed=26)  # 5 prompts x 32 tokens
MAX_TOKENS = 32

TEXTS = [
    "Hello world",
    "  leading spaces, and trailing  ",
    "3.14159 and 1234567890, 12,345.67 x2 2x 007",
    "ünïcödé ✓ 日本語のテキスト 🤖🎉 Ελληνικά",
    "tabs\tand\nnewlines\r\n\n\nend",
    "it's we'll they'd I'M",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|>a<|im_end|>b",
]
CHAT = [
    {"role": "system", "content": "You answer in French."},
    {"role": "user", "content": "What is 12 + 30? Ünïcode ✓"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And 7 * 6?"},
]


def transformers_greedy(
    gguf_path: Path, prompts: list[list[int]], **kwargs: Any
) -> list[list[int]]:
    """transformers' greedy continuations, its model read from the GGUF file by its own
    loader (which needs gguf and accelerate), in float32."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    # transformers asks gguf-py for its tensor-name map once per submodule (397 times for
    # SmolLM2: 3.5 of its 11 s); the map depends only on the architecture and layer count.
    name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
    with mock.patch.object(gguf, "get_tensor_name_map", name_map):
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, **kwargs
        )
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
