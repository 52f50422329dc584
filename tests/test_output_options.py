"""Output options: special tokens in the text, stop strings kept or held back by min_tokens,
and processed log-probabilities."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.detokenizer import IncrementalDetokenizer
from runtime.frontend.launch import open_engine
from tests.engine_helpers import collect, random_prompts

PROMPT = random_prompts([20], seed=3)[0]


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(llama_dir)


def detokenize(tokenizer: PreTrainedTokenizerBase, ids: list[int], **options: bool) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, [], **options)
    return "".join(detokenizer.push(t) for t in ids)


def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerBase) -> None:
    words = tokenizer.encode(" tuple object", add_special_tokens=False)
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [*words, start, end, *words, end]
    text = tokenizer.decode(words)
    assert detokenize(tokenizer, ids) == text + text
    kept = tokenizer.decode(ids, skip_special_tokens=False)  # a fast tokenizer's, as vLLM's
    assert kept == text + "<|im_start|><|im_end|>" + text + "<|im_end|>"
    assert detokenize(tokenizer, ids, skip_special_tokens=False) == kept
    unspaced = detokenize(
        tokenizer, ids, skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert unspaced == kept  # a byte-level decoder puts no space before an added token


async def test_stop_strings_kept_or_held_back_until_min_tokens(llama_dir: Path) -> None:
    config = EngineConfig(model=str(llama_dir), mode="inproc", dtype="float32", max_model_len=128)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    async with open_engine(config) as engine:
        whole = await collect(engine, PROMPT, greedy)
        text = whole["text"]
        stop = text[len(text) // 3 : len(text) // 3 + 3]  # ends within the first tokens
        at = text.index(stop)
        trimmed = await collect(engine, PROMPT, greedy.replace(stop=(stop,)))
        kept = await collect(
            engine, PROMPT, greedy.replace(stop=(stop,), include_stop_str_in_output=True)
        )
        late = await collect(engine, PROMPT, greedy.replace(stop=(stop,), min_tokens=12))
    assert trimmed["text"] == text[:at] and trimmed["matched_stop"] == stop
    assert kept["text"] == text[: at + len(stop)]
    assert late["text"] == text and late["finish_reason"] == "length"  # never searched


async def test_processed_logprobs_are_of_the_distribution_sampled_from(llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(llama_dir), mode="inproc", dtype="float32", logprobs_mode="processed"
    )
    params = SamplingParams(max_tokens=8, temperature=0.7, top_k=3, seed=5, logprobs=4)
    async with open_engine(config) as engine:
        assert engine.server_info()["logprobs_mode"] == "processed"
        run = await collect(engine, PROMPT, params)
    for token, logprob, top in zip(
        run["tokens"], run["logprobs"], run["top_logprobs"], strict=True
    ):
        assert math.isclose(sum(math.exp(v) for _, v in top[:3]), 1.0, rel_tol=1e-4)
        assert top[3][1] == -math.inf  # top-k left three tokens
        assert (token, logprob) in [(t, v) for t, v in top[:3]]
