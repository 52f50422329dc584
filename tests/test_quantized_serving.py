"""`--quantization gguf` and `int8` end to end on the tiny models: the GGUF files' Q4_0, Q4_1
and Q8_0 matrices kept as blocks (the embedding and a tied LM head too) and multiplied by the
kernels, greedy output compared with the dequantized float32 model's; the paths that do not go
together refused with what to do; weight updates onto blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.engine import Engine
from runtime.frontend.launch import open_engine
from runtime.kernels.quant_formats import dequantize, quantize
from tests.engine_helpers import collect_all
from tests.gguf_helpers import GGUF_CASES, MAX_TOKENS, PROMPTS

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


async def greedy(config: EngineConfig) -> tuple[list[list[int]], str]:
    """The greedy tokens of PROMPTS, and what the worker says it keeps as blocks."""
    async with open_engine(config) as engine:
        results = await collect_all(engine, PROMPTS, GREEDY)
        return [r["tokens"] for r in results], engine.server_info()["quantization"]


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


@pytest.mark.parametrize("case", GGUF_CASES)
async def test_blocks_without_the_kernels_give_the_float_models_tokens(
    case: str, gguf_files: dict[str, Path]
) -> None:
    """Torch's path multiplies the dequantized blocks: the float32 model's very products, so
    the same tokens. This checks the blocks are loaded where they belong (llama's Q and K
    rows unpermuted by whole rows of blocks, fused projections, a tied head)."""
    gguf = str(gguf_files[case])
    floats, _ = await greedy(
        EngineConfig(model=gguf, mode="inproc", dtype="float32", attention_backend="torch")
    )
    config = EngineConfig(model=gguf, mode="inproc", attention_backend="torch", quantization="gguf")
    blocks, kept = await greedy(config)
    qtype = GGUF_CASES[case].qtype
    assert kept.startswith("gguf (") and qtype in kept and "Q8_0" in kept  # the embedding
    assert blocks == floats


@pytest.mark.parametrize("case", GGUF_CASES)
async def test_the_kernels_choose_what_the_float_model_nearly_ties_with_its_best(
    case: str, gguf_files: dict[str, Path]
) -> None:
    """The kernels quantize activations to int8 as llama.cpp does, so a greedy sequence may
    part from the float32 model's where its best tokens nearly tie (and a random tiny model's
    often do, its Q4 head's logits tie exactly). So every token the kernels chose is scored by
    the float32 model, given the same tokens before it: within GAP of its best."""
    gguf = str(gguf_files[case])
    blocks, kept = await greedy(EngineConfig(model=gguf, mode="inproc", quantization="gguf"))
    assert GGUF_CASES[case].qtype in kept
    gaps = await float_gaps(EngineConfig(model=gguf, mode="inproc", dtype="float32"), blocks)
    floats, _ = await greedy(EngineConfig(model=gguf, mode="inproc", dtype="float32"))
    prefixes = [same_prefix(a, b) for a, b in zip(blocks, floats, strict=True)]
    print(f"{case}: the same greedy tokens up to {prefixes} of {MAX_TOKENS}; float32's best "
          f"beat the kernels' choice by {max(gaps):.4f} at most, at {sum(g > 0 for g in gaps)} "
          f"of {len(gaps)} steps")  # fmt: skip
    assert max(gaps) <= GAP
    assert sum(g == 0 for g in gaps) >= 0.8 * len(gaps)


GAP = 0.25  # nats: a random tiny model's best tokens are often that close


async def float_gaps(config: EngineConfig, sequences: list[list[int]]) -> list[float]:
    """For each generated token: how far below the float model's best it scores there."""
    gaps = []
    async with open_engine(config) as engine:
        for prompt, tokens in zip(PROMPTS, sequences, strict=True):
            params = SamplingParams(
                max_tokens=1, prompt_logprobs=1, prompt_logprobs_start=len(prompt)
            )
            (scored,) = await collect_all(engine, [prompt + tokens], params)
            for entry in scored["prompt_logprobs"]:
                best = max(logprob for _, logprob in entry.top)
                gaps.append(max(0.0, best - entry.logprob))
    return gaps


