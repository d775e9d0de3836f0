"""Sampler: the reported log-prob is that of the distribution actually sampled from."""

from __future__ import annotations

import math
import random

import torch

from services.common.schemas import SamplingParams
from services.engine.layers.sampler import Sampler


def gens(n: int, seed: int = 0) -> list[random.Random]:
    return [random.Random(seed + i) for i in range(n)]


def test_logprob_is_log_softmax_at_temperature_one() -> None:
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 3
    tokens, lps = Sampler()(logits, [SamplingParams()] * 5, gens(5))
    ref = torch.log_softmax(logits, -1)
    for row, (t, lp) in enumerate(zip(tokens, lps, strict=True)):
        assert lp == ref[row, t].item()


def test_temperature_and_truncation_renormalise() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)) * 2
    p = SamplingParams(temperature=0.7, top_k=5)
    tokens, lps = Sampler()(logits, [p], gens(1))
    scaled = logits[0] / 0.7
    top = scaled.topk(5)
    assert tokens[0] in top.indices.tolist()
    expected = torch.log_softmax(top.values, -1)[top.indices.tolist().index(tokens[0])]
    assert math.isclose(lps[0], expected.item(), abs_tol=1e-6)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    p = SamplingParams(top_p=0.75)
    seen = set()
    for seed in range(200):
        (t,), (lp,) = Sampler()(probs.log(), [p], [random.Random(seed)])
        seen.add(t)
        assert math.isclose(lp, math.log(probs[0, t].item() / 0.8), abs_tol=1e-6)
    assert seen == {0, 1}  # 0.5 < 0.75 needs the second token; the third is outside


def test_frequencies_follow_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    n = 4000
    tokens, _ = Sampler()(probs.log().expand(n, 4), [SamplingParams()] * n, gens(n, seed=7))
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert counts[3] == 0
    torch.testing.assert_close(counts, probs, atol=0.03, rtol=0)


def test_greedy_and_extreme_logits_have_no_nan() -> None:
    big = torch.finfo(torch.float32).max
    logits = torch.tensor(
        [
            [0.0, 1e30, -1e30, 3.0],
            [float("inf"), 0.0, float("-inf"), 1.0],
            [float("nan"), 2.0, 1.0, 0.0],
            [float("-inf")] * 4,
            [big, big, 0.0, -big],
        ]
    )
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6, top_p=0.5, top_k=2)):
        tokens, lps = Sampler()(logits, [params] * 5, gens(5))
        assert all(math.isfinite(lp) and lp <= 0 for lp in lps), lps
        assert tokens[0] == 1 and tokens[1] == 0 and tokens[2] == 1
    tokens, _ = Sampler()(logits[:1], [SamplingParams(temperature=0.0)], gens(1))
    assert tokens == [1]


def test_draws_depend_only_on_own_generator() -> None:
    """A row's sample is the same whatever else is in the batch."""
    logits = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.3, top_k=20), SamplingParams(), SamplingParams(top_p=0.9)] * 2
    alone = [Sampler()(logits[i : i + 1], [params[i]], gens(1, seed=i))[0][0] for i in range(6)]
    together, _ = Sampler()(logits, params, [random.Random(i) for i in range(6)])
    assert alone == together
