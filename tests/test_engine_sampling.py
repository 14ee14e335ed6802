"""The embedded engine's sampler (`InferenceEngine._sample`, `_logprobs`) on numbers worked by hand: one batched
draw by inverse CDF, each row from its own seeded generator, so a row's tokens do not depend on its batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from lightning.inference.engine import InferenceEngine, SamplingParams


def row(seed: int, temperature: float = 1.0, top_p: float = 1.0, logprobs: int | None = None) -> SimpleNamespace:
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, logprobs=logprobs)
    return SimpleNamespace(params=params, generator=torch.Generator().manual_seed(seed))


def first_uniform(seed: int) -> float:
    return float(torch.rand((), generator=torch.Generator().manual_seed(seed)))


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def test_a_draw_takes_the_first_token_whose_cumulative_probability_passes_the_rows_uniform() -> None:
    # probs 0.1, 0.2, 0.3, 0.4: cumulative 0.1, 0.3, 0.6, 1.0. A uniform u picks token 0 below 0.1, 1 below 0.3, ...
    probs = [0.1, 0.2, 0.3, 0.4]
    for seed in range(20):
        u = first_uniform(seed)
        expected = next(i for i, edge in enumerate([0.1, 0.3, 0.6, 1.0]) if u < edge)
        assert InferenceEngine._sample(logits_of(probs), [row(seed)]) == [expected], (seed, u)


def test_temperature_divides_the_logits_and_zero_is_the_argmax() -> None:
    # Logits log(0.1), log(0.9) at temperature 2 -> weights sqrt(0.1), sqrt(0.9): probs 0.25, 0.75.
    logits = logits_of([0.1, 0.9])
    for seed in range(20):
        expected = 0 if first_uniform(seed) < 0.25 else 1
        assert InferenceEngine._sample(logits, [row(seed, temperature=2.0)]) == [expected]
    assert InferenceEngine._sample(logits_of([0.6, 0.4]), [row(0, temperature=0.0)]) == [0]


def test_top_p_keeps_the_smallest_nucleus_and_rescales_within_it() -> None:
    # probs 0.5, 0.3, 0.2 with top_p 0.7: the nucleus is {0, 1} (0.5 < 0.7 <= 0.8), drawn as 0.5/0.8 and 0.3/0.8.
    logits = logits_of([0.5, 0.3, 0.2])
    for seed in range(30):
        expected = 0 if first_uniform(seed) < 0.5 / 0.8 else 1
        assert InferenceEngine._sample(logits, [row(seed, top_p=0.7)]) == [expected]


def test_a_rows_tokens_are_the_same_alone_and_in_any_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    alone = [InferenceEngine._sample(logits[i : i + 1], [row(100 + i)])[0] for i in range(6)]
    mixed = [row(100 + i, temperature=0.0 if i == 2 else 1.0) for i in range(6)]
    batched = InferenceEngine._sample(logits, mixed)
    assert batched[2] == int(logits[2].argmax())
    assert [t for i, t in enumerate(batched) if i != 2] == [t for i, t in enumerate(alone) if i != 2]


def test_draws_follow_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    draws = InferenceEngine._sample(logits_of(probs).repeat(4000, 1), [row(seed) for seed in range(4000)])
    for token, p in enumerate(probs):
        share = draws.count(token) / len(draws)
        assert abs(share - p) < 4 * math.sqrt(p * (1 - p) / len(draws)), (token, share)


def test_logprobs_are_the_raw_distributions_for_the_rows_that_want_them() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]]))
    out = InferenceEngine._logprobs(logits, [2, 1], [1, None])
    assert out[1] is None
    assert out[0].token_id == 2 and math.isclose(out[0].logprob, math.log(0.7), rel_tol=1e-5)
    [(top_id, top_value)] = out[0].top
    assert top_id == 2 and math.isclose(top_value, math.log(0.7), rel_tol=1e-5)
    none = InferenceEngine._logprobs(logits, [0, 0], [0, 0])
    assert [lp.top for lp in none] == [[], []] and math.isclose(none[1].logprob, math.log(0.5), rel_tol=1e-5)
    assert InferenceEngine._logprobs(logits, [0, 0], [None, None]) == [None, None]
