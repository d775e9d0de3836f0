"""Per-token log-probs and entropy without the [tokens x vocab] wall.

`chunked_logprobs(h, weight, targets, chunk)` projects the final hidden states to the vocabulary
`chunk` rows at a time. The forward keeps a per-token log-sum-exp (and, within the
`cache_gib` budget, each chunk's probabilities: "Probabilities kept" below); the backward
recomputes each chunk's logits (or reads its probabilities) and turns them into gradients for `h`
and `weight` at once. Peak extra memory without the cache is a few [chunk x vocab] float32
tensors instead of several [tokens x vocab] ones (logits, log-softmax, its gradient). Values
equal `logprobs_from_logits(h @ weight.T, targets)`.

`ChunkedOutput` is the model's output layer (an `nn.Linear`, same parameter name and tying)
that returns logits as usual, or, inside `logprob_targets(model, targets, chunk)`, the pair
(logp, entropy) computed as above. The head runs inside the model's forward, so under FSDP2 the
root's parameters are gathered exactly as for the plain output layer.

Speed (issue 9, bench/trainer/profile.py): the weight gradient is a tensor-core GEMM with a
float32 output (`_mm_float32`), not a float32 GEMM over float32 copies; with `fused` (CUDA +
trainer.compile) each chunk's softmax math is one compiled kernel or two over the model-dtype
logits instead of ~10 eager passes over float32 [chunk x vocab] tensors.

Float32 logits (issue 7, `trainer.logits_fp32`, default on): the head's logits are the model-dtype
GEMM's float32 output (`services.common.lm_head.float32_logits`, what the engine's `logits()`
returns), not rounded to bf16, in the forward, in the backward's recomputation and in the plain
(unchunked) head alike. The logits' gradient is rounded to the GEMM dtype before the two gradient
GEMMs, as autograd does for a bf16 output.

Probabilities kept for the backward (issue 9, `trainer.head_cache_gib`, default 12): the
recomputing backward repeats the forward's logits GEMM (2*N*V*D FLOP, ~5 TFLOP at 16k tokens,
vocabulary 152k, dim 1024) and writes and reads the float32 [chunk x vocab] logits again (the
head is ~48 ms of a 350 ms 0.6B step on the H200), while 100+ GiB of its memory sit unused. So
when the [N x V] float32 probabilities fit the budget (N*V*4 bytes <= head_cache_gib GiB, checked
before the forward starts, and only when a backward will come) the forward's stats step also
returns p = exp(logits - lse) for its chunk and the forward keeps it: one [chunk x V] float32
tensor per chunk (the compiled stats kernel's own output, so nothing is written into a view of a
larger buffer, and each chunk can be freed on its own). The backward computes
d = g * (onehot(target) - p), rounded to the GEMM dtype, and runs only the two gradient GEMMs;
each chunk's p is dropped as soon as its gradient is computed, and the backward first takes the
list off the autograd context, so nothing outlives the backward (gradient accumulation runs
several micro-batches; a second backward with retain_graph recomputes). Over the budget, or with
head_cache_gib = 0: the recomputing backward, unchanged. Eager, the two paths give identical
logp, entropy and gradients of h and weight, to the bit, wherever the backward's GEMM reproduces
the forward's logits exactly (CPU, where tests/test_head_cache.py checks it with torch.equal): the
forward computes the same float32 logits x and lse either way, p is the same expression
exp(x - lse) of them as the recomputing backward's, and d the same -g*p (+ g at the target)
rounded the same way.
Compiled (`fused`), p comes from the forward's compiled stats kernel instead of the backward's
compiled dlogits kernel: the same expression in two kernels, equal to rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from services.common.lm_head import float32_logits, gemm_dtype, mm_out_dtype_works


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
        keep_p: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = h.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=h.device)
        ent = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        stats = _compiled("stats") if fused else chunk_stats
        stats_p = _compiled("stats_p") if fused else chunk_stats_keep_p
        # keep_p (chunked_logprobs checked the head_cache_gib budget): each chunk's probabilities
        # for the backward, which then needs no logits GEMM.
        kept: list[torch.Tensor | None] | None = [] if keep_p else None
        # The GEMM dtype the forward runs in (bf16 under autocast even for float32 weights): the
        # backward may run outside autocast and must recompute the same logits.
        mm_dtype = gemm_dtype(h, weight)
        # fp32: cast once (autocast's float32 weights), not per chunk inside float32_logits.
        hm, wm = (h.to(mm_dtype), weight.to(mm_dtype)) if fp32 else (h, weight)
        with torch.profiler.record_function("relay::logprob_head_fwd"):
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                # fp32: the GEMM's float32 output; else the model-dtype matmul (rounded logits).
                # The float32 math on them is in chunk_stats.
                x = float32_logits(hm[s:e], wm, mm_dtype) if fp32 else h[s:e] @ weight.t()
                if kept is None:
                    lse[s:e], logp[s:e], ent[s:e] = stats(x, targets[s:e])
                else:
                    lse[s:e], logp[s:e], ent[s:e], p = stats_p(x, targets[s:e])
                    kept.append(p)
                    del p
                del x
        del hm, wm
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.mm_dtype = mm_dtype
        ctx.chunk, ctx.fused, ctx.fp32 = chunk, fused, fp32
        # On ctx, not save_for_backward: the backward drops each chunk as soon as it is used.
        ctx.p_cache = kept
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor, _grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        h, weight, targets, lse = ctx.saved_tensors
        chunk: int = ctx.chunk
        dlogits_of = _compiled("dlogits") if ctx.fused else chunk_dlogits
        from_p = _compiled("dlogits_p") if ctx.fused else chunk_dlogits_from_p
        # Take the kept probabilities off ctx: the list is now the only reference, emptied chunk
        # by chunk below, so no [N x V] memory outlives this backward (ctx may: logp keeps it).
        kept: list[torch.Tensor | None] | None = ctx.p_cache
        ctx.p_cache = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = h.shape[0]
        # One cast (autocast only; under FSDP mixed precision both are already the GEMM dtype).
        hm, wm = h.to(ctx.mm_dtype), weight.to(ctx.mm_dtype)
        with torch.profiler.record_function("relay::logprob_head_bwd"):
            for i, s in enumerate(range(0, n, chunk)):
                e = min(n, s + chunk)
                g = grad_logp[s:e].float()
                if kept is not None:
                    # The forward's probabilities of this chunk: no logits GEMM.
                    p, kept[i] = kept[i], None
                    assert p is not None
                    d = from_p(p, g, targets[s:e], ctx.mm_dtype)
                    del p
                else:
                    # The forward's logits again (float32 ones with fp32); the gradient in the GEMM dtype.
                    x = float32_logits(hm[s:e], wm, ctx.mm_dtype) if ctx.fp32 else hm[s:e] @ wm.t()
                    d = dlogits_of(x, lse[s:e], g, targets[s:e], ctx.mm_dtype)
                    del x
                if grad_h is not None:
                    grad_h[s:e] = d @ wm
                if grad_w is not None:
                    grad_w.add_(_mm_float32(d.t(), hm[s:e]))
                del d
        del kept
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None, None


def chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's (log-sum-exp, log-prob of the target, entropy) from its logits [c, V] (float32,
    or the model dtype without logits_fp32), all in float32, as the full path computes them.
    Entropy H = lse - sum p * logits (= -sum p log p). In-place ops where a temporary is fresh,
    so eager runs ~4 [c x V] float32 passes fewer allocations."""
    x = logits.float()
    z = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - z
    p = (x - z.unsqueeze(-1)).exp_()
    ent = z - p.mul_(x).sum(-1)
    return z, logp, ent


