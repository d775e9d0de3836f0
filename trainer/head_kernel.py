"""The chunked LM head's softmax math as two Triton kernels (CUDA, `ChunkedOutput.fused`).

Per chunk of c tokens the head has [c x V] float32 logits x (V ~ 152k). What it needs from them:

- `row_stats(x, targets)` -> (lse, logp, entropy), float32 [c]: ONE pass over x. Each lane keeps its
  own running max m, sum s = sum e^(x - m) and t = sum e^(x - m) * (x - m) across the vocabulary
  tiles, and the lanes are combined once at the end (rescaled to the row max M), so the loop is
  pure streaming with no per-tile reduction. lse = M + log S, entropy = log S - T / S
  (= -sum p log p), logp = x[target] - lse.
- `onehot_minus_p(x, lse, targets, dtype)` -> q = onehot(target) - exp(x - lse) [c x V] in the GEMM
  dtype: what the backward's two GEMMs take (chunked.py: the per-token upstream gradient scales
  their [c x D] operands instead of q).

torch.compile's version of the same math reads x three times for the statistics and
writes p as float32: 2.8 ms per 4,096-row chunk for the stats plus 1.8 ms in the backward turning p
into the gradient, on the H200.

Under TRITON_INTERPRET=1 (set before this module is imported) they run on CPU: tests/test_head_kernel.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tiles: the stats kernel streams a row in STATS_BLOCK-wide tiles (one program per row); the q
# kernel is pointwise over (row, Q_BLOCK columns).
STATS_BLOCK = 2048
Q_BLOCK = 2048


@triton.jit
def _row_stats_kernel(
    x_ptr,
    t_ptr,
    lse_ptr,
    logp_ptr,
    ent_ptr,
    stride_x,
    V,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)
    # A finite floor instead of -inf: a lane that has seen nothing yet then rescales by
    # exp2(floor - m) = 0, never by exp2(-inf + inf) = nan.
    m = tl.full([BLOCK], -1.0e30, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    # t = sum e^(x - m) * (x - m), relative to the lane's running max: entropy = log S - T / S
    # then has no cancellation between two large terms (lse - sum p x loses ~1e-3 at |x| ~ 200).
    t = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        alpha = tl.exp2((m - m_new) * 1.4426950408889634)
        d = x - m_new
        e = tl.exp2(d * 1.4426950408889634)  # masked lanes: exp2(-inf) = 0
        t = alpha * (t + (m - m_new) * s) + tl.where(mask, e * d, 0.0)
        s = s * alpha + e
        m = m_new
    mx = tl.max(m, 0)
    w = tl.exp2((m - mx) * 1.4426950408889634)
    ssum = tl.sum(s * w, 0)
    tsum = tl.sum(w * (t + (m - mx) * s), 0)
    log_s = tl.log2(ssum) * 0.6931471805599453
    lse = mx + log_s
    target = tl.load(t_ptr + row)
    xt = tl.load(base + target).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, xt - lse)
    tl.store(ent_ptr + row, log_s - tsum / ssum)


@triton.jit
def _onehot_minus_p_kernel(
    x_ptr,
    lse_ptr,
    t_ptr,
    q_ptr,
    stride_x,
    stride_q,
    V,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    lse = tl.load(lse_ptr + row)
    target = tl.load(t_ptr + row)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp2((x - lse) * 1.4426950408889634)
    q = tl.where(cols == target, 1.0 - p, -p)
    tl.store(q_ptr + row.to(tl.int64) * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("logits must be [rows, vocab] with contiguous rows")
    if targets.shape != x.shape[:1]:
        raise ValueError("targets must be [rows]")
    return x, targets.contiguous()


def row_stats(x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [c, V] logits (float32 or the model dtype), targets [c] -> (lse, logp, entropy) float32 [c]."""
    x, targets = _rows(x, targets)
    c, v = x.shape
    lse, logp, ent = (torch.empty(c, dtype=torch.float32, device=x.device) for _ in range(3))
    if c:
        _row_stats_kernel[(c,)](x, targets, lse, logp, ent, x.stride(0), v, BLOCK=STATS_BLOCK, num_warps=8)
    return lse, logp, ent


def onehot_minus_p(
    x: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """x [c, V] logits, lse [c] float32 -> onehot(target) - exp(x - lse), [c, V] in `dtype`."""
    x, targets = _rows(x, targets)
    c, v = x.shape
    q = torch.empty((c, v), dtype=dtype, device=x.device)
    if c:
        grid = (c, triton.cdiv(v, Q_BLOCK))
        _onehot_minus_p_kernel[grid](
            x, lse.contiguous(), targets, q, x.stride(0), q.stride(0), v, BLOCK=Q_BLOCK, num_warps=8
        )
    return q
