"""The LM head's logits: float32 (the model-dtype GEMM's float32 accumulator, as the trainer's head
computes them, ops/lm_head.py) or in the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.lm_head import float32_logits


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool) -> torch.Tensor:
    """[rows, dim] x [vocab, dim] -> [rows, vocab]: float32 if `fp32`, else in the model dtype."""
    if fp32:
        return float32_logits(hidden, weight)
    return F.linear(hidden, weight)
