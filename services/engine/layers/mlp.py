"""The dense SwiGLU MLP (gate/up/down_proj), with gate/up fused into one GEMM on the GPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import ModelConfig
from services.engine.layers.linear import FusedRows, fuse_rows


class MLP(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(m.dim, m.hidden_dim, bias=False)
        self.up_proj = nn.Linear(m.dim, m.hidden_dim, bias=False)
        self.down_proj = nn.Linear(m.hidden_dim, m.dim, bias=False)
        self.gate_up: FusedRows | None = None  # set by fuse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse(self) -> bool:
        """gate/up as one GEMM (fuse_rows); False when they could not be fused."""
        self.gate_up = fuse_rows([self.gate_proj, self.up_proj])
        return self.gate_up is not None

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """GPU path: SiLU and the product in one Triton kernel (ops/fused_norm.py)."""
        from ops.fused_norm import silu_mul
        from services.engine.kernels.gemv import decode_linear

        if self.gate_up is None:  # not fused: their own GEMMs
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # strided views: silu_mul reads strides
        act = silu_mul(gate, up)
        if type(self.down_proj) is nn.Linear:
            return decode_linear(act, self.down_proj.weight, self.down_proj.bias)
        return self.down_proj(act)
