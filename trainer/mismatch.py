"""Trainer/inference mismatch metrics, reported every step (docs/replay.md, "Mismatch metrics").

Over the step's trained tokens (loss_mask 1), with p_train = exp(logp_train) under the weights
being trained and p_infer = exp(logp_infer) as the engine reported it:

  kl_k3            mean of r - 1 - log r, r = p_train / p_infer: Schulman's k3 estimator of
                   KL(pi_infer || pi_train) from tokens sampled by inference (>= 0 per token,
                   unbiased, low variance)
  p_abs_max/mean   max and mean of |p_train - p_infer|
  ratio_out_frac   share of tokens with r outside [0.5, 2] (a fixed band, whatever the loss's
                   trainer.ratio_low/high, so runs compare)
  kl_k3_on_policy  kl_k3 over the samples produced entirely by the very weights being trained
                   (min_version == the trainer's version): the numerical mismatch alone, without
                   the policy lag of stale samples that the others include. Per sample, not per
                   token: a token sampled at version v whose context was computed under v-1 (the
                   weights changed mid-sequence) carries lag too.

and, for MoE models, per MoE layer the routing agreement: the share of recorded tokens whose
trainer top-k expert SET equals the engine's (trainer.replay.RoutingRecord counts).

Sums are accumulated per micro-batch and reduced across ranks (sum, and max for p_abs_max).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.schemas import Sample
from trainer.replay import micro_batch_samples

RATIO_BAND = (0.5, 2.0)


@dataclass
class MismatchStats:
    tokens: float = 0.0
    k3_sum: float = 0.0
    p_abs_sum: float = 0.0
    p_abs_max: float = 0.0
    ratio_out: float = 0.0
    on_policy_tokens: float = 0.0
    on_policy_k3_sum: float = 0.0
    # per MoE layer (empty for a dense model)
    route_agree: list[float] = field(default_factory=list)
    route_total: list[float] = field(default_factory=list)
    route_replayed: list[float] = field(default_factory=list)

    def add(self, other: MismatchStats) -> None:
        self.tokens += other.tokens
        self.k3_sum += other.k3_sum
        self.p_abs_sum += other.p_abs_sum
        self.p_abs_max = max(self.p_abs_max, other.p_abs_max)
        self.ratio_out += other.ratio_out
        self.on_policy_tokens += other.on_policy_tokens
        self.on_policy_k3_sum += other.on_policy_k3_sum
        self.route_agree = _add(self.route_agree, other.route_agree)
        self.route_total = _add(self.route_total, other.route_total)
        self.route_replayed = _add(self.route_replayed, other.route_replayed)

    def add_routing(self, agree: torch.Tensor, total: torch.Tensor, replayed: torch.Tensor) -> None:
        self.route_agree = _add(self.route_agree, agree.tolist())
        self.route_total = _add(self.route_total, total.tolist())
        self.route_replayed = _add(self.route_replayed, replayed.tolist())

    # ---- cross-rank reduction: the summed part and the max part travel as two tensors

    def sum_tensor(self, moe_layers: int) -> torch.Tensor:
        pad = [0.0] * moe_layers
        per_layer = [
            *(self.route_agree or pad),
            *(self.route_total or pad),
            *(self.route_replayed or pad),
        ]
        head = [self.tokens, self.k3_sum, self.p_abs_sum, self.ratio_out]
        head += [self.on_policy_tokens, self.on_policy_k3_sum]
        return torch.tensor([*head, *per_layer], dtype=torch.float64)

    def max_tensor(self) -> torch.Tensor:
        return torch.tensor([self.p_abs_max], dtype=torch.float64)

    @classmethod
    def from_tensors(cls, summed: torch.Tensor, maxed: torch.Tensor, moe_layers: int) -> MismatchStats:
        s = summed.tolist()
        n, h = moe_layers, 6
        return cls(
            tokens=s[0],
            k3_sum=s[1],
            p_abs_sum=s[2],
            ratio_out=s[3],
            on_policy_tokens=s[4],
            on_policy_k3_sum=s[5],
            p_abs_max=float(maxed[0].item()),
            route_agree=s[h : h + n],
            route_total=s[h + n : h + 2 * n],
            route_replayed=s[h + 2 * n : h + 3 * n],
        )

    # ---- what the step reports

    def summary(self) -> dict[str, float | list[float] | None]:
        n = max(self.tokens, 1.0)
        agreement = [
            a / t if t > 0 else None for a, t in zip(self.route_agree, self.route_total, strict=True)
        ]
        total = sum(self.route_total)
        return {
            "mismatch_kl_k3": self.k3_sum / n,
            "mismatch_p_abs_max": self.p_abs_max,
            "mismatch_p_abs_mean": self.p_abs_sum / n,
            "mismatch_ratio_out_frac": self.ratio_out / n,
            "mismatch_kl_k3_on_policy": (
                self.on_policy_k3_sum / self.on_policy_tokens if self.on_policy_tokens else None
            ),
            # None where a layer saw no recorded token (e.g. the engine returned no routing)
            "routing_agreement": agreement,
            "routing_agreement_mean": sum(self.route_agree) / total if total > 0 else None,
            "routing_replayed_frac": sum(self.route_replayed) / total if total > 0 else None,
        }


def _add(a: list[float], b: list[float]) -> list[float]:
    if not a:
        return list(b)
    if not b:
        return a
    return [x + y for x, y in zip(a, b, strict=True)]


def micro_batch_versions(samples: list[Sample], packing: bool, token_budget: int) -> list[torch.Tensor]:
    """Per micro-batch, each scored position's sample min_version (the oldest weights that sampled
    any of its tokens), aligned with its loss_mask as trainer.batch / trainer.packing lay out
    logprobs (positions 1..len-1 per sample; -2 = padding)."""
    out = []
    for group in micro_batch_samples(samples, packing, token_budget):
        rows = [[s.min_version] * (len(s.tokens) - 1) for s in group if not packing or len(s.tokens) >= 2]
        if packing:
            out.append(torch.tensor([v for r in rows for v in r], dtype=torch.long).unsqueeze(0))
            continue
        width = max(2, max(len(s.tokens) for s in group)) - 1
        t = torch.full((len(rows), width), -2, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        out.append(t)
    return out


# The summed fields of token_mismatch_tensors, in MismatchStats.sum_tensor's order.
SUM_FIELDS = ("tokens", "k3_sum", "p_abs_sum", "ratio_out", "on_policy_tokens", "on_policy_k3_sum")


@torch.no_grad()
def token_mismatch_tensors(
    logp_train: torch.Tensor,
    logp_infer: torch.Tensor,
    loss_mask: torch.Tensor,
    on_policy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_mismatch's sums as a float64 tensor [6] (SUM_FIELDS order) and its max as one [1],
    on the inputs' device and never read on the host: the trainer accumulates them over the
    step's micro-batches and copies them to the host once (boolean-mask gathers and
    .item() calls per micro-batch would be host syncs). Positions outside the mask are zeroed
    by torch.where (not multiplied: an inf or NaN there must not leak into a sum), instead of
    gathered, so no shape depends on the data. The float64 sums run over zeros where the old
    gather skipped positions: equal up to float64 summation order (~1e-16 relative)."""
    m = loss_mask.detach().reshape(-1) > 0
    a = logp_train.detach().reshape(-1).double()
    b = logp_infer.detach().reshape(-1).double()
    zero = torch.zeros((), dtype=torch.float64, device=a.device)
    if a.numel() == 0:  # a shape, not a value: no sync
        return zero.repeat(len(SUM_FIELDS)), zero.reshape(1)
    log_r = a - b
    # float64 exp overflows only past log r = 709; far beyond any ratio that means anything.
    r = torch.exp(log_r.clamp(max=700.0))
    k3 = r - 1.0 - log_r
    p_abs = (a.exp() - b.exp()).abs()
    low, high = RATIO_BAND
    fresh = m & on_policy.reshape(-1).to(torch.bool) if on_policy is not None else torch.zeros_like(m)
    p_abs_m = torch.where(m, p_abs, zero)
    sums = torch.stack(
        [
            m.sum(dtype=torch.float64),
            torch.where(m, k3, zero).sum(),
            p_abs_m.sum(),
            (m & ((r < low) | (r > high))).sum(dtype=torch.float64),
            fresh.sum(dtype=torch.float64),
            torch.where(fresh, k3, zero).sum(),
        ]
    )
    return sums, p_abs_m.max().reshape(1)


def token_mismatch(
    logp_train: torch.Tensor,
    logp_infer: torch.Tensor,
    loss_mask: torch.Tensor,
    on_policy: torch.Tensor | None = None,
) -> MismatchStats:
    """Mismatch sums over the positions where loss_mask is 1 (any matching shapes); `on_policy`
    (bool, same shape) marks the tokens sampled by the weights being trained. One host copy
    (token_mismatch_tensors does the work on the device)."""
    sums, maxed = token_mismatch_tensors(logp_train, logp_infer, loss_mask, on_policy)
    v = torch.cat([sums, maxed]).tolist()
    return MismatchStats(**dict(zip(SUM_FIELDS, v, strict=False)), p_abs_max=v[len(SUM_FIELDS)])
