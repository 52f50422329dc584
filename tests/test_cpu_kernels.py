"""The compiled CPU kernels. Decode and extend (prefill) attention against float64
references: every head_dim variant (the AVX-512 ones, 64 and 128, and the plain loops),
grouped heads, ragged lengths, block sizes that do and do not hold whole tiles, chunks after a
cached prefix; refusals of indices outside the cache or q. The fused norm, SiLU-mul and rotary
against the torch ops they replace."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from runtime.kernels.cpu import CpuKernels, KernelError, load_cpu_kernels
from runtime.kernels.cpu_build import FLAGS, SOURCES
from runtime.layers import basic
from runtime.layers.basic import PACKED_STREAMED_ROWS, STREAMED_ROWS, Linear, RMSNorm
from runtime.layers.rotary import RotaryEmbedding, apply_rope_
from runtime.worker.sampler import choose, make_sampling_batch
from tests.kernel_cases import (
    TIE_CASES,
    check_sampling_among_ties,
    check_sampling_draws,
    extend_reference,
    poison_past_the_end,
    random_case,
    reference,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "longest"),
    [
        (12, 4, 64, 16, 200),  # the AVX-512 variant, a group of 3
        (4, 2, 128, 16, 33),  # head_dim 128; the last tile holds one token
        (8, 8, 64, 32, 70),  # no grouping; two tiles per block
        (6, 2, 48, 8, 41),  # the plain loops; half-tile blocks
        (2, 1, 16, 4, 9),
    ],
)
def test_decode_matches_float64_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int, longest: int
) -> None:
    q, cache, tables, lens = random_case(5, heads, kv_heads, dim, block_size, longest, dtype)
    poison_past_the_end(cache, tables, lens)
    scale = dim**-0.5
    out = load_cpu_kernels().decode(q, cache, tables, lens, scale)
    expected = reference(q, cache, tables, lens, scale)
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tolerance)


def extend_case(
    heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """(queries, context) per chunk: a whole prompt; a chunk after a cached prefix; a longer
    one over a prefix; one query (a fully cached prompt's last token)."""
    shapes = [(5, 5), (3, 40), (20, 53), (1, 17)]
    q_lens = torch.tensor([n for n, _ in shapes])
    context_lens = torch.tensor([c for _, c in shapes])
    _, cache, tables, _ = random_case(len(shapes), heads, kv_heads, dim, block_size, 53, dtype)
    poison_past_the_end(cache, tables, context_lens)
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(int(q_lens.sum()), heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    return fused[:, :heads], cache, tables, q_starts, q_lens, context_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(9, 3, 64, 16), (4, 2, 128, 16), (6, 3, 24, 8), (4, 1, 32, 16)],
)
def test_extend_matches_float64_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    q, cache, tables, q_starts, q_lens, context_lens = extend_case(
        heads, kv_heads, dim, block_size, dtype
    )
    scale = dim**-0.5
    out = load_cpu_kernels().extend(q, cache, tables, q_starts, q_lens, context_lens, 20, scale)
    expected = extend_reference(q, cache, tables, q_lens, context_lens, scale)
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tolerance)


def test_extend_refuses_chunks_outside_q_or_their_tables() -> None:
    kernels = load_cpu_kernels()
    q, cache, tables, q_starts, q_lens, context_lens = extend_case(4, 2, 64, 16, torch.float32)

    def extend(
        starts: torch.Tensor = q_starts,
        contexts: torch.Tensor = context_lens,
        blocks: torch.Tensor = tables,
    ) -> torch.Tensor:
        return kernels.extend(q, cache, blocks, starts, q_lens, contexts, 20, 0.125)

    past_q = q_starts.clone()
    past_q[-1] = q.shape[0]  # its one query row would lie past q's last
    with pytest.raises(KernelError, match="chunk"):
        extend(starts=past_q)
    with pytest.raises(KernelError, match="chunk"):  # more queries than context
        extend(contexts=torch.where(q_lens > 1, q_lens - 1, context_lens))
    with pytest.raises(KernelError, match="context length"):
        extend(contexts=context_lens + tables.shape[1] * 16)
    bad_block = tables.clone()
    bad_block[1, 0] = cache.shape[2]
    with pytest.raises(KernelError, match="block id"):
        extend(blocks=bad_block)
    with pytest.raises(KernelError, match="starts"):
        extend(starts=q_starts[:2])


