from __future__ import annotations

import torch

from runtime.worker.sampler import make_sampling_batch, sample, uniform

CPU = torch.device("cpu")


def rows(
    n: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
) -> list[tuple[float, int, float, float, int, int]]:
    return [(temperature, top_k, top_p, min_p, seed, i) for i in range(n)]


def test_uniform_is_open_interval_and_deterministic() -> None:
    values = [uniform(seed, pos) for seed in range(50) for pos in range(50)]
    assert all(0.0 < v < 1.0 for v in values)
    assert values == [uniform(seed, pos) for seed in range(50) for pos in range(50)]
    assert 0.45 < sum(values) / len(values) < 0.55


def test_greedy_is_argmax_with_raw_logprobs() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample(logits, make_sampling_batch(rows(5, temperature=0.0), CPU))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, expected)


def test_filters_that_leave_one_token_equal_greedy() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1).tolist()
    for kwargs in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        tokens, _ = sample(logits, make_sampling_batch(rows(6, **kwargs), CPU))
        assert tokens.tolist() == greedy, kwargs


def test_top_k_and_top_p_only_pick_allowed_tokens() -> None:
    logits = torch.linspace(0, 5, 20).repeat(400, 1)  # same distribution in every row
    probs = torch.softmax(logits[0], -1)
    tokens, _ = sample(logits, make_sampling_batch(rows(400, top_k=3), CPU))
    assert set(tokens.tolist()) <= {17, 18, 19}
    tokens, _ = sample(logits, make_sampling_batch(rows(400, top_p=0.5), CPU))
    order = probs.argsort(descending=True).tolist()
    keep = next(i for i in range(20) if probs[order[: i + 1]].sum() >= 0.5) + 1
    assert set(tokens.tolist()) <= set(order[:keep])


def test_min_p_applies_before_top_k_and_top_p_as_in_vllm() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log().repeat(1000, 1)
    # min-p 0.5 drops 0.2 (< 0.25); top-p 0.6 then sees {0.625, 0.375} and keeps the first alone
    tokens, _ = sample(logits, make_sampling_batch(rows(1000, top_p=0.6, min_p=0.5), CPU))
    assert set(tokens.tolist()) == {0}
    # without min-p, top-p 0.6 needs the two most likely tokens of {0.5, 0.3, 0.2}
    tokens, _ = sample(logits, make_sampling_batch(rows(1000, top_p=0.6), CPU))
    assert set(tokens.tolist()) == {0, 1}


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    tokens, _ = sample(logits, make_sampling_batch(rows(4000, seed=7), CPU))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(2000, 1)
    cold, _ = sample(logits, make_sampling_batch(rows(2000, temperature=0.2), CPU))
    hot, _ = sample(logits, make_sampling_batch(rows(2000, temperature=2.0), CPU))
    assert (cold == 0).float().mean() > 0.95
    assert (hot == 0).float().mean() < 0.6


def test_a_row_draws_the_same_token_whatever_its_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 64, generator=gen)
    params = [(0.8, 0, 0.9, 0.0, 1000 + i, 5) for i in range(16)]
    together, _ = sample(logits, make_sampling_batch(params, CPU))
    alone = [
        sample(logits[i : i + 1], make_sampling_batch([params[i]], CPU))[0].item()
        for i in range(16)
    ]
    assert together.tolist() == alone


def test_greedy_picks_stand_where_processors_only_ban_other_tokens() -> None:
    """The one-pass greedy pick is kept for steps whose processors only ban tokens
    (min_tokens' stops, bad words), unless a row's pick is one of them."""
    from runtime.config.sampling import SamplingParams
    from runtime.worker.logits_processors import LogitsProcessors
    from runtime.worker.seq_table import WorkerSeq

    processors = LogitsProcessors(10, frozenset({2}), torch.device("cpu"))

    def seq(**params: object) -> WorkerSeq:
        p = SamplingParams(temperature=0.0, max_tokens=8, **params)  # type: ignore[arg-type]
        return WorkerSeq([5, 6], 2, 2, [0], p, seed=0)

    waiting = seq(min_tokens=3, stop_token_ids=(7,))  # 2 (EOS) and 7 banned
    banned_words = seq(bad_words_token_ids=((4,),))
    processors.arrive(0, waiting)
    processors.arrive(1, banned_words)
    assert processors.only_bans([waiting, banned_words])
    assert not processors.bans_any([0, 1], [waiting, banned_words], [3, 5])
    assert processors.bans_any([0, 1], [waiting, banned_words], [7, 5])
    assert processors.bans_any([0, 1], [waiting, banned_words], [3, 4])
    assert not processors.only_bans([waiting, seq(logit_bias=((3, 1.0),))])
    assert not processors.only_bans([seq(repetition_penalty=1.2)])
