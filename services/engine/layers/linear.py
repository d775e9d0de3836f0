"""Linears that read the same input (q/k/v, gate/up) fused into one GEMM, bf16 or FP8, with each
part's own tensors kept as views so HF names and in-place weight loads keep working."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FusedRows:
    """Linears that read the same input (q/k/v, gate/up) as one GEMM: `weight` (and `bias`) are the
    concatenated rows, and each linear's own tensors are views of their row block, so HF names,
    state_dict and in-place weight loads keep working. `fp8` is set when the linears are FP8: the
    fused Fp8Linear (not a registered submodule, so weight loads still see only the HF names)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    fp8: nn.Module | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8(x)
        from services.engine.kernels.gemv import decode_linear

        return decode_linear(x, self.weight, self.bias)


def fuse_rows(linears: list[nn.Module]) -> FusedRows | None:
    """Fuse linears that read the same input into one GEMM (FusedRows). Call after the last .to()
    (which would re-allocate the views apart) and after any fp8 conversion. None when they cannot
    be fused: mixed kinds, or FP8 parts whose 128-row scale blocks would straddle two of them."""
    if all(type(lin) is nn.Linear for lin in linears):
        with torch.no_grad():
            weight = torch.cat([lin.weight for lin in linears])  # type: ignore[misc]
            biases = [lin.bias for lin in linears]
            bias = None
            if all(b is not None for b in biases):
                bias = torch.cat(biases)  # type: ignore[arg-type]
            elif any(b is not None for b in biases):
                return None
            row = 0
            for lin in linears:
                n = lin.weight.shape[0]  # type: ignore[union-attr]
                lin.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
                if bias is not None:
                    lin.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
                row += n
        return FusedRows(weight, bias)
    from services.engine.layers.fp8 import fuse_fp8_rows

    fused = fuse_fp8_rows(linears)
    if fused is None:
        return None
    return FusedRows(fused.weight_fp8, fused.bias, fp8=fused)
