"""Paged attention, on the torch path and on the compiled CPU kernels, against plain dense
causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.cpu import KernelError, load_cpu_kernels
from runtime.layers.attention import (
    AttentionMetadata,
    PrefillSlice,
    causal_mask,
    gather_rows,
    paged_attention,
)

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 8, 4, 64


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """Causal attention of the last n queries over the whole sequence (q, k, v: [L, h, D])."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return out.transpose(0, 1)[-n:]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_dense_attention(dtype: torch.dtype, backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    # (already cached tokens, new tokens) per sequence: decodes, a fresh prefill, a chunk
    layout = [(7, 1), (12, 1), (0, 1), (0, 9), (5, 6)]
    full = [
        torch.randn(c + n, HEADS + 2 * KV_HEADS, DIM, generator=gen).to(dtype) for c, n in layout
    ]  # q, k and v heads of every position, as the fused projection lays them out
    cache = torch.zeros(2, KV_HEADS, NUM_BLOCKS, BLOCK, DIM, dtype=dtype)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = []
    for (c, n), heads in zip(layout, full, strict=True):
        table = [free.pop() for _ in range(-(-(c + n) // BLOCK))]
        tables.append(table)
        for p in range(c):  # the cached context is already in the cache
            cache[0, :, table[p // BLOCK], p % BLOCK] = heads[p, HEADS : HEADS + KV_HEADS]
            cache[1, :, table[p // BLOCK], p % BLOCK] = heads[p, HEADS + KV_HEADS :]
    step = torch.cat([heads[c:] for (c, _), heads in zip(layout, full, strict=True)])
    slots = [
        tables[i][p // BLOCK] * BLOCK + p % BLOCK
        for i, (c, n) in enumerate(layout)
        for p in range(c, c + n)
    ]
    width = max(len(t) for t in tables[:3])
    decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables[:3]])
    lens = torch.tensor([c + n for c, n in layout[:3]])
    padding = torch.arange(width * BLOCK)[None, :] >= lens[:, None]
    bias = torch.zeros(padding.shape, dtype=dtype).masked_fill(padding, -torch.inf)
    if backend == "torch":
        layout_args = {
            "decode_rows": gather_rows(decode_tables, KV_HEADS, NUM_BLOCKS),
            "decode_bias": bias.repeat_interleave(KV_HEADS, dim=0).unsqueeze(1),
        }
    else:
        layout_args = {
            "kernels": load_cpu_kernels(),
            "decode_tables": decode_tables,
            "decode_lens": lens,
        }
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=3,
        **layout_args,
        prefills=[
            PrefillSlice(3, 9, 9, None, None),
            PrefillSlice(
                12,
                6,
                11,
                gather_rows(torch.tensor(tables[4]), KV_HEADS, NUM_BLOCKS),
                causal_mask(6, 11, step.device, step.dtype),
            ),
        ],
    )
    out = paged_attention(step, HEADS, cache, meta, scale=DIM**-0.5)
    expected = torch.cat(
        [
            dense(h[:, :HEADS], h[:, HEADS : HEADS + KV_HEADS], h[:, HEADS + KV_HEADS :], n)
            for (_, n), h in zip(layout, full, strict=True)
        ]
    )
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, expected, **tolerance)


def decode_case(
    dtype: torch.dtype, dim: int, lens: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [rows, HEADS, dim], a cache, block tables and lengths of decode rows."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // BLOCK)
    q = torch.randn(len(lens), HEADS, dim, generator=gen).to(dtype)
    num_blocks = len(lens) * width
    cache = torch.randn(2, KV_HEADS, num_blocks, BLOCK, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(len(lens), width)
    return q, cache, tables, torch.tensor(lens)


TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.mark.parametrize("dim", [8, 64])  # plain loops; AVX-512 (and AVX512-BF16) where present
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_longer_than_a_chunk_match_dense_attention(
    dtype: torch.dtype, dim: int
) -> None:
    """A row decoding alone (few kv heads to share) goes in chunks of 64 tokens whose softmax
    parts are merged (cpu_attention.cpp): lengths on both sides of a chunk's edge, and several
    chunks. The same rows as one batch keep whole heads."""
    lens = [1, 63, 64, 65, 200]
    q, cache, tables, context = decode_case(dtype, dim, lens, seed=4)
    kernels = load_cpu_kernels()
    together = kernels.decode(q, cache, tables, context, dim**-0.5)
    for row, n in enumerate(lens):
        keys = cache[:, :, tables[row]].flatten(2, 3)[:, :, :n].float()  # [2, kv, n, dim]
        expected = F.scaled_dot_product_attention(
            q[row].float()[:, None], keys[0], keys[1], enable_gqa=True
        )[:, 0]
        alone = kernels.decode(
            q[row : row + 1], cache, tables[row : row + 1], context[row : row + 1], dim**-0.5
        )[0]
        torch.testing.assert_close(alone.float(), expected, **TOLERANCE[dtype])
        torch.testing.assert_close(together[row].float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_items_computed_apart_make_the_same_output(dtype: torch.dtype) -> None:
    """How cpu_team.h's threads share a decode step's attention: each its own range of items
    (a row's kv head over a chunk of its tokens) into their partials, merged afterwards;
    together the same bits as one call, and a range past the rows' items is refused."""
    kernels = load_cpu_kernels()
    lens = [3, 130, 9]  # items: 2 kv heads x (1, 3, 1) chunks
    q, cache, tables, context = decode_case(dtype, DIM, lens, seed=1)
    rows, width = tables.shape
    whole = kernels.decode(q, cache, tables, context, 0.3)
    counts = torch.zeros(2, dtype=torch.long)
    kernels._call("paged_decode_partials", context.data_ptr(), rows, HEADS, KV_HEADS, DIM,
                  counts.data_ptr())  # fmt: skip
    items = int(counts[0])
    assert items == KV_HEADS * 5
    partials = torch.full((int(counts[1]),), float("nan"))
    code = 0 if dtype == torch.float32 else 1

    def compute(first: int, end: int) -> None:
        kernels._call(
            "paged_decode_items", code, out.data_ptr(), partials.data_ptr(),
            q.data_ptr(), q.stride(0), cache.data_ptr(), tables.data_ptr(), width,
            context.data_ptr(), rows, HEADS, KV_HEADS, cache.shape[2], BLOCK, DIM, 0.3, 1,
            first, end,
        )  # fmt: skip

    out = torch.full_like(whole, float("nan"))
    for first, end in ((0, 1), (1, 1), (1, 4), (4, 7), (7, items)):
        compute(first, end)
    kernels._call("paged_decode_merge", code, out.data_ptr(), partials.data_ptr(),
                  context.data_ptr(), rows, HEADS, KV_HEADS, DIM, 1)  # fmt: skip
    assert torch.equal(out, whole)
    with pytest.raises(KernelError, match="items outside"):
        compute(0, items + 1)
