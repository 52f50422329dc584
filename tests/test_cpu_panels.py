"""bfloat16 linears against weights packed into panels (runtime/kernels/cpu_panels.cpp), on
CPUs with AVX512-BF16: the products against a float64 reference, the refusals, and the
Linear layer that hands them every bfloat16 step. Elsewhere the build has no panels (the
AVX2 build's test in test_quant_kernels.py checks that) and these skip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.kernels.cpu import KernelError, load_cpu_kernels
from runtime.layers.basic import Linear

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(
    not kernels.has_panels, reason="panels need AVX512-BF16 (and no AMX, where oneDNN stays)"
)


def bf16(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize(
    ("rows", "n", "k", "bias"),
    [
        (1, 32, 2, False),  # one row, one panel, one pair of k
        (5, 45, 64, True),  # a panel cut short at column 45 (and one of its vectors empty)
        (12, 100, 130, True),  # a full group of 12 rows
        (32, 576, 576, False),  # a decode batch of SmolLM2's shape: groups of 10, 11, 11
        (13, 17, 96, True),  # fewer columns than one vector
        (150, 64, 4096, True),  # a prefill in three blocks of rows (64 rows fill 512 KB)
    ],
)
def test_panel_linear_matches_float64_reference(rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * n + k)
    x, weight = bf16(rows, k, gen=gen), bf16(n, k, gen=gen)
    b = bf16(n, gen=gen) if bias else None
    out = kernels.panel_linear(x, kernels.pack_panels(weight), n, b)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # bfloat16 products are exact in float32; the sums round as float32, the result once
    torch.testing.assert_close(out.double(), expected, atol=0.05, rtol=1e-2)


def test_panel_linear_is_the_same_on_one_thread_and_two() -> None:
    gen = torch.Generator().manual_seed(1)
    x, weight = bf16(20, 256, gen=gen), bf16(200, 256, gen=gen)
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


def test_panels_refuse_what_they_cannot_multiply() -> None:
    with pytest.raises(KernelError, match="k is odd"):
        kernels.pack_panels(torch.zeros(8, 7, dtype=torch.bfloat16))
    with pytest.raises(KernelError, match="dtype"):
        kernels.pack_panels(torch.zeros(8, 8))
    panels = kernels.pack_panels(torch.zeros(40, 8, dtype=torch.bfloat16))
    with pytest.raises(KernelError, match="panelled outputs"):  # x's k is not the weight's
        kernels.panel_linear(torch.zeros(2, 6, dtype=torch.bfloat16), panels, 40)
    with pytest.raises(KernelError, match="panelled outputs"):
        kernels.panel_linear(torch.zeros(2, 8, dtype=torch.bfloat16), panels, 70)
    with pytest.raises(KernelError, match="panelled outputs"):
        bias = torch.zeros(39, dtype=torch.bfloat16)
        kernels.panel_linear(torch.zeros(2, 8, dtype=torch.bfloat16), panels, 40, bias)


def test_bfloat16_linear_layers_hand_every_step_to_the_panels() -> None:
    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    layer.pack_for_cpu(kernels.linear, quant_kernels=kernels, panel_kernels=kernels)
    assert layer.panels is not None and layer.packed is None  # one packed copy, not two
    with torch.no_grad():
        for rows in (1, 2, 32, 300):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
            torch.testing.assert_close(layer(x).double(), expected, atol=0.05, rtol=1e-2)
        # a weight update repacks: the panels follow the new weight
        layer.weight.mul_(-1)
        layer.pack_for_cpu(kernels.linear, quant_kernels=kernels, panel_kernels=kernels)
        x = torch.randn(3, 64).to(torch.bfloat16)
        expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        torch.testing.assert_close(layer(x).double(), expected, atol=0.05, rtol=1e-2)


def test_odd_or_float32_weights_keep_their_other_paths() -> None:
    odd = Linear(63, 8).to(torch.bfloat16)
    odd.pack_for_cpu(kernels.linear, panel_kernels=kernels)
    float32 = Linear(64, 8)
    float32.pack_for_cpu(kernels.linear, panel_kernels=kernels)
    assert odd.panels is None and float32.panels is None
    with torch.no_grad():
        x = torch.randn(4, 63).to(torch.bfloat16)
        expected = F.linear(x.double(), odd.weight.double(), odd.bias.double())
        torch.testing.assert_close(odd(x).double(), expected, atol=0.05, rtol=1e-2)
