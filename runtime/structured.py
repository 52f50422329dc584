"""llguidance behind a small interface, for the two processes that use it: a constraint's
grammar, the parser's limits, the tokenizer it masks, and a matcher checked for errors.

The frontend builds a matcher once per new constraint to refuse it early (a 400 naming what
is wrong); the worker that samples builds the same one for each constrained sequence. Both
call `grammar_text`, so what the frontend accepted is exactly what the worker runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, StructTag

from runtime.config.constraint import MAX_SCHEMA_DEPTH, Constraint, check_depth, close_objects

# Between JSON tokens: 1 to 16 whitespace characters (or none). llguidance's default,
# `[\x20\x0A\x0D\x09]+`, is unbounded, and a small model at temperature 0 can fill its
# max_tokens with newlines there (vllm#38696, xgrammar#412, sglang#8250). 16 still allows a
# newline and the indentation of pretty-printed JSON seven levels deep.
BOUNDED_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,16}"
MAX_ERROR_CHARS = 500  # of llguidance's message, in the 400 that quotes it
# llguidance's defaults, but for two: its lexer may build at most 50,000 states (each 1-2 kB;
# the default, 250,000, lets one regex claim 500 MB in each process that compiles it), and
# errors leave out the grammar they come from (the client has it; the log need not).
LIMITS = LLParserLimits(max_lexer_states=50_000, verbose_errors=False)


def ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int]) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (its `to_str()` JSON), masking
    `vocab_size` logits (the model's rows, which may outnumber the tokenizer's tokens).
    Takes 0.2-1 s on a 49k vocabulary: build it once per process."""
    eos = sorted(eos_token_ids)
    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for a constraint; ValueError naming what is wrong with it (what
    only compiling can tell comes from `new_matcher`)."""
    kind, source = constraint.kind, constraint.source
    try:
        if kind in ("json", "json_object"):
            return _json_grammar(constraint)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(_choices(source)))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", source)  # GBNF or Lark
        return _structural_tag_grammar(source)
    except ValueError as exc:
        raise ValueError(f"{_NAMES[kind]}: {_short(str(exc))}") from None


def new_matcher(tokenizer: LLTokenizer, grammar: str) -> LLMatcher:
    """A fresh matcher; ValueError if llguidance cannot build it within LIMITS."""
    matcher = LLMatcher(tokenizer, grammar, limits=LIMITS, log_level=0)
    if matcher.is_error():
        raise ValueError(_short(matcher.get_error()))
    return matcher


def check(tokenizer: LLTokenizer, constraint: Constraint) -> str:
    """What is wrong with a constraint ("" if nothing): llguidance builds its matcher and
    its first mask (where a costly regex may first exceed the lexer's limits)."""
    try:
        matcher = new_matcher(tokenizer, grammar_text(constraint))
        matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(_short(matcher.get_error()))
    except ValueError as exc:
        message = str(exc)
        prefix = _NAMES[constraint.kind]
        return message if message.startswith(prefix) else f"{prefix}: {message}"
    return ""


_NAMES = {
    "json": "the JSON schema",
    "json_object": "the JSON object",
    "regex": "the regex",
    "choice": "the choices",
    "grammar": "the grammar",
    "structural_tag": "the structural tag",
}


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


def _json_grammar(constraint: Constraint) -> str:
    schema: Any = {"type": "object"}
    if constraint.kind == "json":
        schema = _load(constraint.source, "not valid JSON")
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema is an object (or true, or false)")
        check_depth(schema)
        if constraint.strict:
            close_objects(schema)
    options: dict[str, Any] = {"whitespace_pattern": constraint.whitespace_pattern}
    if constraint.compact:
        options = {"whitespace_flexible": False}  # "," and ":" alone between tokens
    elif constraint.whitespace_pattern is None:
        options["whitespace_pattern"] = BOUNDED_WHITESPACE
    # overrides, not defaults: the server's whitespace rule holds whatever the schema's own
    # "x-guidance" says
    return LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type, unused-ignore]


def _load(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _choices(source: str) -> list[str]:
    choices = _load(source, "not a JSON list")
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise ValueError("give a non-empty list of strings")
    if not all(choices):
        raise ValueError("a choice is an empty string")
    return choices


def _structural_tag_grammar(source: str) -> str:
    """vLLM's and SGLang's structural tags: free text, in which each trigger starts one of
    the structures (`begin`, then JSON matching `schema`, then `end`)."""
    spec = _load(source, "not valid JSON")
    structures = spec.get("structures") if isinstance(spec, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)):
        raise ValueError('give {"structures": [{"begin", "schema", "end"}...], "triggers": [...]}')
    tags = []
    for s in structures:
        if not (isinstance(s, dict) and all(isinstance(s.get(k), str) for k in ("begin", "end"))):
            raise ValueError("each structure has a string begin and end, and a schema")
        trigger = next((t for t in triggers if isinstance(t, str) and s["begin"].startswith(t)), "")
        if not trigger:
            raise ValueError(f"no trigger starts the structure {s['begin']!r}")
        schema = s.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError("a structure's schema is a JSON schema object")
        check_depth(schema)
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    # with JSON schemas only, a Lark grammar (side grammars come with Lark ones alone)
    return LLMatcher.grammar_from_lark(StructTag.to_grammar(tags))
