"""Rotary position embeddings: the cos/sin tables (with Llama-3.1 frequency scaling) and their
rotate_half application, computed exactly like the trainer's torchtitan model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ops.rope import llama3_scale_freqs
from services.common.config import RopeScaling
from services.engine.layers.norm import RMSNorm


def rope_cache(
    head_dim: int, max_seq_len: int, base: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_seq_len, head_dim], computed exactly like torchtitan's
    precompute_rope_cache (float32, frequencies duplicated for the rotate_half layout).
    `scaling`: Llama-3.1 frequency scaling, as HF's rope_type "llama3" (ops/rope.py)."""
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    if scaling is not None:
        freqs = llama3_scale_freqs(freqs, scaling)
    t = torch.arange(max_seq_len, dtype=freqs.dtype)
    angles = torch.outer(t, freqs).float()
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] already gathered at each token's position."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm (when the model has it) and RoPE in float32, rounded once to
    x's dtype: what the GPU path's fused kernel computes (kernels/qk_rope.py) and what the trainer
    computes (trainer/model.py, RelayAttention), so the CPU path is the same function as the GPU
    one and both round where the trainer does. x: [T, heads, head_dim]; cos/sin as apply_rope (the
    rope tables are cast with the model, so in bf16 they hold bf16 values, as HF's cos/sin do)."""
    y = x.float()
    if norm is not None:
        y = F.rms_norm(y, (y.shape[-1],), norm.weight.float(), norm.eps)
    return apply_rope(y, cos, sin).to(x.dtype)
