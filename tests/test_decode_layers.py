"""A pure decode step's layers in one call (runtime/layers/decode_layers.py, cpu_decode.cpp):
the same kernels with the same arguments as the model's layer-by-layer Python, so the same
bits: greedy tokens and every log-probability equal, in float32, bfloat16 and GGUF blocks, with
several sequences of different lengths decoding together; in float32 the call ends in the
logits (the final norm and the LM head). And where it does not apply (q/k norms, the torch
path), the model keeps its Python layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from runtime.kernels.cpu import CpuKernels, load_cpu_kernels
from runtime.layers import decode_layers
from runtime.layers.basic import KIND_BLOCKS, KIND_REPACKED
from tests.engine_helpers import collect_all, random_prompts

PROMPTS = random_prompts([1, 5, 17, 40], seed=3)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
ENDED_IN_LOGITS: list[bool] = []  # each call: did it end in the logits (the final norm, head)?


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    ENDED_IN_LOGITS.clear()


async def generate(
    config: EngineConfig, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]] = PROMPTS
) -> tuple[list, int]:
    """The outputs of `prompts`, all at once, and how many steps went through the loop."""
    calls = []
    original = CpuKernels.decode_layers

    def counted(self: CpuKernels, *args: Any) -> None:
        calls.append(args[5])  # its rows
        ENDED_IN_LOGITS.append(args[-1] is not None)
        original(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(CpuKernels, "decode_layers", counted)
        async with open_engine(config) as engine:
            results = await collect_all(engine, prompts, GREEDY)
    outputs = [(r["tokens"], r["logprobs"], r["top_logprobs"]) for r in results]
    return outputs, len(calls)


async def python_layers(
    config: EngineConfig, monkeypatch: pytest.MonkeyPatch, prompts: list[list[int]] = PROMPTS
) -> list:
    with monkeypatch.context() as patch:
        patch.setattr(decode_layers, "plan", lambda model, kernels: None)
        outputs, calls = await generate(config, monkeypatch, prompts)
    assert calls == 0
    return outputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_one_call_gives_the_python_layers_bits(
    dtype: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # qwen2: a bias on q, k and v (llama's layers are the same calls without it). Where the
    # weights are packed for oneDNN instead of panels (AVX2 float32, bfloat16 with AMX or
    # without AVX512-BF16), oneDNN takes steps of 3 rows or more: two prompts there, so that
    # the loop covers their steps on every CPU
    config = EngineConfig(model=str(model_dirs["qwen2"]), mode="inproc", dtype=dtype)
    panels = load_cpu_kernels().panel_dtypes
    prompts = PROMPTS if getattr(torch, dtype) in panels else PROMPTS[1:3]
    looped, calls = await generate(config, monkeypatch, prompts)
    assert calls > 0
    # float32 steps end in the logits; bfloat16 ones leave the final norm and head to Python
    assert any(ENDED_IN_LOGITS) == (dtype == "float32")
    assert looped == await python_layers(config, monkeypatch, prompts)


@pytest.mark.parametrize(("repacked", "threads"), [(True, 0), (True, 3), (False, 0)])
async def test_one_call_gives_the_python_layers_bits_on_gguf_blocks(
    repacked: bool, threads: int, gguf_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks repacked for decode steps (cpu_repacked.cpp), or in the file's layout where
    the kernels do not repack them. Repacked, the step's threads share each product part by
    part (cpu_team.h): 2 threads here, 3 (more than this machine's cores, so that helpers
    are preempted mid-step) in the second case."""
    if not repacked:
        monkeypatch.setattr(CpuKernels, "repacked_formats", frozenset())
    kinds = set()
    planner = decode_layers.plan

    def recorded(model: Any, kernels: Any) -> decode_layers.DecodeLayers | None:
        planned = planner(model, kernels)
        kinds.update(spec.kind for spec in planned.linears if planned is not None)
        return planned

    monkeypatch.setattr(decode_layers, "plan", recorded)
    config = EngineConfig(model=str(gguf_files["qwen2-q4_1"]), mode="inproc",
                          quantization="gguf", num_threads=threads)  # fmt: skip
    looped, calls = await generate(config, monkeypatch)
    assert calls > 0
    assert kinds == {KIND_REPACKED if repacked else KIND_BLOCKS}
    assert any(ENDED_IN_LOGITS)
    assert looped == await python_layers(config, monkeypatch)


@pytest.mark.parametrize(
    ("arch", "backend"), [("qwen3", "cpp"), ("llama", "torch")]
)  # q/k norms; no CPU kernels
async def test_what_it_does_not_cover_keeps_the_python_layers(
    arch: str, backend: str, model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(model=str(model_dirs[arch]), mode="inproc", attention_backend=backend)
    _, calls = await generate(config, monkeypatch)
    assert calls == 0


def test_every_batch_size_shares_the_largest_steps_buffers() -> None:
    """The step's buffers for any number of rows lie in one block, the largest step's so far
    (a block for each size would hold up to max_num_seqs of them); a larger step replaces
    the block, and the smaller sizes' addresses then point into the new one."""
    from types import SimpleNamespace

    layers: Any = SimpleNamespace(width=10, starts=[0, 4, 7], dtype=torch.float32,
                                  _work=torch.empty(0), _addresses={})  # fmt: skip
    buffers = decode_layers.DecodeLayers._buffers

    def within_block(rows: int) -> bool:
        addresses = buffers(layers, rows).tolist()
        base, size = layers._work.data_ptr(), layers._work.numel() * 4
        expected = [base + 4 * rows * start for start in layers.starts]
        return addresses == expected and expected[-1] + 4 * rows * 3 <= base + size

    assert within_block(4)
    first = layers._work
    assert within_block(2) and layers._work is first  # smaller: the same block
    assert within_block(8) and layers._work is not first  # larger: a new one
    assert layers._work.numel() == 80
    assert within_block(2) and within_block(4)  # earlier sizes, into the new block
