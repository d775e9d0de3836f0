"""Token sampling with per-sequence parameters and RNG, returning the log-prob of each sampled token.

The log-prob is that of the distribution the token was actually drawn from: logits / temperature,
restricted to the top-k / top-p support and renormalised over it. With temperature 1 and no
truncation that is exactly log_softmax(logits), the quantity the trainer recomputes, so the
importance ratio pi_train / pi_infer is 1 up to float rounding when the weights agree.
Greedy rows (temperature 0) report the untruncated log_softmax(logits): the distribution they
"sample" from is a point mass, whose log-prob (0) carries no information.

Everything is float32 (whatever the model dtype) and guarded against inf/NaN logits.
"""

from __future__ import annotations

import random

import torch

from services.common.schemas import SamplingParams


def sanitize(x: torch.Tensor) -> torch.Tensor:
    """Map NaN to -inf and +inf to the largest float, and give rows with nothing finite a uniform
    distribution, so log_softmax never sees inf - inf."""
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    dead = ~torch.isfinite(x).any(dim=-1, keepdim=True)
    return torch.where(dead, torch.zeros_like(x), x)


def truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside the smallest set whose
    probability (after top-k) reaches top_p. top_k = vocab and top_p = 1 leave a row unchanged."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    remove = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p = 1 skip this: rounding could otherwise drop the far tail.
    remove |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove[:, 0] = False  # the most likely token always survives
    mask = torch.zeros_like(remove).scatter(1, order, remove)
    return logits.masked_fill(mask, float("-inf"))


class Sampler:
    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[random.Random]
    ) -> tuple[list[int], list[float]]:
        """logits [B, V] (any dtype/device); one params and RNG per row. Greedy rows draw nothing."""
        logits = logits.float()
        batch, vocab = logits.shape
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        greedy = temps == 0
        scaled = sanitize(logits / torch.where(greedy, 1.0, temps)[:, None])

        rows = [i for i, p in enumerate(params) if p.temperature > 0 and (0 < p.top_k < vocab or p.top_p < 1)]
        if rows:
            idx = torch.tensor(rows, device=device)
            top_k = torch.tensor([params[i].top_k or vocab for i in rows], device=device).clamp(max=vocab)
            top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32, device=device)
            scaled[idx] = truncate(scaled[idx], top_k, top_p)
        logp = torch.log_softmax(scaled, dim=-1)

        # Inverse-CDF sampling: one uniform per row from the row's own RNG (host side, so the
        # per-row cost is tiny), then one vectorised searchsorted for the batch. The first index
        # whose cumulative mass exceeds u * total always has non-zero mass.
        u = torch.tensor(
            [0.0 if p.temperature == 0 else rng.random() for p, rng in zip(params, rngs, strict=True)],
            dtype=torch.float64,
        ).to(device)
        cdf = logp.double().exp().cumsum(dim=-1)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
        best = scaled.argmax(dim=-1, keepdim=True)
        # Guard the u * total == total rounding corner, which would land on a masked token.
        drawn = torch.where(logp.gather(1, drawn) == float("-inf"), best, drawn)
        tokens = torch.where(greedy[:, None], best, drawn)
        chosen = logp.gather(1, tokens)
        assert tokens.shape == (batch, 1)
        return tokens[:, 0].tolist(), chosen[:, 0].tolist()
