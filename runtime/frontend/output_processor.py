"""Turns a request's raw tokens into `RequestOutput`s: text, stop strings, stop tokens."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from runtime.engine_client import RequestOutput
from runtime.frontend.detokenizer import IncrementalDetokenizer
from runtime.frontend.request_stream import TokenOutput
from runtime.frontend.stop_strings import StopStringMatcher
from runtime.sampling_params import SamplingParams


class OutputProcessor:
    """Per-request state in the frontend: the detokenizer and the stop-string matcher."""

    def __init__(
        self,
        rid: str,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self.rid = rid
        self.num_prompt_tokens = len(prompt_token_ids)
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(params.stop) if params.stop else None

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
                final = reason is not None and i == len(text_ids) - 1
                piece, stop = self._stops.feed(self._detokenizer.push(token_id), final)
                pieces.append(piece)
                if stop is not None:  # ends here; later tokens of this batch are dropped
                    token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1]
                    reason, matched = "stop", stop
                    break
            else:
                if reason is not None and not text_ids:
                    pieces.append(self._stops.feed("", True)[0])  # release what was held
            text = "".join(pieces)
        return RequestOutput(
            rid=self.rid,
            token_ids=token_ids,
            logprobs=logprobs,
            text=text,
            finish_reason=reason,
            matched_stop=matched,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=raw.num_cached_tokens,
        )
