"""The decode step's CUDA-graph runner: its buckets, which steps it takes, and that a step
padded up to its bucket computes what the unpadded step computes and writes nothing else into
the KV cache. On CUDA the step is captured and replayed (benchmarks/device_check.sh); without
it the padded step runs eagerly, in Triton's interpreter, which proves the padding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.config.engine import EngineConfig
from runtime.layers.attention import AttentionMetadata, PrefillSlice
from runtime.worker.decode_graphs import DecodeGraphs, batch_buckets
from runtime.worker.model_runner import ModelRunner

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_buckets_cover_every_batch_size() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(128) == [1, 2, 4, 8, *range(16, 129, 16)]


@pytest.fixture(scope="module")
def runner(llama_dir: Path) -> ModelRunner:
    config = EngineConfig(
        model=str(llama_dir),
        dtype="float32",
        device=DEVICE.type,
        attention_backend="triton",
        num_kv_blocks=32,
        max_model_len=128,
        max_num_seqs=8,
    )
    return ModelRunner(config)


def decode_step(runner: ModelRunner, lens: list[int]) -> tuple[torch.Tensor, ...]:
    """Input ids, positions and attention metadata of one decode step over scattered blocks."""
    gen = torch.Generator().manual_seed(len(lens))
    bs, n = runner.block_size, len(lens)
    width = -(-max(lens) // bs)
    tables = torch.randperm(runner.num_blocks, generator=gen)[: n * width].view(n, width)
    context = torch.tensor(lens)
    positions = context - 1
    slots = tables.gather(1, (positions // bs)[:, None]).squeeze(1) * bs + positions % bs
    ids = torch.randint(0, runner.info.vocab_size, (n,), generator=gen)
    return tuple(t.to(DEVICE) for t in (ids, positions, slots, tables, context))


def metadata(runner: ModelRunner, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor):  # type: ignore[no-untyped-def]
    return AttentionMetadata(
        slot_mapping=slots,
        num_decodes=len(lens),
        prefills=[],
        kernels=runner.kernels,
        decode_tables=tables,
        decode_lens=lens,
    )


@pytest.mark.parametrize("lens", [[17, 5, 33], [1], [40, 9, 64, 2, 18]])
def test_a_padded_step_computes_what_the_step_computes(
    runner: ModelRunner, lens: list[int]
) -> None:
    assert runner.weights.model is not None and runner.kernels is not None
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(runner.kv_caches.shape, generator=gen).to(DEVICE)
    ids, positions, slots, tables, context = decode_step(runner, lens)
    meta = metadata(runner, slots, tables, context)
    eager_cache, original = cache.clone(), cache.clone()
    with torch.inference_mode():
        rows = torch.arange(len(lens), device=DEVICE)
        expected = runner.weights.model(ids, positions, eager_cache, meta, rows)
        graphs = DecodeGraphs(runner.weights.model, cache, runner.kernels, max_batch=8, max_width=8)
        assert graphs.fits(meta, num_sampled=len(lens), scores_prompts=False)
        if DEVICE.type == "cuda":
            graphs.capture()
        logits = graphs.run(ids, positions, meta)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    # the real tokens' keys and values (computed in a larger matmul: equal to rounding), and
    # nothing else: the padding rows stored nothing
    flat, eager_flat, before = (
        c.view(*c.shape[:3], -1, c.shape[-1]) for c in (cache, eager_cache, original)
    )
    torch.testing.assert_close(flat[:, :, :, slots], eager_flat[:, :, :, slots])
    flat[:, :, :, slots] = before[:, :, :, slots]
    assert torch.equal(cache, original)


def test_only_pure_decode_steps_that_fit_take_the_graphs(runner: ModelRunner) -> None:
    assert runner.weights.model is not None and runner.kernels is not None
    graphs = DecodeGraphs(
        runner.weights.model, runner.kv_caches, runner.kernels, max_batch=4, max_width=2
    )
    _, _, slots, tables, lens = decode_step(runner, [20, 3])
    assert graphs.fits(metadata(runner, slots, tables, lens), num_sampled=2, scores_prompts=False)
    # a one-token prompt chunk: a decode row that does not sample, or that scores its prompt
    assert not graphs.fits(
        metadata(runner, slots, tables, lens), num_sampled=1, scores_prompts=False
    )
    assert not graphs.fits(
        metadata(runner, slots, tables, lens), num_sampled=2, scores_prompts=True
    )
    chunk = metadata(runner, slots, tables, lens)
    chunk.prefills = [PrefillSlice(2, 5, 5, None, None)]
    assert not graphs.fits(chunk, num_sampled=3, scores_prompts=False)
    _, _, slots, tables, lens = decode_step(runner, [40])  # 3 blocks > max_width
    assert not graphs.fits(
        metadata(runner, slots, tables, lens), num_sampled=1, scores_prompts=False
    )
    _, _, slots, tables, lens = decode_step(runner, [5] * 5)  # 5 > max_batch
    assert not graphs.fits(
        metadata(runner, slots, tables, lens), num_sampled=5, scores_prompts=False
    )
