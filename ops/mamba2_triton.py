"""Mamba-2's one-token state update as one Triton kernel, decode's GPU path: per (sequence, head,
block of head channels) it reads the sequence's state rows from the state pool at its slot, decays
them, adds dt x B^T, writes them back in place and gives y = S C + D x. The same function as
ops/mamba2.py ssd_step (float32 state and arithmetic), without gathering the batch's states into
a copy and scattering them back."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(
    state_ptr,
    slot_ptr,
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    y_ptr,
    slot_stride,
    heads_per_group,
    P: tl.constexpr,
    N: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    g = h // heads_per_group
    rows = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < P
    cmask = cols < N
    dt = tl.load(dt_ptr + seq * H + h).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32)
    decay = tl.exp(dt * a)
    x = tl.load(x_ptr + (seq * H + h) * P + rows, mask=rmask, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + (seq * G + g) * N + cols, mask=cmask, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + (seq * G + g) * N + cols, mask=cmask, other=0.0).to(tl.float32)
    offs = slot * slot_stride + (h * P + rows[:, None]) * N + cols[None, :]
    m2 = rmask[:, None] & cmask[None, :]
    s = tl.load(state_ptr + offs, mask=m2, other=0.0)
    s = s * decay + (dt * x)[:, None] * bv[None, :]
    tl.store(state_ptr + offs, s, mask=m2)
    y = tl.sum(s * cv[None, :], axis=1)
    dskip = tl.load(d_ptr + h).to(tl.float32)
    y = y + dskip * x
    tl.store(y_ptr + (seq * H + h) * P + rows, y, mask=rmask)


def ssd_step_pool(
    state: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """state [S, H, P, N] float32 (updated in place at rows `slots` [b]; each slot's [H, P, N]
    contiguous, the slots any stride apart: one layer's view of a [S, layers, ...] pool), x
    [b, H, P], dt [b, H] (after softplus and clamping), A [H], B/C [b, G, N], D [H] -> y [b, H, P]
    float32."""
    if state[0].stride() != (state.shape[2] * state.shape[3], state.shape[3], 1):
        raise ValueError("ssd_step_pool: each slot's state must be contiguous")
    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    y = torch.empty(b, h, p, dtype=torch.float32, device=x.device)
    block_p = min(triton.next_power_of_2(p), 64)
    grid = (b, h, triton.cdiv(p, block_p))
    _step_kernel[grid](
        state,
        slots,
        x.contiguous(),
        dt.float().contiguous(),
        A.float().contiguous(),
        B.contiguous(),
        C.contiguous(),
        D.float().contiguous(),
        y,
        state.stride(0),
        h // g,
        P=p,
        N=n,
        H=h,
        G=g,
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(n),
    )
    return y
