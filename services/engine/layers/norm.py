"""RMSNorm with HF's parameter name (`weight`) and the float32 residual stream's rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            # The float32 residual stream (ModelConfig.fp32_residual) of a lower-precision model:
            # normalise and weight in float32, round once to the model dtype (the next GEMM's
            # input), as ops/fused_norm.py add_rms_norm and the trainer's RelayRMSNorm do.
            y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
            return y.to(self.weight.dtype)
        # Same kernel as torch.nn.RMSNorm, which torchtitan uses.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
