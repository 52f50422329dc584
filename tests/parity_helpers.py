"""The prompts of the greedy parity tests, and transformers' continuations of them
(the `references` fixture, in conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.config.sampling import SamplingParams
from tests.engine_helpers import random_prompts

LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 48, 64, 100, 129, 150, 200, 256, 300]
SHARED = random_prompts([80], seed=99)[0]  # a common prefix: 5 full blocks of 16
MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def prompt_set() -> list[list[int]]:
    prompts = random_prompts(LENGTHS, seed=1)
    for i in range(0, len(prompts), 3):  # every third one starts with the shared prefix
        prompts[i] = SHARED + prompts[i]
    return prompts


def greedy_references(
    model_dirs: dict[str, Path], archs: tuple[str, ...]
) -> dict[str, list[list[int]]]:
    """transformers' greedy continuation of every prompt, per architecture."""
    import torch  # here: the API tests' conftest must not pay for torch
    from transformers import AutoModelForCausalLM

    refs = {}
    for arch in archs:
        model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32)
        outputs = []
        for prompt in [SHARED, *prompt_set()]:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
            )
            outputs.append(out[0, len(prompt) :].tolist())
        refs[arch] = outputs
    return refs


def last_hidden_states(model_dir: Path, prompts: list[list[int]]) -> list[Any]:
    """transformers' `AutoModel` last_hidden_state (after the final norm) of each prompt, in
    float32: what embeddings are pooled from."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]
