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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_items_computed_apart_make_the_same_output(dtype: torch.dtype) -> None:
    """How cpu_team.h's threads share a decode step's attention: each its own range of
    (row, kv head) items; together the same bits as one call, and a range past the rows'
    heads is refused."""
    kernels, gen = load_cpu_kernels(), torch.Generator().manual_seed(1)
    rows, width = 3, 4
    q = torch.randn(rows, HEADS, DIM, generator=gen).to(dtype)
    cache = torch.randn(2, KV_HEADS, NUM_BLOCKS, BLOCK, DIM, generator=gen).to(dtype)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[: rows * width].view(rows, width)
    lens = torch.tensor([3, 16, 9])
    whole = kernels.decode(q, cache, tables, lens, 0.3)
    out = torch.full_like(whole, float("nan"))

    def items(first: int, end: int) -> None:
        kernels._call(
            "paged_decode_items", 0 if dtype == torch.float32 else 1, out.data_ptr(),
            q.data_ptr(), q.stride(0), cache.data_ptr(), tables.data_ptr(), width,
            lens.data_ptr(), rows, HEADS, KV_HEADS, NUM_BLOCKS, BLOCK, DIM, 0.3, 1, first, end,
        )  # fmt: skip

    for first, end in ((0, 1), (1, 1), (1, 4), (4, rows * KV_HEADS)):
        items(first, end)
    assert torch.equal(out, whole)
    with pytest.raises(KernelError, match="items outside"):
        items(0, rows * KV_HEADS + 1)
