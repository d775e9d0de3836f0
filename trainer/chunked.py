"""Per-token log-probs and entropy without the [tokens x vocab] wall.

`chunked_logprobs(h, weight, targets, chunk)` projects the final hidden states to the vocabulary
`chunk` rows at a time. The forward keeps a per-token log-sum-exp (and, within the
`cache_gib` budget, each chunk's onehot - p: "Kept for the backward" below); the backward
recomputes each chunk's logits (or reads what was kept) and turns them into gradients for `h`
and `weight` at once. Peak extra memory without the cache is a few [chunk x vocab] float32
tensors instead of several [tokens x vocab] ones (logits, log-softmax, its gradient). Values
equal `logprobs_from_logits(h @ weight.T, targets)`.

`ChunkedOutput` is the model's output layer (an `nn.Linear`, same parameter name and tying)
that returns logits as usual, or, inside `logprob_targets(model, targets, chunk)`, the pair
(logp, entropy) computed as above. The head runs inside the model's forward, so under FSDP2 the
root's parameters are gathered exactly as for the plain output layer.

The backward's algebra: d(sum g * logp)/d logits = g * q row by row, with q = onehot(target) - p.
So grad_h = g * (q @ W) and grad_W = q^T @ (g * h): the per-token upstream gradient g scales a
[chunk x D] operand or result, and no pass over the [chunk x V] q is needed between the GEMMs.
Both GEMMs run on the tensor cores with a float32 output (`_mm_float32`); q is in the GEMM dtype.

Speed: with `fused` (set on CUDA by trainer.parallel) the
softmax math is two Triton kernels (trainer/head_kernel.py): the statistics in one pass over the
logits, and q. On CPU the same math in plain torch.

Float32 logits (`trainer.logits_fp32`, default on): the head's logits are the model-dtype
GEMM's float32 output (`ops.lm_head.float32_logits`, what the engine's `logits()`
returns), not rounded to bf16, in the forward, in the backward's recomputation and in the plain
(unchunked) head alike. q is rounded to the GEMM dtype before the two gradient GEMMs, as autograd
rounds a bf16 output's gradient.

Kept for the backward (`trainer.head_cache_gib`, default 12): the recomputing backward
repeats the forward's logits GEMM (2*N*V*D FLOP, ~5 TFLOP at 16k tokens, vocabulary 152k, dim
1024) and reads the float32 [chunk x vocab] logits again, while 100+ GiB of the GPU sit unused.
So when the [N x V] q fits the budget (N*V*itemsize of the GEMM dtype <= head_cache_gib GiB,
checked before the forward starts, and only when a backward will come) the forward also computes
each chunk's q and keeps it; the backward runs only the two gradient GEMMs. Each chunk's q is
dropped as soon as its gradient is computed, and the backward first takes the list off the
autograd context, so nothing outlives the backward (gradient accumulation runs several
micro-batches; a second backward with retain_graph recomputes). Over the budget, or with
head_cache_gib = 0: the recomputing backward. The two paths give identical gradients, to the bit,
wherever the backward's GEMM reproduces the forward's logits exactly (CPU, where
tests/test_head_cache.py checks it with torch.equal): q is the same function of the same x and
lse either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ops.lm_head import float32_logits, gemm_dtype, mm_out_dtype_works


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        fused: bool,
        fp32: bool,
        keep_q: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        stats, q_of = _chunk_math(fused)
        # keep_q (chunked_logprobs checked the head_cache_gib budget): each chunk's
        # onehot - p for the backward, which then needs no logits GEMM.
        kept: list[torch.Tensor | None] | None = [] if keep_q else None
        # The GEMM dtype the forward runs in (bf16 under autocast even for float32 weights): the
        # backward may run outside autocast and must recompute the same logits.
        mm_dtype = gemm_dtype(h, weight)
        # fp32: cast once (autocast's float32 weights), not per chunk inside float32_logits.
        hm, wm = (h.to(mm_dtype), weight.to(mm_dtype)) if fp32 else (h, weight)
        with torch.profiler.record_function("relay::logprob_head_fwd"):
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                # fp32: the GEMM's float32 output; else the model-dtype matmul (rounded logits).
                x = float32_logits(hm[s:e], wm, mm_dtype) if fp32 else h[s:e] @ weight.t()
                lse[s:e], logp[s:e], ent[s:e] = stats(x, targets[s:e])
                if kept is not None:
                    kept.append(q_of(x, lse[s:e], targets[s:e], mm_dtype))
                del x
        del hm, wm
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.mm_dtype = mm_dtype
        ctx.chunk, ctx.fused, ctx.fp32 = chunk, fused, fp32
        # On ctx, not save_for_backward: the backward drops each chunk as soon as it is used.
        ctx.q_cache = kept
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor, _grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        h, weight, targets, lse = ctx.saved_tensors
        chunk: int = ctx.chunk
        _, q_of = _chunk_math(ctx.fused)
        # Take the kept chunks off ctx: the list is now the only reference, emptied chunk by
        # chunk below, so no [N x V] memory outlives this backward (ctx may: logp keeps it).
        kept: list[torch.Tensor | None] | None = ctx.q_cache
        ctx.q_cache = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = h.shape[0]
        # One cast (autocast only; under FSDP mixed precision both are already the GEMM dtype).
        hm, wm = h.to(ctx.mm_dtype), weight.to(ctx.mm_dtype)
        with torch.profiler.record_function("relay::logprob_head_bwd"):
            for i, s in enumerate(range(0, n, chunk)):
                e = min(n, s + chunk)
                g = grad_logp[s:e].float().unsqueeze(-1)
                if kept is not None:
                    q, kept[i] = kept[i], None  # the forward's onehot - p: no logits GEMM
                    assert q is not None
                else:
                    # The forward's logits again (float32 ones with fp32), then onehot - p.
                    x = float32_logits(hm[s:e], wm, ctx.mm_dtype) if ctx.fp32 else hm[s:e] @ wm.t()
                    q = q_of(x, lse[s:e], targets[s:e], ctx.mm_dtype)
                    del x
                # dlogits = g * q row by row, so g scales the GEMMs' [c x D] operand or result
                # instead of a pass over the [c x V] q.
                if grad_h is not None:
                    grad_h[s:e] = _mm_float32(q, wm).mul_(g)
                if grad_w is not None:
                    grad_w.add_(_mm_float32(q.t(), (hm[s:e] * g).to(ctx.mm_dtype)))
                del q
        del kept
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None, None


def chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's (log-sum-exp, log-prob of the target, entropy) from its logits [c, V] (float32,
    or the model dtype without logits_fp32), all in float32, as the full path computes them.
    logp and entropy are computed as trainer.loss.logprobs_from_logits computes them (the plain
    head's values, to the bit): H = -sum p * log_softmax, not lse - sum p * logits, which subtracts
    two large numbers (~1e-3 lost at |logits| ~ 200 in float32). The logits are not modified."""
    x = logits.float()
    ls = x.log_softmax(dim=-1)
    logp = ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -ls.exp().mul_(ls).sum(-1)
    return torch.logsumexp(x, dim=-1), logp, ent


