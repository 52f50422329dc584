"""Per-request changes to the logits before sampling: masks, bias and penalties.

vLLM v1's order: allowed tokens, bad words, min_tokens, logit bias, then the repetition,
frequency and presence penalties. Temperature and the top-k/top-p/min-p filters come after,
in the sampler. Only rows whose request asks for something are touched, and a step where no
request does never calls this module.

Penalties need each sequence's token counts. They live as rows of two pooled tensors (one row
per penalized sequence, handed out when it arrives and taken back when it leaves) and are
updated by one scatter per step for the tokens just sampled, never rebuilt from the history.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.worker.seq_table import WorkerSeq


class TokenCounts:
    """Generated-token counts and a prompt-token mask per penalized sequence, as pool rows."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.row_of: dict[int, int] = {}  # seq id -> pool row
        self._free: list[int] = []

    def add(self, seq_id: int, seq: WorkerSeq) -> None:
        """Count a sequence's tokens so far (once: on arrival, or back from preemption)."""
        if not self._free:
            self._grow()
        row = self.row_of[seq_id] = self._free.pop()
        prompt = self._ids(seq.token_ids[: seq.num_prompt_tokens])
        output = self._ids(seq.token_ids[seq.num_prompt_tokens :])
        self.counts[row].zero_().index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
        self.in_prompt[row].zero_()[prompt] = True

    def remove(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self._free.append(row)
        if not self.row_of and self.counts.shape[0]:  # nobody penalizes: give the pool back
            self.counts, self.in_prompt = self.counts[:0].clone(), self.in_prompt[:0].clone()
            self._free.clear()

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """One more of each sampled token, for the pool rows that sampled them."""
        ones = torch.ones_like(token_ids, dtype=torch.int32)
        self.counts.index_put_((rows, token_ids), ones, accumulate=True)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        self.counts = torch.cat([self.counts, self.counts.new_zeros((new - old, self.vocab_size))])
        self.in_prompt = torch.cat(
            [self.in_prompt, self.in_prompt.new_zeros((new - old, self.vocab_size))]
        )
        self._free.extend(reversed(range(old, new)))

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)


