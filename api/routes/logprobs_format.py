"""Log-probabilities in the shapes clients read: OpenAI's completions and chat, SGLang's
`meta_info`. Tokens are named by their own text (`EngineClient.token_texts`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.protocol import EngineClient, PromptLogprob, TopLogprobs

# JSON has no -Infinity: vLLM writes a token that cannot be sampled as -9999.0
FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class Scored:
    """One position: its token, that token's log-probability (None: nothing scores the
    first prompt token), and the most likely tokens there."""

    token_id: int
    logprob: float | None
    top: TopLogprobs | None


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def generated(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[TopLogprobs] | None
) -> list[Scored]:
    tops = top or [()] * len(token_ids)
    return [Scored(*entry) for entry in zip(token_ids, logprobs, tops, strict=True)]


def prompt(entries: Sequence[PromptLogprob]) -> list[Scored]:
    return [Scored(e.token_id, e.logprob, e.top) for e in entries]


def _texts(engine: EngineClient, scored: Sequence[Scored]) -> dict[int, str]:
    ids = {s.token_id for s in scored} | {t for s in scored for t, _ in s.top or ()}
    ids_list = sorted(ids)
    return dict(zip(ids_list, engine.token_texts(ids_list), strict=True))


def completion(
    engine: EngineClient, scored: Sequence[Scored], num_top: int, text_offset: int = 0
) -> dict[str, Any]:
    """`choices[].logprobs` of /v1/completions. As vLLM: each position's `top_logprobs`
    holds its token first, then the most likely others, `num_top + 1` entries at most
    (tokens with the same text share an entry); offsets add up the token texts."""
    texts = _texts(engine, scored)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for s in scored:
        text = texts[s.token_id]
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if s.logprob is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(s.logprob))
        top = {text: _finite(s.logprob)}
        for token_id, logprob in s.top or ():
            if len(top) > num_top:
                break
            if token_id != s.token_id:
                top.setdefault(texts[token_id], _finite(logprob))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat(engine: EngineClient, scored: Sequence[Scored]) -> dict[str, Any]:
    """`choices[].logprobs` of /v1/chat/completions: `content`, one entry per token, with its
    raw `bytes` (a token that is only part of a character has them, and the text "", as
    vLLM names it) and the most likely tokens."""
    texts = _texts(engine, scored)
    ids = sorted(texts)
    raw = dict(zip(ids, engine.token_bytes(ids), strict=True))

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts[token_id], "logprob": _finite(logprob), "bytes": list(raw[token_id])}

    content = []
    for s in scored:
        item = entry(s.token_id, s.logprob if s.logprob is not None else FLOOR)
        item["top_logprobs"] = [entry(t, lp) for t, lp in s.top or ()]
        content.append(item)
    return {"content": content}


def sglang(
    engine: EngineClient, scored: Sequence[Scored], with_text: bool
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's `*_token_logprobs` ([logprob, id, text]) and `*_top_logprobs`."""
    texts = _texts(engine, scored) if with_text else {}
    tokens = [
        [None if s.logprob is None else _finite(s.logprob), s.token_id, texts.get(s.token_id)]
        for s in scored
    ]
    tops: list[list[list[Any]] | None] = [
        None if s.logprob is None else [[_finite(lp), t, texts.get(t)] for t, lp in s.top or ()]
        for s in scored
    ]
    return tokens, tops
