"""compare.py's concurrency-1 line: each system's decode against the weight bytes it reads a
token over the bandwidth measured after its own runs (their median), else at the end."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.bandwidth_limit import print_bandwidth_limits


@pytest.fixture
def args(tmp_path: Path) -> argparse.Namespace:
    tensors = {
        "model.embed_tokens.weight": torch.zeros(10, 50),  # untied: left out
        "lm_head.weight": torch.zeros(10, 50),
        "model.norm.weight": torch.zeros(499_500),  # with the head: 2 MB in float32
    }
    save_file(tensors, tmp_path / "model.safetensors")
    return argparse.Namespace(concurrency=[8, 1], model=str(tmp_path), dtype="float32", variant=[])


def test_each_system_is_held_to_the_median_bandwidth_after_its_runs(
    args: argparse.Namespace, capsys: pytest.CaptureFixture[str]
) -> None:
    level = {"itl_ms": {"p50": 1.5}, "copy_rates": [1e9, 3e9, 2e9]}
    print_bandwidth_limits(args, {"ours": [{}, level]}, bandwidth=9e9)
    line = capsys.readouterr().out.splitlines()[-1]
    assert "copy 2.0 GB/s (1.0, 3.0, 2.0); 2 MB a token" in line  # 2 MB at 2 GB/s: 1 ms
    assert "limit 1.00 ms" in line and "1.50x the limit" in line


def test_without_its_own_figures_a_system_gets_the_end_of_run_bandwidth(
    args: argparse.Namespace, capsys: pytest.CaptureFixture[str]
) -> None:
    print_bandwidth_limits(args, {"vllm": [{}, {"itl_ms": {"p50": 4.0}}]}, bandwidth=1e9)
    line = capsys.readouterr().out.splitlines()[-1]
    assert "copy 1.0 GB/s (1.0)" in line and "limit 2.00 ms" in line and "2.00x the limit" in line


def test_a_system_of_unknown_bytes_gets_no_line(
    args: argparse.Namespace, capsys: pytest.CaptureFixture[str]
) -> None:
    print_bandwidth_limits(args, {"transformers": [{}, {"itl_ms": {"p50": 4.0}}]}, 1e9)
    assert "transformers" not in capsys.readouterr().out
