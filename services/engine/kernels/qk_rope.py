"""One kernel for what sits between the QKV projections and attention on the GPU path.

Per token: Qwen3's per-head RMSNorm of q and k (when the model has it), RoPE (rotate_half layout,
cos/sin already gathered at each token's position, float32), then q is written out and k, v go
straight into the page pool at the token's slot (slot < 0: padding row, nothing stored).

In torch that is ~15 kernels per layer (two norms, six elementwise ops per RoPE, the cache
writes). Inside a CUDA graph each kernel still costs a couple of microseconds of launch gap, and a
28-layer decode step at batch 1 reads its weights in ~0.3 ms, so those gaps alone would exceed the
whole step's budget; this turns them into one launch per layer. Arithmetic is float32 with one
rounding at the end (the torch path rounds after each op in the model dtype: same function within
bf16 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl


@triton.jit
def _rope_heads(
    x_ptr,
    stride_h,
    w1,
    w2,
    cos_ptr,
    sin_ptr,
    eps,
    N_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    """Load [N_HEADS, 2 * HALF] at x_ptr, RMS-normalise each head (NORM: by weight halves w1, w2,
    already loaded), rotate: both halves."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF)
    hmask = (offs_h < N_HEADS)[:, None]
    base = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=hmask, other=0.0).to(tl.float32)
    if NORM:
        ms = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        r = tl.rsqrt(ms + eps)[:, None]
        x1 = x1 * r * w1[None, :]
        x2 = x2 * r * w2[None, :]
    c1 = tl.load(cos_ptr + offs_d)[None, :]
    c2 = tl.load(cos_ptr + HALF + offs_d)[None, :]
    s1 = tl.load(sin_ptr + offs_d)[None, :]
    s2 = tl.load(sin_ptr + HALF + offs_d)[None, :]
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _qk_rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    q_out_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ot,
    stride_oh,
    stride_ct,
    stride_ch,
    eps,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    H_KV: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cos = cos_ptr + t * stride_cs
    sin = sin_ptr + t * stride_cs
    offs_d = tl.arange(0, HALF)
    # Before the PDL wait (ops/pdl.py) only what no kernel of the forward writes: the q/k norm
    # weights and the token's slot (copied in by the host before the forward).
    if NORM:
        qw1 = tl.load(qw_ptr + offs_d).to(tl.float32)
        qw2 = tl.load(qw_ptr + HALF + offs_d).to(tl.float32)
        kw1 = tl.load(kw_ptr + offs_d).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + offs_d).to(tl.float32)
    else:
        qw1 = tl.zeros([HALF], tl.float32)  # unused without NORM
        qw2 = qw1
        kw1 = qw1
        kw2 = qw1
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # q/k/v, cos/sin come from earlier kernels; the pool is read by earlier ones
    # q, k: normalise, rotate; v: copied. Slot < 0 stores no k/v.
    q1, q2 = _rope_heads(q_ptr + t * stride_qt, stride_qh, qw1, qw2, cos, sin, eps, H, H_PAD, HALF, NORM)
    k1, k2 = _rope_heads(k_ptr + t * stride_kt, stride_kh, kw1, kw2, cos, sin, eps, H_KV, HKV_PAD, HALF, NORM)
    offs_k = tl.arange(0, HKV_PAD)
    kmask = (offs_k < tl.where(slot >= 0, H_KV, 0))[:, None]
    src = v_ptr + t * stride_vt + offs_k[:, None] * stride_vh + offs_d[None, :]
    v1 = tl.load(src, mask=kmask)
    v2 = tl.load(src + HALF, mask=kmask)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    offs_h = tl.arange(0, H_PAD)
    qo = q_out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    qmask = (offs_h < H)[:, None]
    tl.store(qo, q1.to(q_out_ptr.dtype.element_ty), mask=qmask)
    tl.store(qo + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=qmask)
    dst = slot * stride_ct + offs_k[:, None] * stride_ch + offs_d[None, :]
    tl.store(kc_ptr + dst, k1.to(kc_ptr.dtype.element_ty), mask=kmask)
    tl.store(kc_ptr + dst + HALF, k2.to(kc_ptr.dtype.element_ty), mask=kmask)
    tl.store(vc_ptr + dst, v1.to(vc_ptr.dtype.element_ty), mask=kmask)
    tl.store(vc_ptr + dst + HALF, v2.to(vc_ptr.dtype.element_ty), mask=kmask)


def qk_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, n_kv, D] (views of the projections are fine: last dim contiguous);
    cos/sin [T, D] float32; q_norm/k_norm: the per-head RMSNorm weights [D] or None (Llama).
    Returns the rotated q; k (rotated) and v are written to the caches at `slots`."""
    t, h, d = q.shape
    h_kv = k.shape[1]
    assert d % 2 == 0 and q.stride(2) == k.stride(2) == v.stride(2) == 1 and cos.stride(1) == 1
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    norm = q_norm is not None and k_norm is not None
    qw = q_norm if q_norm is not None else cos  # unused without NORM
    kw = k_norm if k_norm is not None else cos
    gdc = pdl.launch(q)
    _qk_rope_store_kernel[(t,)](
        q, k, v, cos, sin, qw, kw, q_out, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), eps,
        H=h, H_PAD=triton.next_power_of_2(h), H_KV=h_kv, HKV_PAD=triton.next_power_of_2(h_kv), HALF=d // 2,
        NORM=norm, USE_GDC=gdc, launch_pdl=gdc,
    )  # fmt: skip
    return q_out


__all__ = ["qk_rope_store"]
