"""Installing named tensors over a served model (update_weights_from_tensor / _distributed's
worker side): all checked before any is copied, and the CPU path's packed weights follow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.checkpoints.random_model import make_tiny_model
from runtime.config.engine import EngineConfig
from runtime.layers.basic import Linear
from runtime.worker.loader import CheckpointError, install_tensors
from runtime.worker.model_runner import ModelRunner


def runner_for(model_dir: Path, dtype: str = "bfloat16") -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model_dir), mode="inproc", dtype=dtype))


def linear_outputs(runner: ModelRunner) -> dict[str, torch.Tensor]:
    """Every linear layer's output for one fixed input (8 rows: a prefill's, which the packed
    weights compute in either dtype)."""
    assert runner.weights.model is not None
    outputs = {}
    for name, module in runner.weights.model.named_modules():
        if isinstance(module, Linear):
            x = torch.ones(8, module.in_features, dtype=module.weight.dtype)
            outputs[name] = module(x)
    return outputs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_installed_weights_serve_as_a_fresh_load(
    llama_dir: Path, tmp_path: Path, dtype: str
) -> None:
    other = make_tiny_model(tmp_path / "seed3", "llama", seed=3)
    runner, fresh = runner_for(llama_dir, dtype), runner_for(other, dtype)
    assert runner.weights.install_file(str(other / "model.safetensors")) == ""
    expected = linear_outputs(fresh)
    for name, output in linear_outputs(runner).items():
        torch.testing.assert_close(output, expected[name], rtol=0, atol=0, msg=name)


def test_nothing_changes_unless_every_tensor_fits(llama_dir: Path, tmp_path: Path) -> None:
    runner = runner_for(llama_dir)
    assert runner.weights.model is not None
    before = {n: p.clone() for n, p in runner.weights.model.named_parameters()}
    other = load_file(
        str(make_tiny_model(tmp_path / "seed4", "llama", seed=4) / "model.safetensors")
    )
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "has no place": [*other.items(), ("model.extra.weight", torch.zeros(2))],
        "shape": [*other.items(), (q, torch.zeros(3, 3))],
        "floating point": [(q, other[q].to(torch.int32)), *other.items()],
        "same weights": [*other.items(), (q, other[q])],  # twice
        "same weights ": [  # our fused tensor and one of its checkpoint slices
            (
                "model.layers.0.self_attn.qkv_proj.weight",
                runner.weights.model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
                .detach()
                .clone(),
            ),
            (q, other[q]),
        ],
    }
    for words, tensors in cases.items():
        with pytest.raises(CheckpointError, match=words.strip()):
            install_tensors(runner.weights.model, tensors)
        assert runner.weights.install(tensors) != ""
    for name, param in runner.weights.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_a_tied_lm_head_follows_the_embedding(model_dirs: dict[str, Path]) -> None:
    runner = runner_for(model_dirs["qwen2"])
    assert runner.weights.model is not None
    embedding = runner.weights.model.get_parameter("model.embed_tokens.weight")
    new = torch.randn(embedding.shape).to(embedding.dtype)
    tensors = [("model.embed_tokens.weight", new), ("lm_head.weight", torch.zeros_like(new))]
    assert install_tensors(runner.weights.model, tensors) == 1  # the tied head is the embedding
    assert torch.equal(runner.weights.model.get_parameter("lm_head.weight"), new)
