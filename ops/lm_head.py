"""The LM head's logits in float32, computed the same way by the engine and the trainer
(so that Router Replay's train/inference KL is not floored by the head's rounding).

A bf16 GEMM with a bf16 *output* rounds each of the ~152k logits to a bf16 ulp (0.004-0.016 at
|logit| ~ 1-2). The engine and the trainer accumulate the same products in different orders, and
the rounding turns those float32-sized differences into whole-ulp ones: a per-logit noise that the
log-softmax carries straight into the mismatch KL. With `float32_logits` both sides keep the
GEMM's float32 accumulator instead: the products of the bf16 inputs (exact in float32), summed in
float32, never rounded to bf16 (MiniMax-M1 found the LM head's precision the main train/inference
mismatch source and computes it in float32 too).

`float32_logits(h, weight)` = h @ weight.T with a float32 output, in the GEMM dtype of the inputs
(the autocast dtype under autocast). On CUDA it is one tensor-core GEMM with a float32 output
(`torch.mm(..., out_dtype=torch.float32)`, torch >= 2.8); where that kernel is missing (CPU
builds) the inputs are upcast to float32 first, which computes the same exact products.
"""

from __future__ import annotations

import torch

_MM_OUT_DTYPE: dict[str, bool] = {}


def mm_out_dtype_works(device: torch.device) -> bool:
    """Whether this torch's mm takes out_dtype=float32 for bf16/fp16 inputs on `device` (CUDA
    has it since torch 2.8; CPU builds lack the kernel). Probed once per device type."""
    key = device.type
    if key not in _MM_OUT_DTYPE:
        try:
            a = torch.ones(16, 8, dtype=torch.bfloat16, device=device)
            out = torch.mm(a.t(), a, out_dtype=torch.float32)
            _MM_OUT_DTYPE[key] = out.dtype == torch.float32 and float(out[0, 0]) == 16.0
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


def gemm_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's GEMM runs in: autocast's under autocast (bf16 even for float32
    weights, as nn.Linear would), else the inputs' common dtype."""
    if torch.is_autocast_enabled(h.device.type):
        return torch.get_autocast_dtype(h.device.type)
    return torch.promote_types(h.dtype, weight.dtype)


def float32_logits(h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """h [N, D], weight [V, D] -> logits [N, V] float32: the products of h and weight rounded to
    `dtype` (default gemm_dtype), accumulated and returned in float32. No autograd formula of its
    own (the trainer's heads wrap it in theirs)."""
    dt = gemm_dtype(h, weight) if dtype is None else dtype
    # Autocast off: it would cast a float32 GEMM (the CPU path below) back to bf16 with a bf16 output.
    with torch.autocast(h.device.type, enabled=False):
        a, b = h.to(dt), weight.to(dt)
        if dt == torch.float32:
            return a @ b.t()
        if mm_out_dtype_works(h.device):
            return torch.mm(a, b.t(), out_dtype=torch.float32)
        return a.float() @ b.float().t()
