"""Two elementwise fusions of the decoder layer for the GPU path (fewer kernels per layer).

- `add_rms_norm(x, delta, w, eps)` -> (h, y): the residual add and the next RMSNorm in one kernel,
  h = x + delta (rounded to x's dtype, as the torch add), y = rms_norm(h) * w in float32, rounded
  once to delta's dtype. In torch that is an add plus the norm's kernels; the layer does it twice
  (after attention, after the MLP, whose add is fused into the next layer's input norm or the
  final norm). Two variants by x's dtype: the model dtype (bf16 residual stream), or float32
  (ModelConfig.fp32_residual: float32 h in and out, bf16 delta, bf16 y), where the add is exact
  up to float32 and the sublayers' sub-ulp kernel differences are not rounded up to a whole bf16
  ulp of the (larger) residual.
- `silu_mul(gate, up)` = silu(gate) * up in one kernel (torch: two), float32 inside, one rounding.

Why: a batch-1 decode step reads its weights in ~0.3 ms but runs ~15 kernels per layer; inside a
CUDA graph each still costs a few microseconds of gap, so launches, not bytes, set the step time.
Only the GPU path uses these (CausalLM.fused_elementwise); the CPU path keeps the torch ops bit for
bit. Rows must be contiguous in their last dimension.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl


@triton.jit
def _add_rms_norm(
    x_ptr,
    d_ptr,
    w_ptr,
    h_ptr,
    y_ptr,
    stride_x,
    stride_d,
    dim,
    eps,
    BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    # The norm weight before the PDL wait (ops/pdl.py): nothing in the forward writes it.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # x and delta come from earlier kernels
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    h = (x + d).to(h_ptr.dtype.element_ty)  # the residual stream keeps its dtype (bf16 or float32)
    tl.store(h_ptr + row * dim + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / dim + eps)
    tl.store(y_ptr + row * dim + cols, (hf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(g_ptr, u_ptr, out_ptr, stride_g, stride_u, width, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # gate/up are the previous GEMM's output (ops/pdl.py)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [T, D]; returns (x + delta in x's dtype, rms_norm(x + delta) * weight in delta's
    dtype): x is the residual stream (model dtype, or float32 with fp32_residual), delta a
    sublayer's output and y the next GEMM's input, both in the model dtype."""
    x, delta = _rows(x), _rows(delta)
    t, dim = x.shape
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = torch.empty_like(h, dtype=delta.dtype)
    if t:
        block = triton.next_power_of_2(dim)
        gdc = pdl.launch(x)
        _add_rms_norm[(t,)](
            x, delta, weight, h, y, x.stride(0), delta.stride(0), dim, eps, BLOCK=block, USE_GDC=gdc,
            num_warps=min(16, max(1, block // 256)), launch_pdl=gdc,
        )  # fmt: skip
    return h, y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] tensors."""
    gate, up = _rows(gate), _rows(up)
    t, width = gate.shape
    out = torch.empty((t, width), dtype=gate.dtype, device=gate.device)
    if t:
        block = min(1024, triton.next_power_of_2(width))
        gdc = pdl.launch(gate)
        _silu_mul[(t, triton.cdiv(width, block))](
            gate,
            up,
            out,
            gate.stride(0),
            up.stride(0),
            width,
            BLOCK=block,
            USE_GDC=gdc,
            num_warps=4,
            launch_pdl=gdc,
        )
    return out


__all__ = ["add_rms_norm", "silu_mul"]