def chunk_stats_keep_p(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_stats plus p = exp(logits - lse) [c, V] float32, kept for the backward. Every value
    is chunk_stats' (the same operations on the same float32 x) and p is bit for bit what
    chunk_dlogits computes from the recomputed logits and this lse, so the cached backward's
    gradient equals the recomputing one. `logits` is a fresh matmul output, clobbered in place
    (the entropy's product goes into x, as p must survive)."""
    x = logits.float()
    z = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - z
    p = (x - z.unsqueeze(-1)).exp_()
    ent = z - x.mul_(p).sum(-1)
    return z, logp, ent, p


def chunk_stats_keep_p_pointwise(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_stats_keep_p without in-place ops (what torch.compile gets: mutating an input would
    cost a write-back): the reductions and p in one compiled kernel or two, p its one [c x V]
    float32 output. Same values as chunk_stats_keep_p."""
    x = logits.float()
    z = torch.logsumexp(x, dim=-1)
    logp = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - z
    p = torch.exp(x - z.unsqueeze(-1))
    ent = z - (p * x).sum(-1)
    return z, logp, ent, p


def chunk_dlogits_from_p(
    p: torch.Tensor, g: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """chunk_dlogits from the kept probabilities p [c, V] float32 (clobbered in place: each chunk
    is used once): g * (onehot(target) - p) in `dtype` (default float32). The same operations on
    the same p as chunk_dlogits after its exp, so the same values to the bit."""
    d = p.mul_(-g.unsqueeze(-1))
    d.scatter_add_(-1, targets.unsqueeze(-1), g.unsqueeze(-1))
    return d.to(p.dtype if dtype is None else dtype)


def chunk_dlogits_from_p_pointwise(
    p: torch.Tensor, g: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """chunk_dlogits_from_p as one pointwise expression (the scatter as a where on the target
    column, as chunk_dlogits_pointwise): one compiled pass reading p, writing the GEMM-dtype
    gradient."""
    dl = p * (-g.unsqueeze(-1))
    col = torch.arange(p.shape[-1], device=p.device)
    d = torch.where(col == targets.unsqueeze(-1), dl + g.unsqueeze(-1), dl)
    return d.to(p.dtype if dtype is None else dtype)


def chunk_dlogits(
    logits: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """d(sum g * logp) / d logits = g * (onehot(target) - softmax(logits)), in `dtype` (default:
    the logits' dtype). `logits` is a fresh matmul output, clobbered in place (no float32 copy
    when it is float32)."""
    p = logits.float().sub_(lse.unsqueeze(-1)).exp_()
    return chunk_dlogits_from_p(p, g, targets, logits.dtype if dtype is None else dtype)


def chunk_dlogits_pointwise(
    logits: torch.Tensor,
    lse: torch.Tensor,
    g: torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """chunk_dlogits as one pointwise expression (the scatter becomes a where on the target
    column), which torch.compile fuses into a single pass reading the low-precision logits and
    writing the low-precision gradient: no [c x V] float32 tensor at all. Same values: at the
    target column -g * p + g, elsewhere -g * p."""
    p = torch.exp(logits.float() - lse.unsqueeze(-1))
    return chunk_dlogits_from_p_pointwise(p, g, targets, logits.dtype if dtype is None else dtype)


_COMPILED: dict[str, Callable[..., Any]] = {}
# What `fused` compiles: the pointwise/reduction forms (no scatter, no in-place input writes).
_COMPILE_SOURCES: dict[str, Callable[..., Any]] = {
    "stats": chunk_stats,
    "stats_p": chunk_stats_keep_p_pointwise,
    "dlogits": chunk_dlogits_pointwise,
    "dlogits_p": chunk_dlogits_from_p_pointwise,
}


def _compiled(which: str) -> Callable[..., Any]:
    """torch.compile'd chunk math (built on first use, shared by every model of the process).
    dynamic=True: the last chunk of every micro-batch has its own row count, and a static compile
    would recompile per distinct size until dynamo's cache limit, then silently run eager."""
    fn = _COMPILED.get(which)
    if fn is None:
        fn = torch.compile(_COMPILE_SOURCES[which], dynamic=True)
        _COMPILED[which] = fn
    return fn


def _mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as float32 for the weight gradient. Low-precision inputs used to be copied to
    float32 first (a [V x chunk] copy and a float32 GEMM without tensor cores: on the H200 at 16k
    tokens and vocab 152k, ~5 TFLOP run at fp32 SIMT speed). The tensor-core GEMM with float32
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
    fused: run each chunk's softmax math torch.compile'd (one or two passes over the
    low-precision logits instead of ~10 over float32 copies; the same values to rounding).
    fp32: the chunk logits are the GEMM's float32 output (trainer.logits_fp32); else rounded
    to the GEMM dtype.
    cache_gib (trainer.head_cache_gib): keep the [N x V] float32 probabilities for the backward
    when they fit in this many GiB (no logits GEMM in the backward, same gradients); 0: always
    recompute."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    if cache_gib < 0:
        raise ValueError("cache_gib must be >= 0")
    lead = targets.shape
    hf = h.reshape(-1, h.shape[-1])
    keep_p = head_cache_fits(hf.shape[0], weight.shape[0], cache_gib) and (
        # Only when a backward will come: under no_grad (or frozen inputs) keeping p is waste.
        torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    )
    logp, ent = _ChunkedLogProbs.apply(
        hf, weight, targets.reshape(-1).long(), int(chunk), bool(fused), bool(fp32), keep_p
    )
    return logp.view(lead), ent.view(lead)


def head_cache_fits(n: int, vocab: int, cache_gib: float) -> bool:
    """Whether n tokens' float32 probabilities over `vocab` (n * vocab * 4 bytes) fit the
    head_cache_gib budget (0 disables the cache)."""
    return cache_gib > 0 and n * vocab * 4 <= cache_gib * 2**30


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
    `fused` (set by trainer.parallel when trainer.compile is on, CUDA only): compiled chunk math.
    `logits_fp32` (trainer.logits_fp32, default on): logits are the GEMM's float32 output, in
    both modes (as the engine's; services/common/lm_head.py).
    `head_cache_gib` (trainer.head_cache_gib): the budget for keeping the chunked head's
    probabilities for its backward (0: recompute the logits there)."""

    targets: torch.Tensor | None = None
    chunk: int = 0
    fused: bool = False
    logits_fp32: bool = True
    head_cache_gib: float = 12.0

    def forward(self, h: torch.Tensor) -> Any:  # type: ignore[override]
        if self.targets is None:
            return float32_head(h, self.weight) if self.logits_fp32 else super().forward(h)
        return chunked_logprobs(
            h, self.weight, self.targets, self.chunk, self.fused, self.logits_fp32, self.head_cache_gib
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