class LogitsProcessors:
    """The worker's per-sequence state for the processors, and their batched application."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], device: torch.device):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.device = device
        self.counts = TokenCounts(vocab_size, device)
        self.asking: set[int] = set()  # seq ids whose requests change logits or want top ones
        self._allowed: dict[int, torch.Tensor] = {}  # seq id -> [vocab] bool, made once
        # seq id -> (one-token bad words, longer ones by the token before their last)
        self._bad_words: dict[int, tuple[list[int], dict[int, list[tuple[int, ...]]]]] = {}

    def arrive(self, seq_id: int, seq: WorkerSeq) -> None:
        params = seq.params
        if params.processes_logits or params.logprobs is not None:
            self.asking.add(seq_id)
        if params.bad_words_token_ids:
            single = [w[0] for w in params.bad_words_token_ids if len(w) == 1]
            longer: dict[int, list[tuple[int, ...]]] = {}
            for word in params.bad_words_token_ids:
                if len(word) > 1:
                    longer.setdefault(word[-2], []).append(word)
            self._bad_words[seq_id] = (single, longer)
        if params.penalizes:
            self.counts.add(seq_id, seq)
        if params.allowed_token_ids is not None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[list(params.allowed_token_ids)] = True
            self._allowed[seq_id] = mask

    def leave(self, seq_id: int) -> None:
        self.asking.discard(seq_id)
        self.counts.remove(seq_id)
        self._allowed.pop(seq_id, None)
        self._bad_words.pop(seq_id, None)

    def apply(
        self, logits: torch.Tensor, seq_ids: Sequence[int], seqs: Sequence[WorkerSeq]
    ) -> None:
        """Change `logits` [rows, vocab] in place; row i samples for `seqs[i]`."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.processes_logits]
        allowed = [i for i in rows if seq_ids[i] in self._allowed]
        if allowed:
            masks = torch.stack([self._allowed[seq_ids[i]] for i in allowed])
            index = self._tensor(allowed)
            logits[index] = logits[index].masked_fill(~masks, -torch.inf)
        banned_rows, banned_ids = self._banned(rows, seq_ids, seqs)
        if banned_rows:
            logits[self._tensor(banned_rows), self._tensor(banned_ids)] = -torch.inf
        bias = [(i, t, b) for i in rows for t, b in seqs[i].params.logit_bias]
        if bias:
            b_rows, b_ids, b_values = zip(*bias, strict=True)
            values = torch.tensor(b_values, dtype=logits.dtype, device=self.device)
            logits.index_put_((self._tensor(b_rows), self._tensor(b_ids)), values, accumulate=True)
        penalized = [i for i in rows if seqs[i].params.penalizes]
        if penalized:
            self._penalize(logits, penalized, [seq_ids[i] for i in penalized], seqs)

    @staticmethod
    def only_bans(seqs: Sequence[WorkerSeq]) -> bool:
        """Whether the processors at most ban tokens for these rows (min_tokens' stops, bad
        words): nothing that moves the other logits (penalties, bias, an allowed set)."""
        return not any(
            p.penalizes or p.logit_bias or p.allowed_token_ids is not None
            for p in (seq.params for seq in seqs)
        )

    def bans_any(
        self, seq_ids: Sequence[int], seqs: Sequence[WorkerSeq], tokens: list[int]
    ) -> bool:
        """Whether the processors ban row i's `tokens[i]` for some row."""
        banned_rows, banned_ids = self._banned(list(range(len(seqs))), seq_ids, seqs)
        return any(tokens[i] == t for i, t in zip(banned_rows, banned_ids, strict=True))

    def record(
        self, seq_ids: Sequence[int], seqs: Sequence[WorkerSeq], tokens: torch.Tensor
    ) -> None:
        """Count what was sampled (row i for `seqs[i]`) for the sequences with penalties."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.penalizes]
        if rows:
            pool_rows = self._tensor([self.counts.row_of[seq_ids[i]] for i in rows])
            self.counts.record(pool_rows, tokens[self._tensor(rows)])

    def _banned(
        self, rows: list[int], seq_ids: Sequence[int], seqs: Sequence[WorkerSeq]
    ) -> tuple[list[int], list[int]]:
        """(row, token) pairs that must not be sampled: bad words, and stops before min_tokens."""
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i in rows:
            seq, params = seqs[i], seqs[i].params
            bad_words = self._bad_words.get(seq_ids[i])
            if bad_words is not None:
                banned = self._bad_word_ends(seq, *bad_words)
                banned_rows.extend([i] * len(banned))
                banned_ids.extend(banned)
            if seq.num_output_tokens < params.min_tokens:
                stops = set(params.stop_token_ids).union(self.eos_token_ids)
                banned_rows.extend([i] * len(stops))
                banned_ids.extend(stops)
        return banned_rows, banned_ids

    @staticmethod
    def _bad_word_ends(
        seq: WorkerSeq, single: list[int], longer: dict[int, list[tuple[int, ...]]]
    ) -> list[int]:
        """vLLM's rule: a word's last token is banned when the output ends with the rest of
        it. Only words whose token before last is the output's last token are compared."""
        banned = list(single)
        num_output = seq.num_output_tokens
        if num_output:
            for word in longer.get(seq.token_ids[-1], ()):
                prefix = len(word) - 1
                if num_output >= prefix and tuple(seq.token_ids[-prefix:]) == word[:-1]:
                    banned.append(word[-1])
        return banned

    def _penalize(
        self,
        logits: torch.Tensor,
        rows: list[int],
        seq_ids: list[int],
        seqs: Sequence[WorkerSeq],
    ) -> None:
        """Repetition (prompt and output, Hugging Face's definition), then frequency and
        presence (output only, OpenAI's definition)."""
        params = [seqs[i].params for i in rows]
        index = self._tensor(rows)
        pool_rows = self._tensor([self.counts.row_of[s] for s in seq_ids])
        counts = self.counts.counts[pool_rows].to(logits.dtype)
        generated = counts > 0
        x = logits[index]
        repetition = self._column([p.repetition_penalty for p in params], logits.dtype)
        seen = generated | self.counts.in_prompt[pool_rows]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x -= self._column([p.frequency_penalty for p in params], logits.dtype) * counts
        x -= self._column([p.presence_penalty for p in params], logits.dtype) * generated
        logits[index] = x

    def _column(self, values: list[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)[:, None]

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
