"""The tiny checkpoint generator and our strict safetensors loader."""

from __future__ import annotations

import io
import logging
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from runtime.checkpoints.model_info import load_model_info
from runtime.checkpoints.random_model import make_tiny_model
from runtime.config.engine import EngineConfig
from runtime.layers.parallel import TPGroup
from runtime.models import MODELS
from runtime.models.llama import ModelArgs
from runtime.worker.loader import CheckpointError, load_weights
from runtime.worker.model_runner import ModelRunner


def test_same_seed_same_bytes(tmp_path: Path, llama_dir: Path) -> None:
    again = make_tiny_model(tmp_path / "again", "llama", seed=0)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (again / name).read_bytes() == (llama_dir / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "other", "llama", seed=1)
    weights = "model.safetensors"
    assert (other / weights).read_bytes() != (llama_dir / weights).read_bytes()


def test_builtin_model_shape(llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert 4_000_000 <= sum(p.numel() for p in model.parameters()) <= 5_500_000
    assert model.config.head_dim == 64 and model.config.num_hidden_layers == 4


def test_tokenizer_and_chat_template(llama_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(llama_dir)
    text = "def f(x):\n    return x ** 2  # ünïcode ✓"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def broken_copy(src: Path, dst: Path, edit: str) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    if edit == "missing":
        del tensors[name]
    elif edit == "shape":
        tensors[name] = tensors[name][:-1]
    elif edit == "extra":
        tensors["model.layers.1.self_attn.surprise.weight"] = torch.zeros(2)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("missing", "lacks 1 tensors.*model.layers.1.self_attn.k_proj.weight"),
        ("shape", "model.layers.1.self_attn.k_proj.weight: checkpoint shape \\(127, 256\\)"),
        ("extra", "'model.layers.1.self_attn.surprise.weight' has no place in the model"),
    ],
)
def test_loader_rejects_a_broken_checkpoint(
    tmp_path: Path, llama_dir: Path, edit: str, message: str
) -> None:
    path = broken_copy(llama_dir, tmp_path / edit, edit)
    with pytest.raises(CheckpointError, match=message):
        ModelRunner(EngineConfig(model=str(path), mode="inproc"))


def test_kv_pool_smaller_than_the_context_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="fewer than max_model_len=2048"):
        ModelRunner(EngineConfig(model=str(llama_dir), mode="inproc", num_kv_blocks=10))


def test_tied_embeddings_share_one_tensor(model_dirs: dict[str, Path]) -> None:
    runner = ModelRunner(EngineConfig(model=str(model_dirs["qwen2"]), mode="inproc"))
    model = runner.weights.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_the_weights_bar_is_drawn_only_on_a_terminal(
    llama_dir: Path, tty: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A log file gets one line, never a bar's carriage-return frames."""
    info = load_model_info(EngineConfig(model=str(llama_dir), dtype="float32"))
    model = MODELS[info.architecture](ModelArgs.from_hf(info.hf_config, info.architecture),
                                      info.hf_config, 64, TPGroup())  # fmt: skip
    stderr = Stream(tty)
    monkeypatch.setattr(sys, "stderr", stderr)
    with caplog.at_level(logging.INFO, "runtime.worker.loader"):
        load_weights(model, llama_dir, progress=True)
    assert ("\r" in stderr.getvalue()) == tty
    assert re.search(rf"loaded \d+ tensors from {re.escape(str(llama_dir))} in", caplog.text)
