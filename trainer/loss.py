"""The trainer's loss as pure functions (docs/loss.md states it in full).

Conventions: a logp/entropy/mask tensor of shape [B, T-1] is aligned with `tokens[:, 1:]`, i.e.
column t scores the token tokens[:, t+1] given tokens[:, :t+1]. Everything here runs in float32
whatever the model's dtype, because importance ratios exp(a - b) amplify rounding errors.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.batch import MicroBatch
from trainer.chunked import logprob_targets
from trainer.packing import PackedMicroBatch, document_mask


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of `targets` and the entropy of the distribution (temperature 1).

    logits [B, T, V], targets [B, T] -> (logp [B, T], entropy [B, T]). logp carries the gradient;
    entropy does only with entropy_grad (an entropy bonus in the loss), since keeping its graph
    costs another [B, T, V] tensor.
    """
    logp_all = logits.float().log_softmax(dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy


def token_logprobs(
    model: nn.Module, tokens: torch.Tensor, chunk: int = 0, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of every token after the first under `model`: tokens [B, T] -> (logp, entropy), each
    [B, T-1], column t scoring tokens[:, t+1]. The last position's logits are never needed, so
    the model only sees tokens[:, :-1] (identical values under causal attention). This is the
    function the engine parity test compares the inference engine's log-probs against.

    chunk > 0: the vocabulary projection runs `chunk` tokens at a time (trainer.chunked; the
    model needs `enable_chunked_output`), so no [tokens x vocab] tensor is materialised."""
    return sequence_logprobs(model, tokens[:, :-1], tokens[:, 1:], chunk=chunk, entropy_grad=entropy_grad)


def sequence_logprobs(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    chunk: int = 0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) of `targets` given `inputs` (same shape [B, T]); `positions` are the RoPE
    positions (None = 0..T-1 per row), chunk as in token_logprobs."""
    kw = {} if positions is None else {"positions": positions}
    if chunk > 0 and entropy_grad:
        raise ValueError("an entropy bonus (trainer.entropy_coef > 0) needs trainer.logprob_chunk_tokens = 0")
    if chunk > 0:
        with logprob_targets(model, targets, chunk):
            logp, ent = model(inputs, **kw)
        return logp, ent
    return logprobs_from_logits(model(inputs, **kw), targets, entropy_grad=entropy_grad)


def micro_batch_logprobs(
    model: nn.Module, mb: MicroBatch | PackedMicroBatch, chunk: int = 0, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) aligned with mb.loss_mask, for a padded or a packed micro-batch (the latter
    needs `enable_document_masking`: attention stays within each sample, RoPE restarts)."""
    if isinstance(mb, PackedMicroBatch):
        with document_mask(model, mb.seq_lens, mb.inputs.device):
            return sequence_logprobs(
                model, mb.inputs, mb.targets, positions=mb.positions, chunk=chunk, entropy_grad=entropy_grad
            )
    return token_logprobs(model, mb.tokens, chunk=chunk, entropy_grad=entropy_grad)


class LossStats:
    """Sums over one micro-batch; summed again across micro-batches and ranks before reporting:
    loss_tokens (loss_mask 1), masked_tokens (of those, outside the ratio band: no gradient),
    entropy_sum (entropy over loss tokens), loss_sum (this micro-batch's share of the step loss).

    Held as ONE float64 tensor [4] on the loss's device, never read by ratio_loss or add(): four
    .item() calls between the forward and the backward would drain the GPU queue every
    micro-batch. Reading a field copies the tensor to the host once (cached until the
    next add). The values are those of a Python-float path: each float32 sum widened exactly
    to float64, then added in float64 in micro-batch order, as Python floats were."""

    FIELDS = ("loss_tokens", "masked_tokens", "entropy_sum", "loss_sum")

    def __init__(
        self,
        loss_tokens: float = 0.0,
        masked_tokens: float = 0.0,
        entropy_sum: float = 0.0,
        loss_sum: float = 0.0,
    ) -> None:
        vals = (loss_tokens, masked_tokens, entropy_sum, loss_sum)
        # None: nothing added yet, every field 0.0 (no tensor, so no host-to-device copy for it)
        self._t: torch.Tensor | None = None if not any(vals) else torch.tensor(vals, dtype=torch.float64)
        self._host: tuple[float, ...] | None = None

    @classmethod
    def of_tensor(cls, t: torch.Tensor) -> LossStats:
        """Stats over a float64 tensor [4] in FIELDS order, on any device (not copied, not read)."""
        if t.shape != (4,):
            raise ValueError(f"LossStats needs a [4] tensor, got {tuple(t.shape)}")
        st = cls()
        st._t = t.to(torch.float64)
        return st

    def _values(self) -> tuple[float, ...]:
        if self._host is None:
            self._host = (0.0,) * 4 if self._t is None else tuple(float(x) for x in self._t.tolist())
        return self._host

    @property
    def loss_tokens(self) -> float:
        return self._values()[0]

    @property
    def masked_tokens(self) -> float:
        return self._values()[1]

    @property
    def entropy_sum(self) -> float:
        return self._values()[2]

    @property
    def loss_sum(self) -> float:
        return self._values()[3]

    def add(self, other: LossStats) -> None:
        """Elementwise sum, on the device (no host copy). 0 + x as the float path computed it
        (so a -0.0 sum still reports 0.0)."""
        if other._t is None:
            return
        base = torch.zeros_like(other._t) if self._t is None else self._t
        self._t = base + other._t
        self._host = None

    def as_tensor(self, device: torch.device | None = None) -> torch.Tensor:
        """The four sums as a float64 tensor [4], on the device they were computed on (zeros on
        `device`, default CPU, when nothing was added)."""
        return torch.zeros(4, dtype=torch.float64, device=device) if self._t is None else self._t

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> LossStats:
        return cls.of_tensor(t)

    def __repr__(self) -> str:
        return (
            "LossStats("
            + ", ".join(f"{k}={v!r}" for k, v in zip(self.FIELDS, self._values(), strict=True))
            + ")"
        )


def count_loss_tokens(loss_mask: torch.Tensor) -> int:
    """The normaliser: number of loss tokens. Summed over every micro-batch (and rank) of a step."""
    return int(loss_mask.sum().item())


def ratio_loss(
    logp_train: torch.Tensor,
    logp_infer: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    ratio_low: float,
    ratio_high: float,
    total_loss_tokens: int,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Importance-weighted policy-gradient loss with token masking outside a ratio band.

    ratio_t = exp(logp_train_t - logp_infer_t); a loss token whose ratio lies outside
    [ratio_low, ratio_high] is dropped (no gradient); the rest contribute -A * ratio_t. The sum is
    divided by `total_loss_tokens`, the loss-token count of the whole STEP (all micro-batches, all
    ranks), so that summing micro-batch losses/gradients gives the step's mean, independent of how
    the step was split. The ratio, not logp, carries the gradient: d ratio = ratio * d logp, so
    on-policy (ratio = 1) the gradient is exactly REINFORCE's -A * d logp / N.

    Shapes: logp_*, loss_mask, entropy [B, T]; advantages [B] (one per sample) or [B, T].
    """
    if total_loss_tokens <= 0:
        raise ValueError("total_loss_tokens must be positive")
    mask = loss_mask.to(torch.float32)
    adv = advantages.to(torch.float32)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    log_ratio = logp_train.float() - logp_infer.float()
    with torch.no_grad():
        raw = torch.exp(log_ratio)
        in_band = ((raw >= ratio_low) & (raw <= ratio_high)).to(torch.float32)
        masked = (mask * (1.0 - in_band)).sum()
        weight = mask * in_band
    # Masked and padded positions are replaced by log-ratio 0 before exp: their ratio could be
    # inf, and inf * 0 would put NaN into the gradient. torch.where sends them zero gradient.
    ratio = torch.exp(torch.where(weight > 0, log_ratio, torch.zeros_like(log_ratio)))
    loss = -(adv * ratio * weight).sum() / float(total_loss_tokens)
    if entropy_coef > 0:
        # Entropy bonus over every loss token (in band or not): keeps the policy from turning
        # deterministic before the task is solved. Needs entropy computed with entropy_grad.
        if entropy is None or not entropy.requires_grad:
            raise ValueError("entropy_coef > 0 needs the entropy with its gradient (entropy_grad=True)")
        loss = loss - entropy_coef * (entropy.float() * mask).sum() / float(total_loss_tokens)
    # One device tensor, no .item(): the caller reads it once per step (LossStats).
    ent_sum = (
        (entropy.detach().float() * mask).sum()
        if entropy is not None
        else torch.zeros((), dtype=torch.float32, device=mask.device)
    )
    stats = LossStats.of_tensor(torch.stack([mask.sum(), masked, ent_sum, loss.detach().float()]))
    return loss, stats
