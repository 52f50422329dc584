"""The Triton kernels against float64 references and the torch path they replace: on CUDA
where there is one, else in Triton's interpreter on the CPU (tests/conftest.py sets
TRITON_INTERPRET=1). Odd head dims, block sizes that do and do not divide the loops' tiles,
grouped heads, contexts long enough to split, cached prefixes, padding rows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from runtime.kernels.gpu import TritonKernels, decode_splits
from runtime.layers.basic import RMSNorm
from runtime.layers.rotary import RotaryEmbedding, apply_rope_
from tests.kernel_cases import (
    TIE_CASES,
    check_sampling_among_ties,
    check_sampling_draws,
    extend_reference,
    poison_past_the_end,
    random_case,
    reference,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS = TritonKernels()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATTENTION_CLOSE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "longest"),
    [
        (12, 4, 64, 16, 200),  # a group of 3, padded to tl.dot's 16 rows
        (4, 2, 128, 16, 33),  # the last loop tile holds one token
        (6, 2, 48, 8, 600),  # head_dim not a power of two; two splits
        (2, 1, 16, 4, 9),
        (4, 2, 8, 8, 30),  # head_dim under tl.dot's 16
        (8, 8, 32, 32, 70),  # no grouping; blocks larger than a loop tile
    ],
)
def test_decode_matches_float64_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int, longest: int
) -> None:
    q, cache, tables, lens = random_case(5, heads, kv_heads, dim, block_size, longest, dtype)
    poison_past_the_end(cache, tables, lens)
    scale = dim**-0.5
    expected = reference(q, cache, tables, lens, scale)
    q, cache, tables, lens = on_device(q, cache, tables, lens)
    out = KERNELS.decode(q, cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu().double(), expected, **ATTENTION_CLOSE[dtype])


def test_decode_padding_rows_give_zeros() -> None:
    """CUDA graphs pad a batch up to its bucket with rows of length 0."""
    q, cache, tables, lens = random_case(3, 4, 2, 32, 16, 40, torch.float32)
    lens[1] = 0
    expected = reference(q, cache, tables, lens, 0.2)
    out = KERNELS.decode(*on_device(q, cache, tables, lens), 0.2).cpu()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(
        out[[0, 2]].double(), expected[[0, 2]], **ATTENTION_CLOSE[torch.float32]
    )


@pytest.mark.parametrize(
    ("longest", "splits"), [(1, 1), (255, 1), (600, 2), (5000, 16), (10**6, 16)]
)
def test_decode_splits_grow_with_the_context(longest: int, splits: int) -> None:
    assert decode_splits(longest) == splits


def test_a_short_context_in_a_wide_batch_spreads_over_the_splits() -> None:
    """A CUDA graph sizes the splits for max_model_len: each sequence divides its own
    length, so a short one is right too (and a length that does not divide evenly)."""
    q, cache, tables, lens = random_case(3, 4, 2, 32, 16, 40, torch.float32)
    wide = torch.cat([tables, tables.new_zeros(3, 300)], dim=1)  # 5,000+ tokens: 16 splits
    lens[:] = torch.tensor([40, 1, 33])
    expected = reference(q, cache, tables, lens, 0.2)
    out = KERNELS.decode(*on_device(q, cache, wide, lens), 0.2).cpu()
    torch.testing.assert_close(out.double(), expected, **ATTENTION_CLOSE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "long_chunks"),
    [(4, 2, 32, 16, False), (6, 3, 24, 8, False), (4, 1, 32, 16, True)],
)
def test_extend_matches_float64_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, block_size: int, long_chunks: bool
) -> None:
    # (queries, context): a whole prompt; a chunk after a cached prefix; two query blocks
    # over a prefix; one query (a fully cached prompt's last token)
    shapes = [(5, 5), (3, 40), (20, 53), (1, 17)]
    if long_chunks:  # 64 queries a program: one chunk in two programs, past a cached prefix
        shapes = [(70, 90), (64, 64), (5, 5)]
    q_lens = torch.tensor([n for n, _ in shapes])
    context_lens = torch.tensor([c for _, c in shapes])
    longest = max(c for _, c in shapes)
    _, cache, tables, _ = random_case(len(shapes), heads, kv_heads, dim, block_size, longest, dtype)
    poison_past_the_end(cache, tables, context_lens)
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(int(q_lens.sum()), heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    q = fused[:, :heads]
    q_starts = torch.cumsum(q_lens, 0) - q_lens
    scale = dim**-0.5
    expected = extend_reference(q, cache, tables, q_lens, context_lens, scale)
    args = on_device(q, cache, tables, q_starts, q_lens, context_lens)
    out = KERNELS.extend(*args, int(q_lens.max()), scale)
    torch.testing.assert_close(out.cpu().double(), expected, **ATTENTION_CLOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_each_head_to_its_slot(dtype: torch.dtype) -> None:
    cache = torch.zeros(2, 2, 6, 4, 8, dtype=dtype, device=DEVICE)
    fused = torch.randn(4, 2 + 4, 8).to(dtype=dtype, device=DEVICE)  # q heads, then K, V
    kv = fused[:, 2:]
    slots = torch.tensor([5, 0, -1, 23], device=DEVICE)  # -1: a padding row
    KERNELS.store_kv(cache, kv, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, 4)
            assert torch.equal(cache[0, :, block, offset], kv[t, :2])
            assert torch.equal(cache[1, :, block, offset], kv[t, 2:])
    assert int((cache != 0).any(-1).sum()) == 3 * 4  # nothing else was written


# the fused small ops, against the torch path they replace (which rounds at the same points)
CLOSE = {
    torch.float32: {"atol": 1e-6, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-30, "rtol": 8e-3},
    torch.float16: {"atol": 1e-5, "rtol": 1e-3},
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_add_match_the_torch_path(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.rand(96, generator=gen).to(dtype) + 0.5
    x = (3 * torch.randn(5, 96, generator=gen)).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    expected, expected_sum = norm.add_and_norm(x, residual)
    plain = norm(x)
    norm.to(DEVICE)
    x, residual = on_device(x, residual)
    torch.testing.assert_close(norm(x, KERNELS).cpu(), plain, **CLOSE[dtype])
    fused, fused_sum = norm.add_and_norm(x, residual, KERNELS)
    assert torch.equal(fused_sum.cpu(), expected_sum)  # one rounded add, as torch's
    torch.testing.assert_close(fused.cpu(), expected, **CLOSE[dtype])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(100): inf, as meant
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_torch_path(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(7, 2 * 40, generator=gen)).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's extremes, both ways
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = KERNELS.silu_and_mul(x.to(DEVICE)).cpu()
    torch.testing.assert_close(out, expected, **CLOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_torch_path(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, tokens = 4, 2, 24, 9
    fused = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    rope = RotaryEmbedding(PretrainedConfig(rope_theta=10000.0), dim, 128).lookup(positions, dtype)
    expected = fused.clone()
    apply_rope_(rope, expected[:, : heads + kv_heads])
    fused, cos, sin = on_device(fused, *rope)
    KERNELS.rotary_(fused[:, : heads + kv_heads], cos, sin)
    torch.testing.assert_close(fused.cpu(), expected, **CLOSE[dtype])
    assert torch.equal(fused[:, heads + kv_heads :].cpu(), expected[:, heads + kv_heads :])


def test_greedy_matches_argmax_and_log_softmax() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(6, 300, generator=gen)
    tokens, logprobs = KERNELS.greedy(logits.to(DEVICE))
    assert torch.equal(tokens.cpu(), logits.argmax(dim=-1))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, tokens.cpu()[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs.cpu(), expected)


@pytest.mark.parametrize("vocab", [300, 5000])  # 5000: a row in two loop blocks
def test_sampling_draws_the_torch_samplers_tokens(vocab: int) -> None:
    check_sampling_draws(KERNELS, DEVICE, vocab)


@pytest.mark.parametrize(("params", "tail", "allowed"), TIE_CASES)
def test_sampling_among_equal_probabilities_follows_the_stable_order(
    params: tuple[float, int, float, float], tail: bool, allowed: range
) -> None:
    check_sampling_among_ties(KERNELS, DEVICE, params, tail, allowed)


def test_every_kernel_compiles_for_a_hopper_gpu() -> None:
    """The interpreter runs kernels the compiler would reject (it is Python on numpy):
    lower every one to a cubin for sm_90 with the ptxas Triton ships; no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tools.compile_triton_kernels", "--arch", "90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "40 of 40 kernels compiled for sm_90" in done.stdout
