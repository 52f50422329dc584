"""Incremental detokenization and stop strings."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime.frontend.detokenizer import IncrementalDetokenizer
from runtime.frontend.stop_strings import StopStringMatcher


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(llama_dir)


def stream_text(
    tokenizer: PreTrainedTokenizerBase, prompt: list[int], output: list[int]
) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    return [detok.push(t) for t in output]


@settings(max_examples=200, deadline=None)
@given(prefix=st.text(max_size=20), text=st.text(min_size=1, max_size=60))
@example(prefix="", text="<|endoftext|>")  # hypothesis found it in CI (strings it mines)
@example(prefix="", text="\ufffd")  # and this one
@example(prefix="", text="<|im_start|>")  # and this: an added special token, not in all_special_ids
def test_streamed_text_is_the_text_without_replacement_characters(
    tokenizer: PreTrainedTokenizerBase, prefix: str, text: str
) -> None:
    prompt = tokenizer.encode(prefix) if prefix else [0]
    ids = tokenizer.encode(text)
    pieces = stream_text(tokenizer, prompt, ids)
    skipped = tokenizer.decode(ids, skip_special_tokens=True)
    if skipped != tokenizer.decode(ids):  # special tokens ("<|endoftext|>"): skipped, as vLLM
        assert "".join(pieces) == skipped
        return
    if text.endswith("\ufffd"):  # held back as the start of a character, as a real partial one
        text = text.rstrip("\ufffd")  # is: DecodeStream cannot tell them apart (nor can vLLM)
        assert "".join(pieces).rstrip("\ufffd") == text
        return
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in pieces)


def test_multibyte_characters_arrive_whole(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "日本語 ✓ é"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # byte-level BPE splits these characters over several tokens
    pieces = stream_text(tokenizer, [0], ids)
    assert "".join(pieces) == text and "" in pieces  # some tokens completed no character yet


def feed_all(stops: tuple[str, ...], chunks: list[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops)
    out = ""
    for i, chunk in enumerate(chunks):
        released, matched = matcher.feed(chunk, final=i == len(chunks) - 1)
        out += released
        if matched is not None:
            return out, matched
    return out, None


def test_stop_string_is_trimmed_and_partial_matches_are_held() -> None:
    matcher = StopStringMatcher(("</end>",))
    assert matcher.feed("hello </", False) == ("hello ", None)  # "</" could start "</end>"
    assert matcher.feed("e", False) == ("", None)
    assert matcher.feed("xtra", False) == ("</extra", None)  # ruled out: released
    assert matcher.feed(" </en", False) == (" ", None)
    assert matcher.feed("d> more", False) == ("", "</end>")


def test_earliest_stop_wins_and_final_flushes() -> None:
    assert feed_all(("b", "abc"), ["xab", "c"]) == ("xa", "b")
    assert feed_all(("zz",), ["abc", "z"]) == ("abcz", None)  # the end releases held text


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_chunking_never_changes_the_result(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)] or [""]
    out, matched = feed_all(tuple(stops), chunks)
    # the stop that completes first, as when text arrives one character at a time
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if found:
        _, at, first = min(found)
        assert out == text[:at] and matched == first
    else:
        assert out == text and matched is None
