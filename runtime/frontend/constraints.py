"""Structured-output constraints checked before their request is queued.

Each new constraint is compiled once by llguidance, in a worker thread (llguidance releases
the GIL while it builds), at most `THREADS` at a time, so the event loop and every other
request go on meanwhile; one that is invalid, too large or too slow to compile is a
ValueError naming what is wrong (a 400), and never reaches an actor. The verdicts of the
last `CACHE_SIZE` constraints are kept: an agent sends the same schema again and again.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import trio
from llguidance import LLTokenizer
from transformers import PreTrainedTokenizerBase

from runtime.config.constraint import Constraint
from runtime.structured import check, ll_tokenizer

THREADS = 2  # compiles at once (the API process has other work: tokenizing, detokenizing)
# A schema compiles in 1-11 ms and its first mask in well under one; over this, the grammar
# is refused as too costly (llguidance's fuel limits bound the work itself: runtime/structured.py)
COMPILE_SECONDS = 2.0
CACHE_SIZE = 256


class ConstraintCompiler:
    """Compiles constraints for one tokenizer; the llguidance tokenizer is built on first use."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        deadline: float = COMPILE_SECONDS,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self.deadline = deadline
        self._ll: LLTokenizer | None = None
        self._ll_lock = threading.Lock()
        self._threads = trio.CapacityLimiter(THREADS)
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # digest -> error ("": fine)

    async def compile(self, constraint: Constraint) -> None:
        """Return if llguidance builds a matcher for `constraint` in time; else ValueError."""
        key = hashlib.sha256(repr(constraint).encode("utf-8", "surrogatepass")).digest()
        error = self._verdicts.get(key)
        if error is None:
            # built outside the deadline: the first constrained request pays ~1 s for it once
            await trio.to_thread.run_sync(self.tokenizer, limiter=self._threads)
            with trio.move_on_after(self.deadline):
                error = await trio.to_thread.run_sync(
                    self._compile, constraint, limiter=self._threads, abandon_on_cancel=True
                )  # an abandoned compile keeps its thread, and its place, until it ends
            if error is None:  # not cached: under a lighter load it may well compile in time
                raise ValueError(
                    f"the {constraint.kind} constraint did not compile within "
                    f"{self.deadline:g} s: simplify it"
                )
            self._remember(key, error)
        else:
            self._verdicts.move_to_end(key)
        if error:
            raise ValueError(error)

    def tokenizer(self) -> LLTokenizer:
        """llguidance's tokenizer (blocking: call it from a thread)."""
        with self._ll_lock:
            if self._ll is None:
                backend = getattr(self._tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise ValueError("structured output needs a fast (Rust) tokenizer")
                self._ll = ll_tokenizer(backend.to_str(), self._vocab_size, self._eos_token_ids)
            return self._ll

    def _compile(self, constraint: Constraint) -> str:
        return check(self.tokenizer(), constraint)

    def _remember(self, key: bytes, error: str) -> None:
        self._verdicts[key] = error
        if len(self._verdicts) > CACHE_SIZE:
            self._verdicts.popitem(last=False)
