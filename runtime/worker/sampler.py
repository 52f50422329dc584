"""Batched sampling: greedy, temperature, top-k, top-p and min-p, reproducible per request.

Randomness comes from a counter-based hash of (request seed, output position), not from a shared
generator, so a seeded request draws the same numbers whether it runs alone, in a batch of 64,
or again after preemption. One uniform number per row is enough: we sample by inverting the
cumulative distribution of the filtered probabilities, sorted from most to least likely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from runtime.kernels.select import Kernels, SamplingKernels
from runtime.worker.transfer import device_tensor

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A well-mixed 64-bit hash of a 64-bit integer (Steele et al., SplitMix64 finalizer)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A number in (0, 1) determined by the request's seed and the output position alone."""
    bits = splitmix64(splitmix64(seed & _MASK64) ^ position)
    return ((bits >> 11) + 0.5) / (1 << 53)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters of one step, as tensors on the sampling device."""

    temperature: torch.Tensor  # [B] float; rows with 0 are greedy
    top_k: torch.Tensor  # [B] long; 0 = all
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    uniforms: torch.Tensor  # [B] float64 in (0, 1)
    all_greedy: bool
    needs_filter: bool  # some row uses top-k, top-p or min-p


def make_sampling_batch(
    rows: list[tuple[float, int, float, float, int, int]], device: torch.device
) -> SamplingBatch:
    """rows: (temperature, top_k, top_p, min_p, seed, output position) per sampled sequence."""
    temperature, top_k, top_p, min_p, seeds, positions = zip(*rows, strict=True)
    all_greedy = all(t == 0.0 for t in temperature)
    return SamplingBatch(
        temperature=device_tensor(temperature, torch.float32, device),
        top_k=device_tensor(top_k, torch.long, device),
        top_p=device_tensor(top_p, torch.float32, device),
        min_p=device_tensor(min_p, torch.float32, device),
        uniforms=device_tensor(
            [0.5 if all_greedy else uniform(s, p) for s, p in zip(seeds, positions, strict=True)],
            dtype=torch.float64,
            device=device,
        ),
        all_greedy=all_greedy,
        needs_filter=any(k > 0 for k in top_k)
        or any(p < 1.0 for p in top_p)
        or any(m > 0.0 for m in min_p),
    )


def sample(
    logits: torch.Tensor, batch: SamplingBatch, kernels: Kernels | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [B, vocab] (float32).

    Returns (token ids [B], their log-probabilities under the unmodified model distribution).
    """
    if kernels is not None and batch.all_greedy and logits.is_contiguous():
        return kernels.greedy(logits)  # one pass for the argmax, one for the log-sum-exp
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = draw(logits, batch, kernels)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def draw(logits: torch.Tensor, batch: SamplingBatch, kernels: Kernels | None) -> torch.Tensor:
    """The token ids [B] `choose` picks: by the kernels where they sample (no sort)."""
    fits = logits.dtype == torch.float32 and logits.stride(-1) == 1  # rows may be strided
    if batch.all_greedy:
        if kernels is not None and logits.is_contiguous() and fits:
            return kernels.greedy(logits)[0]  # torch's argmax: a scalar loop, 2x slower on CPU
        return logits.argmax(dim=-1)
    if kernels is not None and kernels.samples and fits:
        b = batch
        sampler = cast(SamplingKernels, kernels)
        return sampler.sample(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.uniforms)
    tokens, _ = choose(logits, batch)
    return tokens


def choose(
    logits: torch.Tensor, batch: SamplingBatch, *, processed: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B] and, if `processed`, the log-probabilities [B, vocab] of the
    distribution they were drawn from: after temperature and the filters (greedy rows: of
    the logits as given, as vLLM's processed logprobs)."""
    greedy = logits.argmax(dim=-1)
    plain = torch.log_softmax(logits, dim=-1) if processed else None
    if batch.all_greedy:
        return greedy, plain
    temperature = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    # stable: equal probabilities in index order, so a seeded draw among ties is the same on
    # every device and in the Triton sampler (runtime/kernels/gpu_sampling.py)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    if batch.needs_filter:
        sorted_probs = _filter(sorted_probs, batch)
    cdf = sorted_probs.double().cumsum(dim=-1)
    target = (batch.uniforms * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).clamp_(max=logits.shape[-1] - 1)
    sampled = order.gather(-1, index).squeeze(-1)
    tokens = torch.where(batch.temperature > 0, sampled, greedy)
    if plain is None:
        return tokens, None
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    drawn_from = torch.log(kept / kept.sum(dim=-1, keepdim=True))
    return tokens, torch.where(batch.temperature[:, None] > 0, drawn_from, plain)


def _filter(sorted_probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero out what min-p, then top-k, then top-p exclude (probabilities sorted descending).

    vLLM's (v1) order: min-p is measured against the most likely token of the whole
    distribution, and top-p against what min-p and top-k leave, renormalized.
    """
    threshold = batch.min_p[:, None] * sorted_probs[:, :1]
    sorted_probs = sorted_probs.masked_fill(sorted_probs < threshold, 0.0)
    vocab = sorted_probs.shape[-1]
    rank = torch.arange(vocab, device=sorted_probs.device)[None, :]
    k = torch.where(batch.top_k > 0, batch.top_k, vocab)[:, None]
    sorted_probs = sorted_probs.masked_fill(rank >= k, 0.0)
    # the most likely token always stays; masses in float64, as the draw's (a tail of tiny
    # probabilities below float32's precision still counts, as in the Triton sampler)
    mass = sorted_probs.double()
    before = (mass.cumsum(dim=-1) - mass) / mass.sum(dim=-1, keepdim=True)
    top_p = batch.top_p[:, None].double()
    drop = (before >= top_p) & (top_p < 1.0)  # 1.0: keep all, exactly
    return sorted_probs.masked_fill(drop, 0.0)
