"""Embeddings equal transformers' `AutoModel` on the same checkpoint (its last_hidden_state,
after the final norm), in float32, for every tiny architecture: last and mean pooling
through chunked prefill, cls, prefix-cache hits, batching, token ids against text, and
matryoshka `dimensions` and truncation (on the llama checkpoint, declared matryoshka)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from runtime.config.engine import EngineConfig
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from runtime.protocol import FieldError, PoolingParams
from tests.conftest import ARCHS
from tests.engine_helpers import random_prompts
from tests.parity_helpers import last_hidden_states

LENGTHS = [1, 6, 40, 160]  # 160 tokens: four chunks of the 48-token budget
TEXT = "The tuple object is an immutable sequence; lists are mutable."


@pytest.fixture(scope="module")
def matryoshka_llama(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama, its config declaring matryoshka dimensions (16 and 64), as an
    embedding model's would (vLLM reads `matryoshka_dimensions`)."""
    folder = tmp_path_factory.mktemp("matryoshka")
    for file in llama_dir.iterdir():
        if file.name != "config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((llama_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16, 64]}))
    return folder


def vectors(results: list) -> list[torch.Tensor]:
    return [torch.tensor(r.embedding) for r in results]


@pytest.mark.parametrize("arch", ARCHS)
async def test_embeddings_equal_transformers_last_hidden_state(
    model_dirs: dict[str, Path], matryoshka_llama: Path, arch: str
) -> None:
    model_dir = matryoshka_llama if arch == "llama" else model_dirs[arch]
    prompts = random_prompts(LENGTHS, seed=5)
    config = EngineConfig(
        model=str(model_dir),
        mode="inproc",
        dtype="float32",  # transformers computes the references in float32
        max_model_len=256,
        max_num_batched_tokens=48,  # long inputs prefill in chunks: mean keeps a running sum
    )
    async with open_engine(config) as engine:
        last = await engine.embed(prompts)
        mean = await engine.embed(prompts, PoolingParams(pooling_type="mean"))
        cls = await engine.embed(prompts, PoolingParams(pooling_type="cls", normalize=False))
        again = await engine.embed(prompts[-1:])  # "last" reads the prefix cache
        singles = [(await engine.embed([p]))[0] for p in prompts[:3]]
        text_ids = engine.tokenizer(TEXT).input_ids
        by_text, by_ids = await engine.embed([TEXT]), await engine.embed([text_ids])
        if arch == "llama":
            await check_dimensions_and_truncation(engine, prompts[-1])
    references = last_hidden_states(model_dir, prompts)
    for got, h in zip(vectors(last), references, strict=True):
        assert F.cosine_similarity(got, h[-1], dim=0) >= 0.9999
        assert abs(got.norm() - 1) <= 1e-5
    for got, h in zip(vectors(mean), references, strict=True):
        assert F.cosine_similarity(got, h.mean(dim=0), dim=0) >= 0.9999
        assert abs(got.norm() - 1) <= 1e-5
    for got, h in zip(vectors(cls), references, strict=True):  # raw: not normalized
        torch.testing.assert_close(got, h[0], atol=1e-4, rtol=1e-4)
    assert again[0].num_cached_tokens == 144 and last[-1].num_cached_tokens == 0  # 9 blocks
    torch.testing.assert_close(vectors(again)[0], vectors(last)[-1], atol=1e-5, rtol=0)
    for one, batched in zip(singles, last[:3], strict=True):  # alone, or in one call: equal
        # to float32 rounding (another batch sums the GEMMs in another order)
        torch.testing.assert_close(vectors([one])[0], vectors([batched])[0], atol=1e-6, rtol=0)
    assert by_text[0].data == by_ids[0].data
    assert by_text[0].num_prompt_tokens == len(
        AutoTokenizer.from_pretrained(model_dir)(TEXT).input_ids
    )


async def check_dimensions_and_truncation(engine: Engine, prompt: list[int]) -> None:
    """Matryoshka: the first values of the raw vector, normalized; truncation: the last
    tokens, as if sent alone."""
    raw = vectors(await engine.embed([prompt], PoolingParams(normalize=False)))[0]
    (cut,) = vectors(await engine.embed([prompt], PoolingParams(dimensions=16)))
    assert cut.shape == (16,)
    torch.testing.assert_close(cut, F.normalize(raw[:16], dim=0), atol=1e-6, rtol=0)
    with pytest.raises(FieldError, match=r"only supports \[16, 64\]"):
        await engine.embed([prompt], PoolingParams(dimensions=32))
    (tail,) = await engine.embed([prompt], PoolingParams(truncate_prompt_tokens=10))
    (alone,) = await engine.embed([prompt[-10:]])
    assert tail.num_prompt_tokens == 10
    torch.testing.assert_close(torch.tensor(tail.embedding), torch.tensor(alone.embedding))
    too_long = prompt * 2  # 320 tokens, over the 256 of the context
    with pytest.raises(FieldError, match="maximum context length is 256 tokens"):
        await engine.embed([too_long])
    (fitted,) = await engine.embed([too_long], PoolingParams(truncate_prompt_tokens=-1))
    assert fitted.num_prompt_tokens == 256
