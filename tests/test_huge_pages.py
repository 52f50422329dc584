"""What a decode step streams (the packed weights, the KV pool) lives in memory that asked for
2 MB pages (runtime/worker/huge_pages.py): the same values, one arena in the step's order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from runtime.checkpoints.gguf import resolve_checkpoint
from runtime.config.engine import EngineConfig
from runtime.layers.basic import Linear
from runtime.worker.huge_pages import HUGE_PAGE, huge_zeros, into_huge_pages
from runtime.worker.model_runner import ModelRunner

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def asked_for_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether the mapping that holds `tensor` was advised MADV_HUGEPAGE ("hg" in smaps)."""
    address, mapping = tensor.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            mapping = start <= address < end
        elif mapping and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


def advises() -> bool:
    return sys.platform == "linux" and THP.exists() and "[never]" not in THP.read_text()


def test_copies_keep_values_in_one_arena_in_order() -> None:
    torch.manual_seed(0)
    tensors = [
        torch.randn(300, 7),
        torch.randint(0, 255, (1000,), dtype=torch.uint8),
        torch.randn(5, 3).to(torch.bfloat16),
        torch.randn(64, 64).t(),  # not contiguous: the copy is
    ]
    copies = into_huge_pages(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape
        assert copy.is_contiguous() and torch.equal(copy, tensor)
        assert copy.data_ptr() % 64 == 0
    starts = [copy.data_ptr() for copy in copies]
    assert starts == sorted(starts) and starts[0] % HUGE_PAGE == 0
    assert len({copy.untyped_storage().data_ptr() for copy in copies}) == 1
    zeros = huge_zeros((3, 1000, 7), torch.float32)
    assert zeros.shape == (3, 1000, 7) and not zeros.any() and zeros.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(not advises(), reason="no transparent huge pages on this system")
def test_the_memory_asks_for_huge_pages() -> None:
    # (no check that torch's own memory did not ask: memory that asked and was freed goes back
    # to glibc's heap still asking, and later allocations may land in it)
    assert asked_for_huge_pages(into_huge_pages([torch.ones(HUGE_PAGE)])[0])
    assert asked_for_huge_pages(huge_zeros((HUGE_PAGE,), torch.float32))


def test_a_served_gguf_model_streams_from_one_arena(gguf_files: dict[str, Path]) -> None:
    model_dir = resolve_checkpoint(str(gguf_files["qwen2-q4_1"]), quantization="gguf")
    config = EngineConfig(model=model_dir, mode="inproc", quantization="gguf", num_kv_blocks=8,
                          max_model_len=128)  # fmt: skip
    runner = ModelRunner(config)
    model = runner.weights.model
    assert model is not None
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.repacked is not None]
    repacked = [m.repacked for m in linears if m.repacked is not None]
    assert len(repacked) > 1
    assert len({t.untyped_storage().data_ptr() for t in repacked}) == 1
    if advises():
        assert asked_for_huge_pages(repacked[0])
        assert asked_for_huge_pages(runner.kv_caches)
