"""The SwiGLU (SiLU-mul) backward of the FP8 MoE experts' FP8 backward (trainer/fp8.py), as one
Triton pass on CUDA.

The forward computed a = silu(gate) * up from gu = [gate | up] (T, 2I), the fused gate/up GEMM's
output. Given da = dL/da (T, I), the backward needs dgu = [da * up * silu'(gate) | da * silu(gate)]
(T, 2I), silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g), in float32 math. As torch ops that is
~8 elementwise kernels over float32 copies of (T, I) tensors: on the H100 (Qwen3-30B-A3B widths,
16k tokens, 4 layers) the FP8 MoE step's
elementwise time grew by 39 ms a step over bf16's, against 14 ms the FP8 GEMMs saved. One pass
reads gu and da once and writes dgu once, in their dtype.

Under TRITON_INTERPRET=1 (set before this module is imported) it runs on CPU: tests/test_fp8_linear.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.fp8.triton_quant import HAS_TRITON

BLOCK = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_bwd_kernel(gu_ptr, da_ptr, out_ptr, n, inter, BLOCK: tl.constexpr):
        """Elements [pid * BLOCK, ...) of the (T, I) grid: row r, column c of the gate/up halves."""
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < n
        r = idx // inter
        c = idx - r * inter
        gate = tl.load(gu_ptr + r * 2 * inter + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + r * 2 * inter + inter + c, mask=ok, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(gate)
        d_gate = da * up * s * (1.0 + gate * (1.0 - s))
        d_up = da * gate * s
        tl.store(out_ptr + r * 2 * inter + c, d_gate.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptr + r * 2 * inter + inter + c, d_up.to(out_ptr.dtype.element_ty), mask=ok)


def swiglu_backward_reference(gu: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """The same in torch ops (CPU), float32 math, da's dtype out."""
    gate, up = gu.float().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    d = da.float()
    return torch.cat([d * up * s * (1 + gate * (1 - s)), d * F.silu(gate)], dim=-1).to(da.dtype)


def swiglu_backward(gu: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """gu (T, 2I) = [gate | up], da (T, I) -> [d gate | d up] (T, 2I) in da's dtype."""
    t, inter = da.shape
    if tuple(gu.shape) != (t, 2 * inter):
        raise ValueError(f"gu {tuple(gu.shape)} is not [gate | up] for da {tuple(da.shape)}")
    if not (gu.is_cuda and HAS_TRITON):
        return swiglu_backward_reference(gu, da)
    gu, da = gu.contiguous(), da.contiguous()
    out = torch.empty(t, 2 * inter, dtype=da.dtype, device=da.device)
    n = t * inter
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gu, da, out, n, inter, BLOCK=BLOCK, num_warps=4)
    return out
