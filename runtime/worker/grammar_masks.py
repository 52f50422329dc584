"""The token masks of constrained sequences (structured output), made where tokens are sampled.

With two steps in flight the scheduler plans step t+1 before token t is known, so only the
worker that samples (tensor-parallel rank 0) can know where a sequence stands in its grammar:
it keeps one llguidance matcher per constrained sequence. While each step's forward pass runs,
a thread advances the matchers of the sequences that sample in it through the tokens they
sampled since (llguidance releases the GIL) and writes their bitmasks; the sampler then sets
the logits of the tokens a grammar forbids to -inf. Rows of unconstrained sequences are never
touched, and a step without a constrained row costs nothing here.

A matcher is dropped with its sequence's worker state (finished, aborted, or preempted). A
sequence back from preemption arrives with all its tokens, and its new matcher is advanced
through its output once, in its first step: a matcher counts the tokens it has consumed, so
no token is consumed twice. The n samples of a request each get their own copy of a matcher
compiled once per constraint.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from runtime.config.constraint import Constraint
from runtime.structured import grammar_text, ll_tokenizer, new_matcher
from runtime.worker.seq_table import WorkerSeq

log = logging.getLogger(__name__)

TEMPLATES = 64  # compiled constraints kept, each copied for every sequence that uses it


@dataclass(slots=True)
class _State:
    matcher: LLMatcher | None = None  # built in the sequence's first step that samples
    consumed: int = 0  # output tokens the matcher has consumed
    failed: bool = False  # the matcher broke (it never should): the sequence may only end


@dataclass(slots=True)
class MaskJob:
    """One step's masks, being made: `rows` are sampled rows, `forbidden` [rows, vocab] bool."""

    rows: list[int]
    forbidden: Future[np.ndarray]


class GrammarMasks:
    """The matchers of one worker's constrained sequences, and the masks they make."""

    def __init__(self, model: str, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._model = model  # the checkpoint whose tokenizer the matchers read
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._states: dict[int, _State] = {}
        self._templates: OrderedDict[Constraint, LLMatcher] = OrderedDict()
        self._tokenizer: LLTokenizer | None = None
        self._thread: ThreadPoolExecutor | None = None

    def arrive(self, seq_id: int, seq: WorkerSeq) -> None:
        if seq.params.constraint is not None:
            self._states[seq_id] = _State()

    def leave(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def start(self, seq_ids: Sequence[int], seqs: Sequence[WorkerSeq]) -> MaskJob | None:
        """Begin the masks of the constrained ones among a step's sampling sequences (row i
        samples for `seqs[i]`); None if there are none."""
        if not self._states:
            return None
        rows = [i for i, seq_id in enumerate(seq_ids) if seq_id in self._states]
        if not rows:
            return None
        work = [(self._states[seq_ids[i]], seqs[i]) for i in rows]
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return MaskJob(rows, self._thread.submit(self._fill, work))

    def apply(self, logits: torch.Tensor, job: MaskJob) -> None:
        """Forbidden tokens of the job's rows of `logits` [rows, vocab] to -inf (in place)."""
        forbidden = torch.from_numpy(job.forbidden.result()).to(logits.device)
        if len(job.rows) == logits.shape[0]:  # every row constrained: no gather, no copy
            logits.masked_fill_(forbidden, -torch.inf)
            return
        index = torch.tensor(job.rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, -torch.inf)

    def keep_one(self, logits: torch.Tensor, job: MaskJob) -> None:
        """A row the grammar and the request's own masks together left with no token at all
        (e.g. min_tokens bans EOS where the grammar allows only EOS) ends: EOS gets 0."""
        if not self.eos_token_ids:
            return
        index = torch.tensor(job.rows, dtype=torch.long, device=logits.device)
        eos = self.eos_token_ids[0]
        dead = torch.isneginf(logits[index].amax(dim=-1))
        logits[index, eos] = torch.where(dead, 0.0, logits[index, eos])

    # -- in the mask thread --------------------------------------------------------------

    def _fill(self, work: list[tuple[_State, WorkerSeq]]) -> np.ndarray:
        words = (self.vocab_size + 31) // 32
        masks = np.zeros((len(work), words), dtype=np.uint32)  # bit t of word t // 32: token t
        for row, (state, seq) in enumerate(work):
            if not state.failed:
                try:
                    self._advance(state, seq)
                    assert state.matcher is not None
                    state.matcher.unsafe_compute_mask_ptr(masks[row].ctypes.data, 4 * words)
                except Exception:  # never the worker's end: this sequence alone stops
                    log.exception("structured output: a matcher failed; its sequence ends")
                    state.failed = True
            if state.failed:
                masks[row] = 0
                for eos in self.eos_token_ids:
                    masks[row, eos // 32] |= np.uint32(1 << (eos % 32))
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
        return np.logical_not(bits[:, : self.vocab_size])  # here, not on the step's thread

    def _advance(self, state: _State, seq: WorkerSeq) -> None:
        """The matcher through the sequence's output tokens it has not consumed yet."""
        if state.matcher is None:
            constraint = seq.params.constraint
            assert constraint is not None
            state.matcher = self._template(constraint).deep_copy()
        matcher = state.matcher
        new = seq.token_ids[seq.num_prompt_tokens + state.consumed :]
        state.consumed += len(new)
        if new and not matcher.is_stopped() and not matcher.consume_tokens(new):
            # the mask allowed only what the grammar does: a token it rejects came from a
            # row left with nothing allowed (keep_one's EOS) or from a bug
            log.warning("structured output: %s", matcher.get_error()[:200])
            state.failed = True

    def _template(self, constraint: Constraint) -> LLMatcher:
        template = self._templates.get(constraint)
        if template is None:
            template = new_matcher(self._ll_tokenizer(), grammar_text(constraint))
            self._templates[constraint] = template
            if len(self._templates) > TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(constraint)
        return template

    def _ll_tokenizer(self) -> LLTokenizer:
        """Built on first use (0.2-1 s): a worker that never sees a constraint never pays."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # the frontend's tokenizer, the same way

            backend = AutoTokenizer.from_pretrained(self._model).backend_tokenizer
            self._tokenizer = ll_tokenizer(backend.to_str(), self.vocab_size, self.eos_token_ids)
        return self._tokenizer
