"""The tokenizer we build from a GGUF file's metadata gives transformers' ids: the frontend
reads our tokenizer.json with AutoTokenizer, the reference is transformers' own tokenizer from
the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime.checkpoints.gguf import resolve_checkpoint
from tests.gguf_helpers import CHAT, TEXTS


def assert_same_ids(ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase) -> None:
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    rendered = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == expected
    assert ours.encode(rendered) == reference.encode(expected)
    for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, role) == getattr(reference, role), role


def test_smollm2_tokenizer_matches_transformers(
    smollm2_dir: Path, smollm2_reference_tokenizer: PreTrainedTokenizerBase
) -> None:
    """The real vocabulary (49,152 tokens, 17 control tokens) and its "smollm" split: digits
    one by one (transformers does not know the name, but this vocabulary has no merges of
    digits, so its plain GPT-2 split gives the same ids)."""
    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    assert_same_ids(ours, smollm2_reference_tokenizer)
    assert ours.convert_ids_to_tokens(ours.encode("<repo_name>x")) == ["<repo_name>", "x"]
    assert ours.convert_ids_to_tokens(ours.encode(" 2024")) == ["Ġ", "2", "0", "2", "4"]


@pytest.mark.parametrize("case", ["llama-q4_0", "qwen2-q4_1"])
def test_tiny_tokenizers_match_transformers(case: str, gguf_files: dict[str, Path]) -> None:
    """The "llama-bpe" and "qwen2" splits, on a vocabulary whose digits do merge."""
    gguf = gguf_files[case]
    ours = AutoTokenizer.from_pretrained(resolve_checkpoint(str(gguf)))
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert_same_ids(ours, reference)


def test_qwen_text_is_composed_first(gguf_files: dict[str, Path]) -> None:
    """Qwen's own tokenizer composes Unicode (NFC) before splitting, as transformers'
    Qwen2Tokenizer does for any qwen2/qwen3 folder; llama.cpp and transformers' GGUF tokenizer
    do not (the one place we differ from them)."""
    ours = AutoTokenizer.from_pretrained(resolve_checkpoint(str(gguf_files["qwen2-q4_1"])))
    assert ours.encode("cafe\u0301") == ours.encode("café")


def test_the_smollm_split_puts_each_digit_alone(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """On a vocabulary that merges digits, "smollm" still splits them (transformers' GGUF
    tokenizer ignores the name, so it is no reference here)."""
    from tools.gguf_writer import write_gguf

    gguf = write_gguf(model_dirs["llama"], tmp_path / "smollm.gguf", "Q8_0", "smollm")
    ours = AutoTokenizer.from_pretrained(resolve_checkpoint(str(gguf), tmp_path / "cache"))
    plain = AutoTokenizer.from_pretrained(model_dirs["llama"])
    assert len(plain.encode("1234567890")) < 10  # its merges join digits
    assert ours.convert_ids_to_tokens(ours.encode("x 1234567890")) == ["x", "Ġ", *"1234567890"]
