"""Turns a request's raw tokens into `RequestOutput`s: text, stop strings, stop tokens, and
the log-probabilities the request asked for in the shape clients read."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from runtime.config.sampling import SamplingParams
from runtime.frontend.detokenizer import IncrementalDetokenizer
from runtime.frontend.request_stream import TokenOutput
from runtime.frontend.stop_strings import StopStringMatcher
from runtime.protocol import PromptLogprob, RequestOutput, TopLogprobs
from runtime.wire.messages import Logprobs


class OutputProcessor:
    """Per-request state in the frontend: the detokenizer and the stop-string matcher."""

    def __init__(
        self,
        rid: str,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        index: int = 0,
    ) -> None:
        self.rid = rid
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        self._stops = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None
        )
        self._num_output_tokens = 0

    def process(self, raw: TokenOutput) -> RequestOutput:
        """Text for `raw`'s tokens. A stop string ends the request at the token completing it."""
        token_ids, logprobs, reason = raw.token_ids, raw.logprobs, raw.finish_reason
        matched: str | int | None = None
        if reason == "stop" and token_ids:  # an EOS or stop token: its text is not output
            matched = token_ids[-1]
        text_ids = token_ids[:-1] if matched is not None else token_ids
        if self._stops is None:
            text = "".join(self._detokenizer.push(t) for t in text_ids)
        else:
            pieces = []
            for i, token_id in enumerate(text_ids):
                piece = self._detokenizer.push(token_id)
                if self._num_output_tokens + i < self.params.min_tokens:
                    pieces.append(piece)  # too early to stop: vLLM searches only what follows
                    continue
                final = reason is not None and i == len(text_ids) - 1
                piece, stop = self._stops.feed(piece, final)
                pieces.append(piece)
                if stop is not None:  # ends here; later tokens of this batch are dropped
                    token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1]
                    reason, matched = "stop", stop
                    break
            else:
                if reason is not None and not text_ids:
                    pieces.append(self._stops.feed("", True)[0])  # release what was held
            text = "".join(pieces)
        self._num_output_tokens += len(token_ids)
        return RequestOutput(
            rid=self.rid,
            token_ids=token_ids,
            logprobs=logprobs,
            text=text,
            finish_reason=reason,
            matched_stop=matched,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=raw.num_cached_tokens,
            index=self.index,
            top_logprobs=self._top(raw.top, len(token_ids)),
            prompt_logprobs=self._prompt(raw.prompt),
        )

    def _top(self, top: list[Logprobs | None] | None, count: int) -> list[TopLogprobs] | None:
        if self.params.logprobs is None:
            return None
        entries = (top or [])[:count]
        return [_pairs(entry.top_ids, entry.top_logprobs) if entry else () for entry in entries] + [
            () for _ in range(count - len(entries))
        ]

    def _prompt(self, prompt: Logprobs | None) -> list[PromptLogprob] | None:
        """One entry per prompt position from `prompt_logprobs_start` on (the worker scores
        positions from 1 on: nothing comes before the first token)."""
        if prompt is None:
            return None
        ids, k = self.prompt_token_ids, prompt.num_top
        entries = [
            PromptLogprob(ids[p], None, None)
            for p in range(self.params.prompt_logprobs_start, prompt.first_position)
        ]
        for i, logprob in enumerate(prompt.token_logprobs):
            top = _pairs(
                prompt.top_ids[i * k : (i + 1) * k], prompt.top_logprobs[i * k : (i + 1) * k]
            )
            entries.append(PromptLogprob(ids[prompt.first_position + i], logprob, top))
        return entries


def _pairs(ids: Sequence[int], logprobs: Sequence[float]) -> TopLogprobs:
    return tuple(zip(ids, logprobs, strict=True))
