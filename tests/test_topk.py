"""ops/topk.topk_first (GLM-5's DSA indexer selection in the engine and the trainer) picks exactly
the keys a stable descending sort puts first: ties at the k-th score go to the lower positions,
-0.0 ties +0.0, masked (-inf) keys come last in position order, negative scores keep their order."""

from __future__ import annotations

import pytest
import torch

from ops.topk import order_key, topk_first


def stable_sort_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The selection as a [..., n] bool mask, the way the indexer used to compute it."""
    top = scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, scores.shape[-1])]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)


def as_mask(scores: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)


@pytest.mark.parametrize("n,k", [(64, 16), (300, 32), (1000, 999), (40, 64), (257, 1)])
def test_same_selection_as_stable_sort_with_boundary_ties(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 7 + k)
    # A few distinct values (many ties everywhere, the k-th one too), exact zeros of both signs,
    # negative scores and masked keys: what an indexer's ReLU sums and causal mask give.
    scores = torch.randint(-3, 4, (3, 5, n), generator=g).float() * 0.25
    scores[torch.rand(scores.shape, generator=g) < 0.3] = 0.0
    scores[torch.rand(scores.shape, generator=g) < 0.1] = -0.0
    scores[torch.rand(scores.shape, generator=g) < 0.2] = float("-inf")
    scores[0, 0] = 0.0  # a row that ties everywhere
    scores[1, 1] = float("-inf")  # a row with nothing visible
    top = topk_first(scores, k)
    assert top.shape == (*scores.shape[:-1], min(k, n))
    want = stable_sort_top(scores, k)
    kth = scores.sort(dim=-1, descending=True, stable=True).values[..., min(k, n) - 1]
    boundary_ties = ((scores == kth[..., None]).sum(-1) > 1) & (min(k, n) < n)
    if k < n:
        assert boundary_ties.any()  # the case the fix-up is for is in the data
    assert torch.equal(as_mask(scores, top), want)


def test_order_key_orders_as_floats() -> None:
    values = torch.tensor([float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    key = order_key(values)
    # Strictly increasing in value; the two zeros tie in value, so the earlier one ranks higher.
    assert key[0] < key[1] < key[2] < key[4] < key[5] < key[6] < key[7]
    assert key[3] > key[4] and (key[3] >> 32) == (key[4] >> 32)
    with pytest.raises(TypeError, match="float32"):
        order_key(values.double())
