"""GGUF's Q8_0, Q4_0 and Q4_1 blocks: our torch quantize/dequantize against gguf-py's, bit for
bit; the kernel's products (cpu_quant.cpp) against a dequantize-then-matmul reference in
float64, for each block type, odd shapes (a partial tile, an odd number of blocks, one row,
a bias), each width: the AVX-512 one this CPU may have, AVX2 (RUNTIME_KERNEL_ISA=avx2 and the
-mno-avx512f build) and the plain loops, the repacked kernel's too in those builds
(tests/test_quant_repacked.py has its own cases); and the layers that use them."""

from __future__ import annotations

import shutil
import subprocess
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from runtime.kernels.cpu import CpuKernels, KernelError, load_cpu_kernels
from runtime.kernels.cpu_build import FLAGS, ISA_FLAGS, SOURCES, build_flags
from runtime.kernels.quant_formats import FORMATS, dequantize, quantize, scales_finite
from runtime.layers.basic import Linear
from runtime.layers.quantized import QUANT_ROWS
from tests.kernel_cases import PANEL_SHAPES, check_panel_linear
from tests.quant_cases import (
    NAMES,
    REPACKED_SHAPES,
    SHAPES,
    check_all_repacked,
    check_kernel,
    reference,
    weights,
)


@pytest.mark.parametrize("name", NAMES)
def test_quantize_and_dequantize_match_gguf_py_bit_for_bit(name: str) -> None:
    w = weights(6, 128, seed=1) * 3
    qtype = GGMLQuantizationType[name]
    ours = quantize(w, name)
    theirs = gguf_quants.quantize(w.numpy(), qtype)
    assert np.array_equal(ours.numpy(), theirs)
    back = gguf_quants.dequantize(theirs, qtype)
    assert torch.equal(dequantize(ours, name), torch.from_numpy(back).float())
    assert scales_finite(ours, name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("rows", "n", "k", "bias"), SHAPES)
def test_kernel_matches_dequantize_then_matmul(
    name: str, rows: int, n: int, k: int, bias: bool
) -> None:
    check_kernel(load_cpu_kernels(), name, rows, n, k, bias)


@pytest.mark.parametrize("layout", ["file", "repacked"])
def test_kernel_is_the_same_on_one_thread_and_two(layout: str) -> None:
    """Both kernels: cpu_quant.cpp on the file's blocks (70 rows: a partial tile) and
    cpu_repacked.cpp on a repacked copy (96 rows: whole groups with AVX-512 and AVX2)."""
    kernels, fmt = load_cpu_kernels(), FORMATS["Q4_1"]
    x = torch.randn(5, 320)
    if layout == "file":
        blocks = quantize(torch.randn(70, 320), "Q4_1")
        product = partial(kernels.quant_linear, x, blocks, fmt)
    else:
        blocks = kernels.repack_blocks(quantize(torch.randn(96, 320), "Q4_1"), fmt)
        product = partial(kernels.repacked_linear, x, blocks, fmt)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = product()
        torch.set_num_threads(2)
        two = product()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_shapes_that_do_not_go_together_are_refused() -> None:
    kernels, fmt = load_cpu_kernels(), FORMATS["Q8_0"]
    blocks = quantize(torch.randn(4, 64), "Q8_0")
    with pytest.raises(KernelError):
        kernels.quant_linear(torch.randn(2, 96), blocks, fmt)  # K 96 against rows of 64
    with pytest.raises(KernelError):
        kernels.quant_linear(torch.randn(2, 64), blocks, FORMATS["Q4_0"])  # another format
    with pytest.raises(ValueError, match="whole blocks"):
        quantize(torch.randn(4, 40), "Q8_0")


def build(tmp_path: Path, name: str, *extra: str) -> CpuKernels:
    library = tmp_path / f"{name}.so"
    compiler = shutil.which("g++") or "c++"
    command = [compiler, *FLAGS, *extra, *map(str, SOURCES), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True)
    return CpuKernels(library)


def has_flag(flag: str) -> bool:
    return flag in Path("/proc/cpuinfo").read_text().split()


