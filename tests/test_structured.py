"""Structured output's parts without a model: constraints and their grammars
(runtime/structured.py), the frontend's compile checks (frontend/constraints.py) and the
worker's matchers and masks (worker/grammar_masks.py), on the tiny checkpoint's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from runtime.config.constraint import MAX_SOURCE_CHARS, Constraint
from runtime.config.sampling import SamplingParams
from runtime.frontend.constraints import ConstraintCompiler
from runtime.structured import MAX_SCHEMA_DEPTH, grammar_text
from runtime.worker.grammar_masks import GrammarMasks
from runtime.worker.seq_table import WorkerSeq

VOCAB = 4096  # the tiny checkpoints'
EOS = 2
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(llama_dir)


def compiler(tokenizer: PreTrainedTokenizerBase, deadline: float = 5.0) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer, VOCAB, frozenset({EOS}), deadline)


@pytest.mark.parametrize(
    ("constraint", "error"),
    [
        (Constraint("regex", "[0-9"), "the regex: .*unclosed character class"),
        (Constraint("json", '{"type": "objec"}'), "the JSON schema: .*objec"),
        (Constraint("json", '{"type": '), "the JSON schema: not valid JSON"),
        (Constraint("json", "[1]"), "the JSON schema: a JSON schema is an object"),
        (Constraint("json", '{"a": ' * 70 + "1" + "}" * 70), "nested deeper than 64 levels"),
        (Constraint("choice", '["a", 3]'), "the choices: give a non-empty list of strings"),
        (Constraint("grammar", 'root ::= "a" | nope'), "the grammar: .*nope"),
        (Constraint("grammar", "start: /(/"), "the grammar"),
        (Constraint("structural_tag", '{"structures": []}'), "the structural tag: give"),
        (Constraint("json", '{"type": "string", "format": "colour"}'), "the JSON schema: .*colour"),
    ],
)
async def test_bad_constraints_are_refused_naming_the_problem(
    tokenizer: PreTrainedTokenizerBase, constraint: Constraint, error: str
) -> None:
    with pytest.raises(ValueError, match="(?s)" + error):
        await compiler(tokenizer).compile(constraint)


async def test_verdicts_are_cached_and_a_slow_compile_is_refused(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    check = compiler(tokenizer)
    good = Constraint("json", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    await check.compile(good)
    await check.compile(Constraint("json", good.source))  # the same constraint: cached
    with pytest.raises(ValueError, match="regex"):
        await check.compile(Constraint("regex", "("))
    assert len(check._verdicts) == 2
    hurried = compiler(tokenizer, deadline=0.0)
    with pytest.raises(ValueError, match="did not compile within 0 s"):
        await hurried.compile(good)
    assert not hurried._verdicts  # under less load it may compile: not remembered


def test_constraints_check_what_needs_no_compiler() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="at most 131072"):
        Constraint("regex", "a" * (MAX_SOURCE_CHARS + 1))
    with pytest.raises(ValueError, match="is empty"):
        Constraint("regex", " ")
    with pytest.raises(ValueError, match="not both"):
        Constraint("json_object", compact=True, whitespace_pattern=" ")
    assert SamplingParams(constraint=Constraint("json_object")).constraint is not None


def test_strict_closes_every_object_that_does_not_say() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        "$defs": {"c": {"type": "object", "properties": {}, "additionalProperties": True}},
    }
    grammar = json.loads(grammar_text(Constraint("json", json.dumps(schema), strict=True)))
    compiled = grammar["grammars"][0]["json_schema"]
    assert compiled["additionalProperties"] is False
    assert compiled["properties"]["a"]["additionalProperties"] is False
    assert compiled["$defs"]["c"]["additionalProperties"] is True  # it says
    loose = json.loads(grammar_text(Constraint("json", json.dumps(schema))))
    assert "additionalProperties" not in loose["grammars"][0]["json_schema"]


def test_json_whitespace_is_bounded_unless_asked_otherwise() -> None:
    def options(constraint: Constraint) -> dict:
        return json.loads(grammar_text(constraint))["grammars"][0]["json_schema"]["x-guidance"]

    assert options(Constraint("json_object"))["whitespace_pattern"].endswith("{1,16}")
    assert options(Constraint("json_object", compact=True)) == {"whitespace_flexible": False}
    pattern = Constraint("json", '{"type": "object"}', whitespace_pattern="[ ]?")
    assert options(pattern)["whitespace_pattern"] == "[ ]?"
    # the depth cap applies before llguidance sees the schema
    deep: dict = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nested deeper"):
        grammar_text(Constraint("json", json.dumps(deep)))


# -- the worker's matchers ---------------------------------------------------------------


def seq(constraint: Constraint, output: list[int] | None = None) -> WorkerSeq:
    params = SamplingParams(constraint=constraint)
    return WorkerSeq([*PROMPT, *(output or [])], len(PROMPT), 0, [], params, 0)


def allowed(masks: GrammarMasks, seqs: list[WorkerSeq]) -> list[set[int]]:
    """The tokens each sequence may sample next (row i for seqs[i]; ids 0, 1, ...)."""
    ids = list(range(len(seqs)))
    job = masks.start(ids, seqs)
    assert job is not None
    logits = torch.zeros((len(seqs), VOCAB))
    masks.apply(logits, job)
    masks.keep_one(logits, job)
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def greedy_walk(
    masks: GrammarMasks, tokenizer: PreTrainedTokenizerBase, s: WorkerSeq, steps: int
) -> None:
    """Sample `steps` tokens for sequence 0: each time the allowed token of the longest text."""
    for _ in range(steps):
        (options,) = allowed(masks, [s])
        s.token_ids.append(max(options, key=lambda t: (len(tokenizer.decode([t])), -t)))


def test_a_matcher_follows_its_sequence_and_ends_with_eos(
    llama_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    masks = GrammarMasks(str(llama_dir), VOCAB, frozenset({EOS}))
    choice = Constraint("choice", '["the tuple", "a list"]')
    s = seq(choice)
    masks.arrive(0, s)
    first = allowed(masks, [s])[0]
    assert EOS not in first and all(
        "the tuple".startswith(t) or "a list".startswith(t)
        for t in tokenizer.batch_decode([[t] for t in first])
    )
    greedy_walk(masks, tokenizer, s, 12)
    text = tokenizer.decode(s.token_ids[len(PROMPT) :], skip_special_tokens=True)
    assert text in ("the tuple", "a list")
    assert s.token_ids[-1] == EOS and allowed(masks, [s]) == [{EOS}]  # complete: EOS only


def test_a_preempted_sequence_fast_forwards_its_new_matcher_once(
    llama_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Released, then back as a NewSeq with all its tokens: its new matcher consumes its
    output once, and allows what the old one would have; n samples have their own."""
    masks = GrammarMasks(str(llama_dir), VOCAB, frozenset({EOS}))
    regex = Constraint("regex", "[a-z]{1,3}-[0-9]{1,3}-[a-z]{1,3}")
    walked, other = seq(regex), seq(regex)
    masks.arrive(0, walked)
    greedy_walk(masks, tokenizer, walked, 3)
    masks.leave(0)  # preempted
    back = seq(regex, walked.token_ids[len(PROMPT) :])
    masks.arrive(0, back)
    masks.arrive(1, other)  # a sibling sample: a fresh matcher of its own
    again = allowed(masks, [back, other])
    assert again == allowed(masks, [back, other])  # no token consumed twice
    masks.leave(0)
    masks.arrive(0, walked)
    assert allowed(masks, [walked, other]) == again
    assert again[1] != again[0]


