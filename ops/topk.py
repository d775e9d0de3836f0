"""Top-k with ties broken by position, as a stable descending sort breaks them, at top-k's cost.

GLM-5's DSA indexer (services/engine/layers/mla.py, trainer/glm5.py) keeps each query's index_topk
best keys. Keys whose every head's ReLU is 0 score exactly 0, so ties are common, and torch.topk
breaks them in an order of its own that depends on the shape: the engine and the trainer would
then attend to different keys. `topk_first` picks exactly the keys of `scores.sort(descending=True,
stable=True).indices[..., :k]` (the earlier key wins a tie) with one torch.topk over int64 keys
that are all distinct: the float32 score's bits mapped to an order-preserving signed integer in
the high 32 bits, the position reversed in the low 32 bits. A full sort of every query's context
is several times slower than topk on a GPU (bench/engine/nemotron_gpu.py times both).
"""

from __future__ import annotations

import torch

_LOW = (1 << 32) - 1


def order_key(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores [..., n] -> int64 keys [..., n] whose order is the scores' order, ties
    (-0.0 and +0.0 included) broken towards the lower position; all keys of a row differ."""
    if scores.dtype != torch.float32:
        raise TypeError(f"topk_first: float32 scores, got {scores.dtype}")
    if scores.shape[-1] > _LOW:
        raise ValueError("topk_first: rows longer than 2**32 positions")
    # + 0.0 turns -0.0 into +0.0: equal floats, which must map to equal integers.
    bits = (scores.detach() + 0.0).view(torch.int32).to(torch.int64)
    # IEEE-754 floats order as sign-magnitude integers: flipping the 31 magnitude bits of the
    # negative ones makes them order as two's-complement integers (-inf lowest, NaN never met).
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    pos = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    # In place: a prefill's scores are [B, Lq, ctx]; one int64 copy of them is enough.
    return key.bitwise_left_shift_(32).bitwise_or_(_LOW - pos)


def topk_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions [..., min(k, n)] of the k highest float32 scores of each row [..., n], a tie going
    to the lower position; in no particular order (the set is what callers use)."""
    k = min(k, scores.shape[-1])
    return order_key(scores).topk(k, dim=-1, sorted=False).indices
