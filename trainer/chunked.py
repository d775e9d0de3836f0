"""Per-token log-probs and entropy without the [tokens x vocab] wall.

`chunked_logprobs(h, weight, targets, chunk)` projects the final hidden states to the vocabulary
`chunk` rows at a time. The forward keeps only a per-token log-sum-exp; the backward recomputes
each chunk's logits and turns them into gradients for `h` and `weight` at once. Peak extra memory
is a few [chunk x vocab] float32 tensors instead of several [tokens x vocab] ones (logits,
log-softmax, its gradient). Values equal `logprobs_from_logits(h @ weight.T, targets)`.

`ChunkedOutput` is the model's output layer (an `nn.Linear`, same parameter name and tying)
that returns logits as usual, or, inside `logprob_targets(model, targets, chunk)`, the pair
(logp, entropy) computed as above. The head runs inside the model's forward, so under FSDP2 the
root's parameters are gathered exactly as for the plain output layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            logits = (h[s:e] @ weight.t()).float()  # model dtype matmul, then float32 (as the full path)
            z = torch.logsumexp(logits, dim=-1)
            lse[s:e] = z
            logp[s:e] = logits.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1) - z
            # H = lse - sum p * logits  (= -sum p log p)
            p = torch.exp(logits - z.unsqueeze(-1))
            ent[s:e] = z - (p * logits).sum(-1)
            del logits, p
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor, _grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        h, weight, targets, lse = ctx.saved_tensors
        chunk: int = ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = h.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            g = grad_logp[s:e].float()
            logits = (h[s:e] @ weight.t()).float()
            # d logp_t / d logits = onehot(target) - softmax(logits)
            dlogits = torch.exp(logits - lse[s:e].unsqueeze(-1)).mul_(-g.unsqueeze(-1))
            del logits
            dlogits.scatter_add_(-1, targets[s:e].unsqueeze(-1), g.unsqueeze(-1))
            d = dlogits.to(h.dtype)
            if grad_h is not None:
                grad_h[s:e] = d @ weight
            if grad_w is not None:
                grad_w.add_(d.t().float() @ h[s:e].float())
            del dlogits, d
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None


def chunked_logprobs(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [..., D], weight [V, D], targets [...] -> (logp [...], entropy [...]), float32.

    logp carries the gradient (to h and weight); entropy is detached (logged only)."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    lead = targets.shape
    logp, ent = _ChunkedLogProbs.apply(
        h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1).long(), int(chunk)
    )
    return logp.view(lead), ent.view(lead)


class ChunkedOutput(nn.Linear):
    """The output layer; with `targets` set it returns (logp, entropy) instead of logits."""

    targets: torch.Tensor | None = None
    chunk: int = 0

    def forward(self, h: torch.Tensor) -> Any:  # type: ignore[override]
        if self.targets is None:
            return super().forward(h)
        return chunked_logprobs(h, self.weight, self.targets, self.chunk)


def enable_chunked_output(model: nn.Module) -> nn.Module:
    """Swap the model's `output` Linear for a ChunkedOutput holding the SAME parameter (tying and
    the state-dict name `output.weight` unchanged). Idempotent; call before sharding."""
    out = model.output  # type: ignore[union-attr]
    if isinstance(out, ChunkedOutput):
        return model
    assert isinstance(out, nn.Linear) and out.bias is None
    head = ChunkedOutput(out.in_features, out.out_features, bias=False, device="meta")
    head.weight = out.weight
    model.output = head  # type: ignore[union-attr]
    return model


@contextmanager
def logprob_targets(model: nn.Module, targets: torch.Tensor, chunk: int) -> Iterator[None]:
    """Inside: model(inputs) returns (logp, entropy) of `targets` (same shape as inputs)."""
    head = model.output  # type: ignore[union-attr]
    if not isinstance(head, ChunkedOutput):
        raise TypeError("call enable_chunked_output(model) first")
    head.targets, head.chunk = targets, chunk
    try:
        yield
    finally:
        head.targets, head.chunk = None, 0