def test_decode_is_the_same_on_one_thread_and_two() -> None:
    q, cache, tables, lens = random_case(9, 12, 4, 64, 16, 100, torch.float32)
    kernels = load_cpu_kernels()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.decode(q, cache, tables, lens, 0.125)
        torch.set_num_threads(2)
        two = kernels.decode(q, cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (sequence, kv head) is computed whole by one thread


def test_store_kv_writes_each_head_to_its_slot() -> None:
    kernels = load_cpu_kernels()
    cache = torch.zeros(2, 2, 6, 4, 8, dtype=torch.bfloat16)
    fused = torch.randn(3, 2 + 4, 8).to(torch.bfloat16)  # 2 query heads, then K, V heads
    kv = fused[:, 2:]
    slots = torch.tensor([5, 0, 23])
    kernels.store_kv(cache, kv, slots)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        assert torch.equal(cache[0, :, block, offset], kv[t, :2])
        assert torch.equal(cache[1, :, block, offset], kv[t, 2:])
    assert int((cache != 0).any(-1).sum()) == 3 * 4  # nothing else was written


def test_indices_outside_the_cache_are_refused() -> None:
    kernels = load_cpu_kernels()
    q, cache, tables, lens = random_case(2, 4, 2, 64, 16, 40, torch.float32)
    bad_block = tables.clone()
    bad_block[1, 0] = cache.shape[2]
    with pytest.raises(KernelError, match="block id"):
        kernels.decode(q, cache, bad_block, lens, 0.125)
    negative = tables.clone()
    negative[0, 0] = -1
    with pytest.raises(KernelError, match="block id"):
        kernels.decode(q, cache, negative, lens, 0.125)
    with pytest.raises(KernelError, match="context length"):
        kernels.decode(q, cache, tables, lens + tables.shape[1] * 16, 0.125)
    kv = torch.randn(1, 4, 64)
    with pytest.raises(KernelError, match="slot"):
        kernels.store_kv(cache, kv, torch.tensor([cache.shape[2] * cache.shape[3]]))
    with pytest.raises(KernelError, match="contiguous"):
        kernels.decode(q.transpose(1, 2), cache, tables, lens, 0.125)
    with pytest.raises(KernelError, match="int64"):
        kernels.decode(q, cache, tables.int(), lens, 0.125)
    with pytest.raises(KernelError, match="dtype"):
        kernels.decode(q.double(), cache, tables, lens, 0.125)


# the fused small ops, against the torch path they replace (which rounds at the same points)
CLOSE = {torch.float32: {"atol": 1e-6, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-30, "rtol": 8e-3}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300: rows spread over threads (see `split`)
def test_rms_norm_and_add_match_the_torch_path(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.rand(96, generator=gen).to(dtype) + 0.5
    x = (3 * torch.randn(rows, 96, generator=gen)).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    kernels = load_cpu_kernels()
    torch.testing.assert_close(norm(x, kernels), norm(x), **CLOSE[dtype])
    expected, expected_sum = norm.add_and_norm(x, residual)  # the torch path: out of place
    fused, fused_sum = norm.add_and_norm(x, residual.clone(), kernels)
    assert torch.equal(fused_sum, expected_sum)  # one rounded add, as torch's
    torch.testing.assert_close(fused, expected, **CLOSE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [7, 300])  # 300: rows spread over threads
def test_silu_and_mul_matches_the_torch_path(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(rows, 2 * 40, generator=gen)).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps, both ways
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(load_cpu_kernels().silu_and_mul(x), expected, **CLOSE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [9, 200])  # 200: tokens spread over threads
def test_rotary_matches_the_torch_path(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 4, 2, 32
    fused = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    config = PretrainedConfig(rope_theta=10000.0)
    rope = RotaryEmbedding(config, dim, 128).lookup(positions, dtype)
    expected = fused.clone()
    apply_rope_(rope, expected[:, : heads + kv_heads])
    load_cpu_kernels().rotary_(fused[:, : heads + kv_heads], *rope)
    torch.testing.assert_close(fused, expected, **CLOSE[dtype])
    assert torch.equal(fused[:, heads + kv_heads :], expected[:, heads + kv_heads :])  # v


@pytest.mark.parametrize("shape", [(32, 4096), (3, 37), (1, 16)])
def test_greedy_pick_matches_argmax_and_log_softmax(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(*shape, generator=gen)
    logits[0, 2] = logits[0, shape[1] - 1] = logits[0].max() + 1  # a tie: the first index wins
    tokens, logprobs = load_cpu_kernels().greedy(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)
    with pytest.raises(KernelError, match="float32"):
        load_cpu_kernels().greedy(logits.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "n", "k", "bias"),
    [
        (1, 8, 16, False),  # one row, whole tiles
        (7, 13, 259, True),  # an odd row left over, a partial weight tile, a tail of K
        (32, 64, 768, False),  # a full decode batch
        (3, 1, 5, True),  # K shorter than a vector
        (300, 9, 768, True),  # a prefill: rows in three blocks
    ],
)
def test_linear_matches_float64_reference(
    dtype: torch.dtype, rows: int, n: int, k: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = load_cpu_kernels().linear(x, weight, b)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    tolerance = (
        {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 1e-2}
    )
    assert out.dtype == dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, **tolerance)


def test_linear_in_vectors_of_16_matches_on_any_cpu(tmp_path: Path) -> None:
    """The AVX-512 width (16 floats a vector) built here whatever this CPU has: gcc splits
    the vectors where it must; the reduction of 16 lanes must still give the dot products."""
    library = tmp_path / "lanes16.so"
    compiler = shutil.which("g++") or "c++"
    command = [
        compiler,
        *FLAGS,
        "-DRUNTIME_LINEAR_LANES=16",
        *map(str, SOURCES),
        "-o",
        str(library),
    ]
    subprocess.run(command, check=True, capture_output=True)
    x, weight, bias = torch.randn(7, 301), torch.randn(13, 301), torch.randn(13)
    out = CpuKernels(library).linear(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


def test_decode_rows_stream_and_float32_prefills_go_to_blas() -> None:
    rows_streamed = []

    def streamed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        rows_streamed.append(x.shape[0])
        return load_cpu_kernels().linear(x, w, b)

    layer = Linear(64, 32, bias=True)
    layer.pack_for_cpu(None)
    assert layer.packed is None  # without the CPU kernels float32 stays torch's reference
    layer.pack_for_cpu(streamed)
    # float32 is packed for oneDNN wherever torch has it: then only the smallest steps stream
    streams_up_to = STREAMED_ROWS if layer.packed is None else PACKED_STREAMED_ROWS
    with torch.no_grad():
        for rows in (1, PACKED_STREAMED_ROWS + 1, STREAMED_ROWS, STREAMED_ROWS + 1):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        sizes = [1, PACKED_STREAMED_ROWS + 1, STREAMED_ROWS]
        assert rows_streamed == [r for r in sizes if r <= streams_up_to]
        rows_streamed.clear()
        layer.to(torch.bfloat16).pack_for_cpu(streamed)
        for rows in (1, STREAMED_ROWS + 1):
            layer(torch.randn(rows, 64, dtype=torch.bfloat16))
    # bf16 prefills too, unless oneDNN took the weight (it has a bf16 path on this CPU): then
    # only the smallest steps
    assert rows_streamed == ([1] if layer.packed is not None else [1, STREAMED_ROWS + 1])


def test_float32_is_packed_only_while_the_copies_fit_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = torch.nn.Sequential(Linear(64, 32), Linear(32, 64))
    streamed = load_cpu_kernels().linear
    weight_bytes = (64 * 32 + 32 * 64) * 4
    monkeypatch.setattr(basic, "available_memory", lambda: 2 * weight_bytes - 1)
    basic.pack_linears_for_cpu(model, streamed)
    assert all(m.packed is None for m in model)  # a second copy would take over half
    monkeypatch.setattr(basic, "available_memory", lambda: 2 * weight_bytes)
    basic.pack_linears_for_cpu(model, streamed)
    if not torch.backends.mkldnn.is_available():
        return
    assert all(m.packed is not None for m in model)
    # packed once, it stays packed through repacks (a weight update), whatever is left now
    monkeypatch.setattr(basic, "available_memory", lambda: 0)
    basic.pack_linears_for_cpu(model, streamed)
    assert all(m.packed is not None for m in model)


def test_linear_is_the_same_on_one_thread_and_two() -> None:
    x, weight = torch.randn(5, 300), torch.randn(70, 300)
    kernels = load_cpu_kernels()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear(x, weight)
        torch.set_num_threads(2)
        two = kernels.linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output is one thread's dot product


@pytest.mark.parametrize(("vocab", "threads"), [(300, 1), (32000, 2)])
def test_sampling_draws_the_torch_samplers_tokens(vocab: int, threads: int) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)  # rows are spread over the threads
        check_sampling_draws(load_cpu_kernels(), torch.device("cpu"), vocab, draws=6)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("scale", [0.1, 30.0])  # near-uniform: a few big bins; peaked
def test_sampling_over_a_flat_or_a_peaked_row(scale: float) -> None:
    check_sampling_draws(load_cpu_kernels(), torch.device("cpu"), 4096, draws=4, scale=scale)


def test_sampling_reads_rows_a_stride_apart() -> None:
    wide = 3 * torch.randn(6, 700, generator=torch.Generator().manual_seed(5))
    logits = wide[:, :500]  # rows 700 apart, as a slice of a wider buffer leaves them
    b = make_sampling_batch([(1.0, 0, 0.9, 0.0, seed, 0) for seed in range(6)], torch.device("cpu"))
    expected, _ = choose(logits.contiguous(), b)
    tokens = load_cpu_kernels().sample(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.uniforms)
    assert tokens.tolist() == expected.tolist()


def test_sampling_a_row_of_nans_or_infinities_picks_a_token_in_range() -> None:
    """A model that overflowed must not take the worker down with it."""
    logits = torch.randn(4, 500)
    logits[0, 7] = torch.nan
    logits[1] = torch.nan
    logits[2, 3] = torch.inf
    logits[3] = -torch.inf
    b = make_sampling_batch([(1.0, 5, 0.9, 0.1, seed, 0) for seed in range(4)], torch.device("cpu"))
    tokens = load_cpu_kernels().sample(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.uniforms)
    assert all(0 <= t < 500 for t in tokens.tolist())


@pytest.mark.parametrize(("params", "tail", "allowed"), TIE_CASES)
def test_sampling_among_equal_probabilities_follows_the_stable_order(
    params: tuple[float, int, float, float], tail: bool, allowed: range
) -> None:
    check_sampling_among_ties(load_cpu_kernels(), torch.device("cpu"), params, tail, allowed)


def test_the_plain_loops_build_and_match_without_avx512(tmp_path: Path) -> None:
    """CPUs without AVX-512 (AMD before Zen 4, among others) compile only the plain loops;
    built so here whatever this CPU has, they must compile, load and agree."""
    library = tmp_path / "plain.so"
    compiler = shutil.which("g++") or "c++"
    command = [compiler, *FLAGS, "-mno-avx512f", *map(str, SOURCES), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True)
    q, cache, tables, lens = random_case(5, 12, 4, 64, 16, 200, torch.bfloat16)
    poison_past_the_end(cache, tables, lens)
    out = CpuKernels(library).decode(q, cache, tables, lens, 0.125)
    expected = reference(q, cache, tables, lens, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
