"""Linears against weights packed into panels (runtime/kernels/cpu_panels.cpp): float32 on
any CPU, bfloat16 on CPUs with AVX512-BF16 (elsewhere those tests skip): the products against
a float64 reference, the refusals, and the Linear layer that hands them every step of its
dtype where the build's panels take it (the AVX2 build's test in test_quant_kernels.py checks
its float32 panels and that they are not taken there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.cpu import KernelError, load_cpu_kernels
from runtime.layers.basic import Linear
from tests.kernel_cases import PANEL_SHAPES, PANEL_TOLERANCE, check_panel_linear

kernels = load_cpu_kernels()
needs_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in kernels.panel_dtypes,
    reason="bfloat16 panels need AVX512-BF16 (and no AMX, where oneDNN stays)",
)
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k", "bias"), PANEL_SHAPES)
def test_panel_linear_matches_float64_reference(
    dtype: torch.dtype, rows: int, n: int, k: int, bias: bool
) -> None:
    check_panel_linear(kernels, dtype, rows, n, k, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_is_the_same_on_one_thread_and_two(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, weight = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((20, 256), (200, 256)))
    panels = kernels.pack_panels(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.panel_linear(x, panels, 200)
        torch.set_num_threads(2)
        two = kernels.panel_linear(x, panels, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each output is one thread's sum, in one order


@needs_bf16
def test_panels_refuse_what_they_cannot_multiply() -> None:
    with pytest.raises(KernelError, match="k is odd"):
        kernels.pack_panels(torch.zeros(8, 7, dtype=torch.bfloat16))
    with pytest.raises(KernelError, match="dtype"):
        kernels.pack_panels(torch.zeros(8, 8, dtype=torch.int32))
    panels = kernels.pack_panels(torch.zeros(40, 8, dtype=torch.bfloat16))
    with pytest.raises(KernelError, match="panelled outputs"):  # x's k is not the weight's
        kernels.panel_linear(torch.zeros(2, 6, dtype=torch.bfloat16), panels, 40)
    with pytest.raises(KernelError, match="panelled outputs"):
        kernels.panel_linear(torch.zeros(2, 8, dtype=torch.bfloat16), panels, 70)
    with pytest.raises(KernelError, match="panelled outputs"):
        bias = torch.zeros(39, dtype=torch.bfloat16)
        kernels.panel_linear(torch.zeros(2, 8, dtype=torch.bfloat16), panels, 40, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_layers_hand_every_step_of_their_dtype_to_the_panels(dtype: torch.dtype) -> None:
    if dtype not in kernels.panel_dtypes:
        pytest.skip(f"this build's panels do not take {dtype} linears (panel_isa)")
    layer = Linear(64, 48, bias=True).to(dtype)
    layer.pack_for_cpu(kernels.linear, quant_kernels=kernels, panel_kernels=kernels)
    assert layer.panels is not None and layer.packed is None  # one packed copy, not two
    with torch.no_grad():
        for rows in (1, 2, 32, 300):
            x = torch.randn(rows, 64).to(dtype)
            expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            torch.testing.assert_close(layer(x).double(), expected, **PANEL_TOLERANCE[dtype])
        # a weight update repacks: the panels follow the new weight
        layer.weight.mul_(-1)
        layer.pack_for_cpu(kernels.linear, quant_kernels=kernels, panel_kernels=kernels)
        x = torch.randn(3, 64).to(dtype)
        expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        torch.testing.assert_close(layer(x).double(), expected, **PANEL_TOLERANCE[dtype])


@needs_bf16
def test_odd_or_unfitting_weights_keep_their_other_paths() -> None:
    odd = Linear(63, 8).to(torch.bfloat16)
    odd.pack_for_cpu(kernels.linear, panel_kernels=kernels)
    float32 = Linear(64, 8)  # its copies would not fit in memory
    float32.pack_for_cpu(kernels.linear, panel_kernels=kernels, float32=False)
    assert odd.panels is None and float32.panels is None
    with torch.no_grad():
        x = torch.randn(4, 63).to(torch.bfloat16)
        expected = F.linear(x.double(), odd.weight.double(), odd.bias.double())
        torch.testing.assert_close(odd(x).double(), expected, atol=0.05, rtol=1e-2)
