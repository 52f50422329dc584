"""Cases shared by the CPU and GPU kernel tests: random paged-attention cases and float64
references (decode and extend); sampling against the torch sampler."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels.cpu import CpuKernels
from runtime.kernels.select import SamplingKernels
from runtime.worker.sampler import choose, make_sampling_batch


def reference(q, cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """q [B, H, D]; cache [2, KV, blocks, bs, D]: attention in float64, one sequence at a time."""
    batch, heads, dim = q.shape
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        blocks = tables[b, : -(-n // block_size)]
        k, v = (cache[i][:, blocks].reshape(kv_heads, -1, dim)[:, :n].double() for i in (0, 1))
        grouped = q[b].double().view(kv_heads, heads // kv_heads, dim)
        probs = torch.softmax(grouped @ k.transpose(1, 2) * scale, dim=-1)
        out[b] = (probs @ v).reshape(heads, dim)
    return out


def extend_reference(q, cache, tables, q_lens, context_lens, scale):  # type: ignore[no-untyped-def]
    """Each sequence's queries (the last q_len of its context) over its cached tokens, causal."""
    heads, dim = q.shape[1:]
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for table, n, ctx in zip(tables, q_lens.tolist(), context_lens.tolist(), strict=True):
        blocks = table[: -(-ctx // block_size)]
        k, v = (cache[i][:, blocks].reshape(kv_heads, -1, dim)[:, :ctx].double() for i in (0, 1))
        k, v = (t.repeat_interleave(heads // kv_heads, dim=0) for t in (k, v))
        scores = q[start : start + n].double().transpose(0, 1) @ k.transpose(1, 2) * scale
        hidden = torch.ones(n, ctx, dtype=torch.bool).triu(ctx - n + 1)
        probs = torch.softmax(scores.masked_fill(hidden, -torch.inf), dim=-1)
        out[start : start + n] = (probs @ v).transpose(0, 1)
        start += n
    return out


def random_case(
    batch: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    longest: int,
    dtype: torch.dtype,
    seed: int = 0,
):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    num_blocks = batch * -(-longest // block_size) + 3
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    width = -(-longest // block_size)
    order = torch.randperm(num_blocks, generator=gen)  # each sequence owns scattered blocks
    tables = order[: batch * width].view(batch, width).clone()
    lens = torch.randint(1, longest + 1, (batch,), generator=gen)
    lens[0] = longest
    # q inside a fused [B, heads + 2 * kv_heads, D] projection, as the model passes it
    fused = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    return fused[:, :heads], cache, tables, lens


def poison_past_the_end(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
    """NaN in the slots of each sequence's last block past its length: a kernel that reads
    them (even with a zero weight) returns NaN."""
    block_size = cache.shape[3]
    for table, n in zip(tables.tolist(), lens.tolist(), strict=True):
        cache[:, :, table[(n - 1) // block_size], (n - 1) % block_size + 1 :] = torch.nan


# (temperature, top_k, top_p, min_p) per row: greedy, plain temperature, each filter, and all
SAMPLING_ROWS = [
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.9, 40, 0.9, 0.02),
    (2.0, 1, 1.0, 0.0),  # top-k 1: the greedy token
    (1.0, 0, 0.05, 0.0),  # top-p below the top token's share: the greedy token
]


def check_sampling_draws(
    kernels: SamplingKernels, device: torch.device, vocab: int, draws: int = 2, scale: float = 3
) -> None:
    """The kernel draws what the torch sampler draws, each row with `draws` seeds."""
    gen = torch.Generator().manual_seed(vocab)
    rows = [(*params, seed, 0) for params in SAMPLING_ROWS for seed in range(draws)]
    logits = scale * torch.randn(len(rows), vocab, generator=gen)
    logits[1 * draws, 7] = -torch.inf  # a token a logits processor masked
    batch = make_sampling_batch(rows, torch.device("cpu"))
    expected, _ = choose(logits, batch)
    b = make_sampling_batch(rows, device)
    tokens = kernels.sample(
        logits.to(device), b.temperature, b.top_k, b.top_p, b.min_p, b.uniforms
    ).cpu()
    assert tokens.tolist() == expected.tolist()
    assert len(set(tokens[draws : 2 * draws].tolist())) > 1  # the seeds draw different tokens


TIE_CASES = [
    ((1.0, 0, 1.0, 0.0), True, range(6)),  # each of six equal tokens gets drawn
    ((1.0, 4, 1.0, 0.0), True, range(4)),  # top-k cuts through the tie: the first four
    ((1.0, 0, 0.5, 0.0), False, range(3)),  # top-p: half the mass ends after three
    ((1.0, 0, 0.5, 0.0), True, range(4)),  # ... and a tiny tail makes the fourth fit
]


def check_sampling_among_ties(
    kernels: SamplingKernels,
    device: torch.device,
    params: tuple[float, int, float, float],
    tail: bool,
    allowed: range,
) -> None:
    """bf16 logits tie often. The torch sampler sorts stably (ties by index); the kernel
    must draw each tied token where the sort would, not always the first."""
    vocab = 40
    logits = torch.full((1, vocab), -20.0 if tail else -torch.inf)
    logits[0, 3:9] = 5.0  # tokens 3..8, equal
    rows = [(*params, seed, 0) for seed in range(12)]
    logits = logits.expand(len(rows), vocab).contiguous()
    expected, _ = choose(logits, make_sampling_batch(rows, torch.device("cpu")))
    b = make_sampling_batch(rows, device)
    tokens = kernels.sample(
        logits.to(device), b.temperature, b.top_k, b.top_p, b.min_p, b.uniforms
    ).cpu()
    assert tokens.tolist() == expected.tolist()
    assert set(tokens.tolist()) == {3 + i for i in allowed}  # every kept tie, no other


# linears against panels (runtime/kernels/cpu_panels.cpp): tests/test_cpu_panels.py, and the
# AVX2 build in tests/test_quant_kernels.py
PANEL_TOLERANCE = {
    torch.float32: {"atol": 1e-3, "rtol": 1e-5},  # sums of up to 4096 products near 64
    torch.bfloat16: {"atol": 0.05, "rtol": 1e-2},
}


def check_panel_linear(
    panel_kernels: CpuKernels, dtype: torch.dtype, rows: int, n: int, k: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    x, weight = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((rows, k), (n, k)))
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = panel_kernels.panel_linear(x, panel_kernels.pack_panels(weight), n, b)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.dtype == dtype and out.shape == (rows, n)
    # bfloat16 products are exact in float32; the sums round as float32, the result once
    torch.testing.assert_close(out.double(), expected, **PANEL_TOLERANCE[dtype])


PANEL_SHAPES = [
    (1, 32, 2, False),  # one row, one panel, one pair of k
    (5, 45, 64, True),  # a panel cut short at column 45 (and one of its vectors empty)
    (12, 100, 130, True),  # a full group of 12 rows
    (32, 576, 576, False),  # a decode batch of SmolLM2's shape: groups of 10, 11, 11
    (13, 17, 96, True),  # fewer columns than one vector
    (150, 64, 4096, True),  # a prefill in several blocks of rows (64 bf16 rows fill 512 KB)
]
