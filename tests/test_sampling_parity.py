"""Logits processors and log-probabilities against transformers (float32, greedy), in one
engine whose small token budget and KV pool make prompts prefill in chunks, hit the prefix
cache and get preempted while these requests run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from runtime.config.engine import EngineConfig
from runtime.config.sampling import SamplingParams
from runtime.frontend.launch import open_engine
from tests.engine_helpers import collect_all, random_prompts

MAX_TOKENS = 12
PROMPTS = random_prompts([37, 70, 5, 130], seed=21)
PENALTY_BIAS = dict.fromkeys(range(10, 16), 6.0)


@pytest.fixture(scope="module")
def model(llama_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def hf_generate(model: PreTrainedModel, prompt: list[int], **options: Any) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=MAX_TOKENS,
        pad_token_id=0,
        **options,
    )
    return out[0, len(prompt) :].tolist()


def reference_penalties(
    model: PreTrainedModel, prompt: list[int], presence: float, frequency: float
) -> list[int]:
    """Greedy under OpenAI's definition: logit[j] -= frequency * c[j] + presence * (c[j] > 0),
    with c[j] how often token j was generated so far. `PENALTY_BIAS` first makes a few tokens
    near-ties, so that the penalties decide among them (a random model rarely repeats)."""
    tokens = list(prompt)
    counts = torch.zeros(model.config.vocab_size)
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1]
        logits[list(PENALTY_BIAS)] += torch.tensor(list(PENALTY_BIAS.values()))
        logits = logits - frequency * counts - presence * (counts > 0).float()
        token = int(logits.argmax())
        counts[token] += 1
        tokens.append(token)
    return tokens[len(prompt) :]


def hf_logprobs(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `tokens`."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


async def test_processors_and_logprobs_match_transformers(
    llama_dir: Path, model: PreTrainedModel
) -> None:
    greedy = [hf_generate(model, p) for p in PROMPTS]
    g = greedy[0]
    cases: list[tuple[list[int], SamplingParams, list[int]]] = []

    def case(prompt: list[int], hf: dict[str, Any], **params: Any) -> None:
        expected = hf_generate(model, prompt, **hf) if "ref" not in hf else hf["ref"]
        cases.append(
            (prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **params), expected)
        )

    for p in PROMPTS:
        case(p, {"repetition_penalty": 1.5}, repetition_penalty=1.5)
        case(p, {"repetition_penalty": 0.7}, repetition_penalty=0.7)
    # min_tokens: a stop token biased to come first is masked for the first six tokens
    stop = g[2]
    min_case = len(cases)
    for min_tokens in (6, 0):
        case(
            PROMPTS[0],
            {
                "eos_token_id": [stop],
                "min_new_tokens": min_tokens,
                "sequence_bias": {(stop,): 100.0},
            },
            stop_token_ids=(stop,),
            min_tokens=min_tokens,
            logit_bias=((stop, 100.0),),
            ignore_eos=True,
        )
    # min_tokens alone: the stop is the greedy third token, banned there (the other steps take
    # the one-pass greedy pick, the banned step the processed path)
    case(
        PROMPTS[0],
        {"eos_token_id": [stop], "min_new_tokens": 6},
        stop_token_ids=(stop,),
        min_tokens=6,
        ignore_eos=True,
    )
    # bad words: one token, and two (its last token banned only right after the first)
    assert PROMPTS[0][-1] != g[1]  # transformers also looks at the prompt; vLLM does not
    case(PROMPTS[0], {"bad_words_ids": [[g[0]]]}, bad_words_token_ids=((g[0],),))
    case(PROMPTS[0], {"bad_words_ids": [[g[1], g[2]]]}, bad_words_token_ids=((g[1], g[2]),))
    unbanned = ((g[0], g[2]),)  # g[0] is never right before g[2]: no effect
    case(PROMPTS[0], {"bad_words_ids": [list(w) for w in unbanned]}, bad_words_token_ids=unbanned)
    # logit bias: transformers' sequence_bias on one-token sequences is the same addition
    bias = {g[0]: -100.0, greedy[1][3]: 4.0, 7: 2.5}
    for prompt in PROMPTS[:2]:
        sequence_bias = {(t,): b for t, b in bias.items()}
        case(prompt, {"sequence_bias": sequence_bias}, logit_bias=tuple(bias.items()))
    unpenalized = reference_penalties(model, PROMPTS[1], 0.0, 0.0)
    for presence, frequency in ((1.5, 0.0), (0.0, 0.5), (-0.5, 0.8)):
        ref = reference_penalties(model, PROMPTS[1], presence, frequency)
        assert ref != unpenalized
        case(
            PROMPTS[1],
            {"ref": ref},
            presence_penalty=presence,
            frequency_penalty=frequency,
            logit_bias=tuple(PENALTY_BIAS.items()),
        )
    # allowed tokens: argmax among them, every step
    allowed = tuple(range(50, 90))
    logits_ref = _allowed_reference(model, PROMPTS[2], allowed)
    case(PROMPTS[2], {"ref": logits_ref}, allowed_token_ids=allowed)
    # raw log-probabilities of prompt and output, with the top 5, while a penalty changes the
    # sampled tokens (raw: before it)
    case(
        PROMPTS[3],
        {"repetition_penalty": 1.5},
        repetition_penalty=1.5,
        logprobs=5,
        prompt_logprobs=3,
    )
    case(PROMPTS[1], {}, logprobs=0, prompt_logprobs=0, prompt_logprobs_start=30)

    config = EngineConfig(
        model=str(llama_dir),
        mode="inproc",
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=48,  # prompts prefill in chunks
        num_kv_blocks=24,  # 384 tokens for ~1,100 in flight: preemption
    )
    async with open_engine(config) as engine:
        # puts PROMPTS[1]'s first blocks in the prefix cache
        await collect_all(engine, [PROMPTS[1]], SamplingParams(max_tokens=1))
        runs = await collect_all(
            engine, [c[0] for c in cases], None, params_each=[c[1] for c in cases]
        )
        stats = await engine.fetch_statistics()
    assert stats.scheduler.num_preemptions > 0 and stats.scheduler.num_cached_tokens > 0
    for (prompt, params, expected), run in zip(cases, runs, strict=True):
        assert run["tokens"] == expected, params
        shows = params.bad_words_token_ids != unbanned and params.repetition_penalty == 1.0
        if params.processes_logits and shows:
            assert expected != greedy[PROMPTS.index(prompt)], repr(params)[150:400]
    changed = [
        e != greedy[PROMPTS.index(p)] for p, params, e in cases if params.repetition_penalty != 1
    ]
    assert sum(changed) >= 3, changed
    assert [len(r["tokens"]) for r in runs[min_case : min_case + 2]] == [7, 1]
    _check_logprobs(model, cases[-2][0], runs[-2], top=5, prompt_top=3, start=0)
    _check_logprobs(model, cases[-1][0], runs[-1], top=0, prompt_top=0, start=30)


def _allowed_reference(
    model: PreTrainedModel, prompt: list[int], allowed: tuple[int, ...]
) -> list[int]:
    tokens = list(prompt)
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1]
        tokens.append(allowed[int(logits[list(allowed)].argmax())])
    return tokens[len(prompt) :]


def _check_logprobs(
    model: PreTrainedModel, prompt: list[int], run: dict, *, top: int, prompt_top: int, start: int
) -> None:
    reference = hf_logprobs(model, prompt + run["tokens"])
    n = len(prompt)
    # generated token i is scored by the logits at position n - 1 + i
    for i, (token, logprob) in enumerate(zip(run["tokens"], run["logprobs"], strict=True)):
        assert logprob == pytest.approx(reference[n - 1 + i, token].item(), abs=1e-4)
        values, ids = reference[n - 1 + i].topk(top)
        assert [t for t, _ in run["top_logprobs"][i]] == ids.tolist()
        assert [v for _, v in run["top_logprobs"][i]] == pytest.approx(values.tolist(), abs=1e-4)
    entries = run["prompt_logprobs"]
    assert [e.token_id for e in entries] == prompt[start:]
    for position, entry in enumerate(entries, start):
        if position == 0:
            assert entry.logprob is None
            continue
        assert entry.logprob == pytest.approx(
            reference[position - 1, prompt[position]].item(), abs=1e-4
        )
        values, ids = reference[position - 1].topk(prompt_top)
        assert entry.top is not None and [t for t, _ in entry.top] == ids.tolist()
