"""GGUF files become Hugging Face checkpoints: exactly (F32), once (content-keyed cache), and
files we cannot serve are refused, naming why, before anything is written or started."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file

from runtime.checkpoints.gguf import MARKER, gguf_source, resolve_checkpoint
from runtime.config.engine import EngineConfig
from runtime.frontend.launch import open_engine
from tests.conftest import ARCHS
from tests.gguf_helpers import GGUF_CASES
from tools.gguf_writer import write_gguf

# config.json keys the conversion must carry over from the checkpoint the file was made from
HYPER_PARAMETERS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "eos_token_id",
    "pad_token_id",
)
GGUF_CASES_PRE = {case.arch: case.pre for case in GGUF_CASES.values()}


@pytest.mark.parametrize("arch", ARCHS)
def test_an_f32_file_converts_back_to_its_checkpoint_exactly(
    arch: str, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Names, the llama Q/K un-permutation (the writer permutes as llama.cpp does), tied
    embeddings and hyper-parameters: bit for bit what the file was written from."""
    source = model_dirs[arch]
    gguf = write_gguf(source, tmp_path / f"{arch}.gguf", "F32", GGUF_CASES_PRE[arch])
    converted = Path(resolve_checkpoint(str(gguf), tmp_path / "cache"))
    ours, original = (load_file(d / "model.safetensors") for d in (converted, source))
    assert sorted(ours) == sorted(original)
    for name, tensor in original.items():
        assert ours[name].dtype == tensor.dtype and ours[name].equal(tensor), name
    config, expected = (json.loads((d / "config.json").read_text()) for d in (converted, source))
    assert {k: config[k] for k in HYPER_PARAMETERS} == {k: expected[k] for k in HYPER_PARAMETERS}
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


def test_converted_once_then_reused(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    gguf = gguf_files["llama-q4_0"]
    first = Path(resolve_checkpoint(str(gguf), cache))
    assert first.parent == cache / "gguf" and (first / MARKER).is_file()
    (first / "sentinel").touch()  # gone if the folder is written again
    moved = tmp_path / "renamed.gguf"
    shutil.copy(gguf, moved)  # keyed by content: another name for the same bytes
    assert Path(resolve_checkpoint(str(moved), cache)) == first
    assert (first / "sentinel").exists()  # not converted again
    marker = json.loads((first / MARKER).read_text())
    (first / MARKER).write_text(json.dumps(marker | {"converter": 0}))  # an older converter's
    assert Path(resolve_checkpoint(str(gguf), cache)) == first
    assert not (first / "sentinel").exists() and (first / "model.safetensors").is_file()
    assert [p.name for p in (cache / "gguf").iterdir()] == [first.name]  # nothing left over


def test_a_folder_holding_one_gguf_file(
    gguf_files: dict[str, Path], llama_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "one"
    folder.mkdir()
    os.link(gguf_files["qwen2-q4_1"], folder / "model.gguf")
    assert gguf_source(folder) == folder / "model.gguf"
    assert gguf_source(llama_dir) is None  # a Hugging Face folder is served as it is
    assert resolve_checkpoint(str(llama_dir)) == str(llama_dir)
    os.link(gguf_files["qwen3-q8_0"], folder / "other.gguf")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files"):
        gguf_source(folder)


def write_small_gguf(path: Path, arch: str, qtype: GGMLQuantizationType) -> Path:
    """A file with one tensor of `qtype` (its bytes zero): enough to be judged."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    rows = np.zeros((4, 64), dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", rows)
    else:  # IQ2_XXS: 66 bytes per 256 values, which gguf-py reads but cannot write
        writer.add_tensor("token_embd.weight", np.zeros((4, 66), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "qtype", "message"),
    [
        ("gemma2", GGMLQuantizationType.F32, "architecture 'gemma2'; F32 x1\\): we serve"),
        ("llama", GGMLQuantizationType.IQ2_XXS, "'llama'; IQ2_XXS x1\\): cannot read .*IQ2_XXS"),
    ],
)
async def test_a_file_we_cannot_serve_is_refused_before_any_actor_starts(
    arch: str, qtype: GGMLQuantizationType, message: str, tmp_path: Path
) -> None:
    path = write_small_gguf(tmp_path / "model.gguf", arch, qtype)
    with pytest.raises(ValueError, match=message):
        resolve_checkpoint(str(path), tmp_path / "cache")
    with pytest.raises(ValueError, match=message):
        async with open_engine(EngineConfig(model=str(path), mode="inproc")):
            pytest.fail("the engine started")
    assert not (tmp_path / "cache").exists()  # refused before writing anything


def test_smollm2_hyper_parameters(smollm2_dir: Path) -> None:
    """What the issue read from the file with gguf-py, as a Hugging Face config."""
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    shape = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
    assert [config[k] for k in shape] == [30, 576, 1536, 49152]
    heads = ("num_attention_heads", "num_key_value_heads", "head_dim")
    assert [config[k] for k in heads] == [9, 3, 64]
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == 8192 and config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(smollm2_dir / "model.safetensors")
    tokens = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    roles = ("bos_token", "eos_token", "pad_token", "unk_token")
    expected = ["<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>"]
    assert [tokens[r] for r in roles] == expected
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