@pytest.mark.skipif(not has_flag("avx2"), reason="the AVX2 kernels need an AVX2 CPU")
def test_the_avx2_kernels_match_on_an_avx512_cpu_too(tmp_path: Path) -> None:
    """What RUNTIME_KERNEL_ISA=avx2 builds: the AVX2 products, whatever else the CPU has."""
    kernels = build(tmp_path, "avx2", *ISA_FLAGS["avx2"])
    assert kernels.quant_isa == "AVX2"
    assert not kernels.panel_dtypes  # linears go to oneDNN or cpu_linear.cpp there
    for rows, n, k, bias in PANEL_SHAPES:  # its float32 panels (half a panel a pass) multiply
        check_panel_linear(kernels, torch.float32, rows, n, k, bias)
    for name in NAMES:
        for rows, n, k, bias in SHAPES:
            check_kernel(kernels, name, rows, n, k, bias)
    # repacked: groups of 8 rows; Q8_0's unsigned bytes only where AVX-VNNI keeps them exact
    assert kernels.repacked_rows == 8
    assert ("Q8_0" in kernels.repacked_formats) == has_flag("avx_vnni")
    check_all_repacked(kernels, REPACKED_SHAPES)


def test_the_plain_loops_match(tmp_path: Path) -> None:
    """No AVX2 nor F16C (another architecture, an old CPU): the loops that stand for them."""
    kernels = build(tmp_path, "plain", "-mno-avx512f", "-mno-avx2", "-mno-f16c")
    assert kernels.quant_isa == "plain loops"
    for name in NAMES:
        for rows, n, k, bias in SHAPES[:4]:
            check_kernel(kernels, name, rows, n, k, bias)
    assert kernels.repacked_formats == set(NAMES)
    check_all_repacked(kernels, REPACKED_SHAPES[:4])


def test_the_16_lane_loops_match_on_any_cpu(tmp_path: Path) -> None:
    """The AVX-512 layout (two blocks a step) in plain loops, built wherever the tests run."""
    kernels = build(tmp_path, "lanes16", "-mno-avx512f", "-DRUNTIME_LINEAR_LANES=16")
    for name in NAMES:
        for rows, n, k, bias in SHAPES[:4]:
            check_kernel(kernels, name, rows, n, k, bias)
    assert kernels.repacked_rows == 16 and kernels.repacked_formats == set(NAMES)
    check_all_repacked(kernels, REPACKED_SHAPES[:4])


def test_the_isa_is_chosen_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_KERNEL_ISA", "avx2")
    assert build_flags() == (*FLAGS, "-mno-avx512f")
    monkeypatch.setenv("RUNTIME_KERNEL_ISA", "sse")
    with pytest.raises(ValueError, match="RUNTIME_KERNEL_ISA='sse'"):
        build_flags()


@pytest.mark.parametrize("name", NAMES)
def test_a_linear_layer_of_blocks_uses_the_kernel_for_decode_rows_and_blas_beyond(
    name: str,
) -> None:
    kernels = load_cpu_kernels()
    layer = Linear(128, 40, bias=True)
    float_weight = layer.weight.detach().clone()
    layer.quantize_(FORMATS[name])
    layer.weight.data.copy_(quantize(float_weight, name))
    w = dequantize(layer.weight.data, name)
    with torch.no_grad():
        for rows in (1, QUANT_ROWS, QUANT_ROWS + 1):
            x = torch.randn(rows, 128)
            layer.pack_for_cpu(quant_kernels=None)  # torch: the dequantized matrix's product
            torch.testing.assert_close(layer(x), F.linear(x, w, layer.bias), atol=0, rtol=0)
            layer.pack_for_cpu(quant_kernels=kernels)
            got = layer(x)
            if rows <= QUANT_ROWS:
                expected = reference(x, layer.weight.data, name, layer.bias).float()
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            else:  # BLAS against the kernel's dequantized matrix
                torch.testing.assert_close(got, F.linear(x, w, layer.bias))