def test_a_row_left_with_nothing_ends(llama_dir: Path) -> None:
    """A matcher that rejects a token (only a row the request's own masks emptied samples
    one) allows EOS alone from then on; it never takes the worker down."""
    masks = GrammarMasks(str(llama_dir), VOCAB, frozenset({EOS}))
    s = seq(Constraint("regex", "[0-9]+"), [EOS + 1000])  # not a digit
    masks.arrive(0, s)
    assert allowed(masks, [s]) == [{EOS}]
    job = masks.start([0], [s])
    assert job is not None
    logits = torch.full((1, VOCAB), -torch.inf)  # e.g. min_tokens banned the grammar's EOS
    masks.keep_one(logits, job)
    assert logits[0, EOS] == 0
    assert masks.start([5], [s]) is None  # an unconstrained row: nothing to do


async def test_grammars_of_every_kind_compile(tokenizer: PreTrainedTokenizerBase) -> None:
    tag = {
        "structures": [{"begin": "<call=f>", "schema": {"type": "object"}, "end": "</call>"}],
        "triggers": ["<call="],
    }
    check = compiler(tokenizer)
    for constraint in (
        Constraint("grammar", 'root ::= "(" [0-9]+ ")"'),  # GBNF
        Constraint("grammar", 'start: "a" b\nb: /[0-9]+/'),  # Lark
        Constraint("structural_tag", json.dumps(tag)),
        Constraint("choice", '["x", "y"]'),
        Constraint("json_object", strict=True),
    ):
        await check.compile(constraint)