def chunk_onehot_minus_p(
    logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """onehot(target) - softmax(logits) [c, V] in `dtype` (the GEMM dtype): the logits' gradient
    per unit of upstream gradient, d(logp)/d(logits)."""
    q = (logits.float() - lse.unsqueeze(-1)).exp_().neg_()
    q.scatter_add_(-1, targets.unsqueeze(-1), torch.ones_like(q[:, :1]))
    return q.to(dtype)


def _chunk_math(fused: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(stats, onehot_minus_p): the Triton kernels (trainer/head_kernel.py) when fused, else torch."""
    if fused:
        from trainer import head_kernel

        return head_kernel.row_stats, head_kernel.onehot_minus_p
    return chunk_stats, chunk_onehot_minus_p


def _mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as float32 for the weight gradient. Copying low-precision inputs to
    float32 first would cost a [V x chunk] copy and a float32 GEMM without tensor cores (on the
    H200 at 16k tokens and vocab 152k, ~5 TFLOP at fp32 SIMT speed). The tensor-core GEMM with float32
    output computes the same products (bf16 values are exact in float32) with float32 accumulation."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if mm_out_dtype_works(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    if a.is_cuda:
        # Older torch: the low-precision GEMM (float32 accumulation inside), rounded once per
        # chunk; the gradient returned for a bf16 weight is rounded to bf16 anyway.
        return (a @ b).float()
    return a.float() @ b.float()


def chunked_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    fused: bool = False,
    fp32: bool = True,
    cache_gib: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [..., D], weight [V, D], targets [...] -> (logp [...], entropy [...]), float32.

    logp carries the gradient (to h and weight); entropy is detached (logged only).
    fused: each chunk's softmax math in the Triton kernels of trainer/head_kernel.py (CUDA; one
    pass over the logits for the statistics; the same values to float32 rounding).
    fp32: the chunk logits are the GEMM's float32 output (trainer.logits_fp32); else rounded
    to the GEMM dtype.
    cache_gib (trainer.head_cache_gib): keep the [N x V] onehot - p (in the GEMM dtype) for the
    backward when it fits in this many GiB (no logits GEMM in the backward, same gradients);
    0: always recompute."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    if cache_gib < 0:
        raise ValueError("cache_gib must be >= 0")
    lead = targets.shape
    hf = h.reshape(-1, h.shape[-1])
    keep_q = head_cache_fits(hf.shape[0], weight.shape[0], cache_gib, gemm_dtype(h, weight).itemsize) and (
        # Only when a backward will come: under no_grad (or frozen inputs) keeping q is waste.
        torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    )
    logp, ent = _ChunkedLogProbs.apply(
        hf, weight, targets.reshape(-1).long(), int(chunk), bool(fused), bool(fp32), keep_q
    )
    return logp.view(lead), ent.view(lead)


def head_cache_fits(n: int, vocab: int, cache_gib: float, itemsize: int) -> bool:
    """Whether n tokens' onehot - p over `vocab` in the GEMM dtype (n * vocab * itemsize bytes)
    fits the head_cache_gib budget (0 disables the cache)."""
    return cache_gib > 0 and n * vocab * itemsize <= cache_gib * 2**30


class _Float32Logits(torch.autograd.Function):
    """h [N, D] @ weight.T -> float32 logits [N, V] with a gradient (the unchunked head). Its own
    backward because torch.mm's out_dtype has no autograd formula to rely on: the float32
    gradient is rounded to the GEMM dtype first, as autograd does for a bf16 output, so both
    gradient GEMMs stay tensor-core GEMMs; the weight's accumulates in float32."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mm_dtype = gemm_dtype(h, weight)
        ctx.save_for_backward(h, weight)
        return float32_logits(h, weight, ctx.mm_dtype)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        h, weight = ctx.saved_tensors
        g, hm, wm = grad.to(ctx.mm_dtype), h.to(ctx.mm_dtype), weight.to(ctx.mm_dtype)
        with torch.autocast(h.device.type, enabled=False):
            grad_h = (g @ wm).to(h.dtype) if ctx.needs_input_grad[0] else None
            grad_w = _mm_float32(g.t(), hm).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w


def float32_head(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [..., D] -> float32 logits [..., V] (the plain head with trainer.logits_fp32)."""
    out = _Float32Logits.apply(h.reshape(-1, h.shape[-1]), weight)
    return out.view(*h.shape[:-1], weight.shape[0])


class ChunkedOutput(nn.Linear):
    """The output layer; with `targets` set it returns (logp, entropy) instead of logits.
    `fused` (set by trainer.parallel on CUDA): the Triton chunk math (trainer/head_kernel.py).
    `logits_fp32` (trainer.logits_fp32, default on): logits are the GEMM's float32 output, in
    both modes (as the engine's; ops/lm_head.py).
    `head_cache_gib` (trainer.head_cache_gib): the budget for keeping the chunked head's
    probabilities for its backward (0: recompute the logits there)."""

    targets: torch.Tensor | None = None
    chunk: int = 0
    fused: bool = False
    logits_fp32: bool = True
    head_cache_gib: float = 12.0

    def forward(self, h: torch.Tensor) -> Any:  # type: ignore[override]
        # Under tensor parallel the weight is a Replicate DTensor (trainer.parallel): the head
        # computes on its local copy; to_local's backward hands the gradient back as Replicate.
        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        if self.targets is None:
            return float32_head(h, w) if self.logits_fp32 else torch.nn.functional.linear(h, w)
        return chunked_logprobs(
            h, w, self.targets, self.chunk, self.fused, self.logits_fp32, self.head_cache_gib
        )


def enable_chunked_output(
    model: nn.Module, logits_fp32: bool = True, head_cache_gib: float = 12.0
) -> nn.Module:
    """Swap the model's `output` Linear for a ChunkedOutput holding the SAME parameter (tying and
    the state-dict name `output.weight` unchanged). Idempotent (sets `logits_fp32` and
    `head_cache_gib` again); call before sharding."""
    if head_cache_gib < 0:
        raise ValueError("head_cache_gib must be >= 0")
    out = model.output  # type: ignore[union-attr]
    if isinstance(out, ChunkedOutput):
        out.logits_fp32, out.head_cache_gib = logits_fp32, head_cache_gib
        return model
    assert isinstance(out, nn.Linear) and out.bias is None
    head = ChunkedOutput(out.in_features, out.out_features, bias=False, device="meta")
    head.weight = out.weight
    head.logits_fp32, head.head_cache_gib = logits_fp32, head_cache_gib
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
