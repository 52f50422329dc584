"""Greedy parity on GGUF files: our engine, serving a file through its converted copy, gives
the tokens transformers gives when its own GGUF loader reads the same file (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoConfig

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from tests.engine_helpers import collect_all
from tests.gguf_helpers import GGUF_CASES, MAX_TOKENS, PROMPTS, transformers_greedy

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize("case", GGUF_CASES)
async def test_greedy_parity_with_transformers_gguf_loader(
    case: str, gguf_files: dict[str, Path], model_dirs: dict[str, Path]
) -> None:
    """Q4_0, Q4_1 and Q8_0 matrices, a Q8_0 embedding, F32 norms and biases; llama's Q/K
    rows permuted in the file; qwen2's tied embeddings; qwen3's q/k norms and its head_dim
    32 != hidden / heads."""
    gguf = gguf_files[case]
    arch = GGUF_CASES[case].arch
    # transformers' GGUF loader does not read qwen3's attention.key_length: it would build
    # head_dim 128 (Qwen3Config's default), so it gets the true config; the weights are still
    # its own reading of the file (and test_gguf.py checks our config against the original).
    config = {"config": AutoConfig.from_pretrained(model_dirs[arch])} if arch == "qwen3" else {}
    expected = transformers_greedy(gguf, PROMPTS, **config)
    engine_config = EngineConfig(model=str(gguf), mode="inproc", dtype="float32")
    async with open_engine(engine_config) as engine:
        results = await collect_all(engine, PROMPTS, GREEDY)
    assert [r["tokens"] for r in results] == expected
    assert sum(len(tokens) for tokens in expected) > 4 * MAX_TOKENS  # not all cut short by EOS
