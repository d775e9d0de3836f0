"""Nemotron-H's squared-ReLU MLP (HF NemotronHMLP: up_proj, down_proj): a `-` layer of the hybrid
stack, and the shared expert of its MoE layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Relu2MLP(nn.Module):
    """down(relu(up(x))^2)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))
