"""GGUF blocks repacked for decode steps (cpu_repacked.cpp): the products against the
dequantize-then-matmul reference and against the file layout's kernel (its 1- and 2-thread
equality is in tests/test_quant_kernels.py, beside the other kernel's), what it refuses, and a
quantized Linear that holds a repacked copy (only while the copies fit in memory). The AVX2
and plain-loop builds' repacked products are checked in tests/test_quant_kernels.py, beside
their other kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.cpu import KernelError, load_cpu_kernels
from runtime.kernels.quant_formats import FORMATS, dequantize, quantize
from runtime.layers import basic
from runtime.layers.basic import KIND_BLOCKS, KIND_REPACKED, Linear
from runtime.layers.quantized import QUANT_ROWS
from tests.quant_cases import NAMES, REPACKED_SHAPES, check_repacked, reference


def repackable(name: str) -> None:
    if name not in load_cpu_kernels().repacked_formats:
        pytest.skip(f"this build does not repack {name} (no VNNI for Q8_0's unsigned bytes)")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("rows", "n", "k", "bias"), REPACKED_SHAPES)
def test_repacked_kernel_matches_the_reference(
    name: str, rows: int, n: int, k: int, bias: bool
) -> None:
    repackable(name)
    check_repacked(load_cpu_kernels(), name, rows, n, k, bias)


def test_what_does_not_repack_is_refused() -> None:
    kernels, fmt = load_cpu_kernels(), FORMATS["Q4_0"]
    rows = kernels.repacked_rows
    with pytest.raises(KernelError, match="multiple of the rows"):
        kernels.repack_blocks(quantize(torch.randn(rows + 1, 64), "Q4_0"), fmt)
    repacked = kernels.repack_blocks(quantize(torch.randn(rows, 64), "Q4_0"), fmt)
    with pytest.raises(KernelError):
        kernels.repacked_linear(torch.randn(1, 96), repacked, fmt)  # K 96 against rows of 64
    with pytest.raises(KernelError):
        kernels.repacked_linear(torch.randn(1, 64), repacked, FORMATS["Q4_1"])  # another format


@pytest.mark.parametrize("rows", [1, 3])
def test_groups_multiplied_apart_make_the_same_product(rows: int) -> None:
    """How cpu_team.h's two threads share a decode step's product: each its own range of
    groups, x quantized by each for itself; together the same bits as one call."""
    kernels, fmt = load_cpu_kernels(), FORMATS["Q4_1"]
    groups, k = 5, 128
    n = groups * kernels.repacked_rows
    torch.manual_seed(0)
    repacked = kernels.repack_blocks(quantize(torch.randn(n, k), "Q4_1"), fmt)
    x, bias = torch.randn(rows, k), torch.randn(n)
    whole = kernels.repacked_linear(x, repacked, fmt, bias)
    out = torch.full_like(whole, float("nan"))
    for first, end in ((0, 2), (2, 2), (2, groups)):
        kernels._call("repacked_groups", fmt.code, out.data_ptr(), x.data_ptr(),
                      repacked.data_ptr(), bias.data_ptr(), rows, n, k, first, end)  # fmt: skip
    assert torch.equal(out, whole)
    with pytest.raises(KernelError, match="groups outside"):
        kernels._call("repacked_groups", fmt.code, out.data_ptr(), x.data_ptr(),
                      repacked.data_ptr(), 0, rows, n, k, 0, groups + 1)  # fmt: skip


def quantized_layer(name: str, n: int, k: int = 128) -> Linear:
    layer = Linear(k, n, bias=True)
    float_weight = layer.weight.detach().clone()
    layer.quantize_(FORMATS[name])
    layer.weight.data.copy_(quantize(float_weight, name))
    return layer


@pytest.mark.parametrize("name", NAMES)
def test_a_layer_multiplies_decode_rows_from_its_repacked_copy(name: str) -> None:
    repackable(name)
    kernels, fmt = load_cpu_kernels(), FORMATS[name]
    layer = quantized_layer(name, 3 * kernels.repacked_rows)
    blocks = layer.weight.data
    w = dequantize(blocks, name)
    with torch.no_grad():
        layer.pack_for_cpu(quant_kernels=kernels)
        assert layer.repacked is not None
        assert torch.equal(layer.repacked, kernels.repack_blocks(blocks, fmt))
        assert layer.decode_spec(torch.float32).kind == KIND_REPACKED  # type: ignore[union-attr]
        for rows in (1, QUANT_ROWS):
            x = torch.randn(rows, 128)
            got = layer(x)
            assert torch.equal(got, kernels.repacked_linear(x, layer.repacked, fmt, layer.bias))
            expected = reference(x, blocks, name, layer.bias).float()
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        x = torch.randn(QUANT_ROWS + 1, 128)  # a prefill: BLAS on the file's blocks
        torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias))
        layer.pack_for_cpu(quant_kernels=kernels, repack=False)  # the file's layout
        assert layer.repacked is None
        assert layer.decode_spec(torch.float32).kind == KIND_BLOCKS  # type: ignore[union-attr]
        x = torch.randn(2, 128)
        assert torch.equal(layer(x), kernels.quant_linear(x, blocks, fmt, layer.bias))


def test_rows_that_make_no_whole_group_keep_the_files_layout() -> None:
    kernels = load_cpu_kernels()
    layer = quantized_layer("Q4_1", kernels.repacked_rows + 4)
    layer.pack_for_cpu(quant_kernels=kernels)
    assert layer.repacked is None
    x = torch.randn(1, 128)
    with torch.no_grad():
        expected = kernels.quant_linear(x, layer.weight.data, FORMATS["Q4_1"], layer.bias)
        assert torch.equal(layer(x), expected)


def test_blocks_are_repacked_only_while_the_copies_fit_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernels = load_cpu_kernels()
    model = torch.nn.Sequential(quantized_layer("Q4_1", 32), quantized_layer("Q4_0", 16))
    block_bytes = sum(m.weight.numel() for m in model)
    monkeypatch.setattr(basic, "available_memory", lambda: 2 * block_bytes - 1)
    basic.pack_linears_for_cpu(model, quant_kernels=kernels)
    assert all(m.repacked is None for m in model)  # a second copy would take over half
    monkeypatch.setattr(basic, "available_memory", lambda: 2 * block_bytes)
    basic.pack_linears_for_cpu(model, quant_kernels=kernels)
    assert all(m.repacked is not None for m in model)
    # repacked once, they stay so through packing again (a weight update), whatever is left
    monkeypatch.setattr(basic, "available_memory", lambda: 0)
    basic.pack_linears_for_cpu(model, quant_kernels=kernels)
    assert all(m.repacked is not None for m in model)


def test_packing_again_repacks_the_blocks_as_they_now_are() -> None:
    """What a weight update does (ServedWeights.install packs the model again): the decode
    rows must see the new blocks, not the copy of the old ones."""
    kernels, fmt = load_cpu_kernels(), FORMATS["Q4_1"]
    model = torch.nn.Sequential(quantized_layer("Q4_1", 32))
    basic.pack_linears_for_cpu(model, quant_kernels=kernels)
    layer, x = model[0], torch.randn(1, 128)
    layer.weight.data.copy_(quantize(torch.randn(32, 128), "Q4_1"))
    basic.pack_linears_for_cpu(model, quant_kernels=kernels)
    with torch.no_grad():
        expected = kernels.quant_linear(x, layer.weight.data, fmt, layer.bias)
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