async def test_int8_chooses_what_the_float_model_nearly_ties_with_its_best(
    llama_dir: Path,
) -> None:
    """Every matrix of a float checkpoint quantized to Q8_0 as it loads: the same check,
    against those Q8_0 matrices dequantized (torch's path multiplies them in float32)."""
    config = EngineConfig(model=str(llama_dir), mode="inproc", quantization="int8")
    blocks, kept = await greedy(config)
    assert kept.startswith("int8 (Q8_0 x")
    float32 = config.replace(attention_backend="torch")
    gaps = await float_gaps(float32, blocks)
    print(f"int8: float32's best beat the kernels' choice by {max(gaps):.4f} at most, at "
          f"{sum(g > 0 for g in gaps)} of {len(gaps)} steps")  # fmt: skip
    assert max(gaps) <= GAP
    assert sum(g == 0 for g in gaps) >= 0.8 * len(gaps)


async def test_gguf_on_a_safetensors_folder_says_what_to_do(llama_dir: Path) -> None:
    config = EngineConfig(model=str(llama_dir), mode="inproc", quantization="gguf")
    with pytest.raises(ValueError, match="no GGUF file: give --model the"):
        async with open_engine(config):
            pass


async def test_a_folder_of_blocks_is_served_only_as_blocks(
    gguf_files: dict[str, Path],
) -> None:
    from runtime.checkpoints.gguf import resolve_checkpoint

    blocks = resolve_checkpoint(str(gguf_files["llama-q4_0"]), quantization="gguf")
    for quantization in (None, "int8"):
        config = EngineConfig(model=blocks, mode="inproc", quantization=quantization)
        with pytest.raises(ValueError, match="serve it with --quantization gguf"):
            async with open_engine(config):
                pass


def test_quantization_is_for_one_cpu_rank() -> None:
    with pytest.raises(ValueError, match="runs on the CPU"):
        EngineConfig(model="m", quantization="gguf", device="cuda")
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(model="m", quantization="int8", tensor_parallel_size=2)


async def values(engine: Engine, name: str, count: int = 64) -> torch.Tensor:
    return torch.tensor(await engine.weights.get_weights_by_name(name, count))


async def test_weight_updates_onto_blocks_are_quantized_or_refused(
    gguf_files: dict[str, Path], model_dirs: dict[str, Path]
) -> None:
    """Float weights land quantized to the layer's format (what a converter would write);
    blocks of another format, or of the wrong size, are refused and change nothing."""
    name = "model.layers.0.self_attn.o_proj.weight"
    source = model_dirs["llama"]  # the checkpoint the GGUF file was written from
    config = EngineConfig(model=str(gguf_files["llama-q4_0"]), mode="inproc", quantization="gguf")
    async with open_engine(config) as engine:
        before_tokens = [r["tokens"] for r in await collect_all(engine, PROMPTS, GREEDY)]
        before = await values(engine, name)
        other = torch.randn(256, 256)  # the tiny llama's o_proj
        done, message = await engine.weights.update_weights_from_tensor([(name, other)])
        assert done, message
        expected = dequantize(quantize(other, "Q4_0"), "Q4_0")
        assert torch.equal(await values(engine, name), expected.flatten()[:64])
        wrong = quantize(other, "Q8_0")  # 34-byte blocks where Q4_0's are 18
        done, message = await engine.weights.update_weights_from_tensor([(name, wrong)])
        assert not done and "Q4_0 blocks" in message
        assert torch.equal(await values(engine, name), expected.flatten()[:64])
        done, message, _ = await engine.weights.update_weights_from_disk(str(source))
        assert done, message  # the float checkpoint, quantized as it loads
        assert torch.equal(await values(engine, name), before)
        after_tokens = [r["tokens"] for r in await collect_all(engine, PROMPTS, GREEDY)]
    assert after_tokens == before_tokens
