"""Mamba-2 mixer for the engine (HF NemotronHMamba2Mixer's parameter names), over the per-sequence
state cache (state_cache.py):

    in_proj -> [z | xBC | dt]; causal depthwise conv1d + SiLU on xBC -> x, B, C;
    dt = clamp(softplus(dt + dt_bias)); SSD with A = -exp(A_log) and the D skip;
    gated group RMSNorm(y * silu(z)); out_proj

the function of the trainer's Mamba2Mixer (trainer/nemotron.py) on the same definitions
(ops/mamba2.py). A step's spans start from their slot's states (zeroed for a sequence's first
span) and leave their final states there: one-token spans (decodes) advance together by the
recurrent step (on CUDA the Triton kernel updating the pool in place, ops/mamba2_triton.py),
longer spans (prompt chunks) run the chunked scan one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops.mamba2 import (
    causal_conv1d,
    conv1d_step,
    conv_state_after,
    gated_rms_norm,
    split_xbc,
    ssd_chunked,
    ssd_step,
    time_step,
)
from services.common.config import ModelConfig
from services.engine.batch import StateMeta
from services.engine.state_cache import StateCache


class Mamba2Mixer(nn.Module):
    def __init__(self, m: ModelConfig, mamba_index: int):
        super().__init__()
        self.mamba_index = mamba_index  # its layer in the state cache
        self.n_heads, self.head_dim, self.state = m.mamba_n_heads, m.mamba_head_dim, m.ssm_state_size
        self.groups, self.chunk, self.kernel = m.mamba_n_groups, m.mamba_chunk_size, m.mamba_conv_kernel
        self.dt_min, self.dt_max = m.mamba_dt_min, m.mamba_dt_max
        self.inner = m.mamba_n_heads * m.mamba_head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state
        self.eps = m.norm_eps
        self.in_proj = nn.Linear(m.dim, self.inner + self.conv_dim + self.n_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=True)
        self.dt_bias = nn.Parameter(torch.ones(self.n_heads))
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.D = nn.Parameter(torch.ones(self.n_heads))
        self.norm = _Weight(self.inner)
        self.out_proj = nn.Linear(self.inner, m.dim, bias=False)

    def forward(self, x: torch.Tensor, meta: StateMeta, states: StateCache) -> torch.Tensor:
        """x [T, dim] (the step's flat tokens) -> [T, dim]; the spans' states advance in `states`."""
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.n_heads], dim=-1)
        y = torch.empty(x.shape[0], self.n_heads, self.head_dim, dtype=torch.float32, device=x.device)
        w, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        a = -torch.exp(self.A_log.float())
        conv, ssm = states.conv[self.mamba_index], states.ssm[self.mamba_index]
        if meta.decode_rows.numel():
            rows, slots = meta.decode_rows, meta.decode_slots
            out, conv[slots] = conv1d_step(xbc[rows], conv[slots], w, bias)
            xs, bm, cm = self._split_xbc(F.silu(out))
            step_dt = self._time_step(dt[rows])
            if x.is_cuda:
                from ops.mamba2_triton import ssd_step_pool  # Triton: the CUDA path only

                y[rows] = ssd_step_pool(ssm, slots, xs, step_dt, a, bm, cm, self.D)
            else:
                y[rows], ssm[slots] = ssd_step(ssm[slots], xs, step_dt, a, bm, cm, self.D)
        for first, n, slot in meta.prefill:
            span = xbc[None, first : first + n]
            prev = conv[slot][None]
            out = causal_conv1d(span, w, bias, prev)
            conv[slot] = conv_state_after(span, self.kernel, prev)[0]
            xs, bm, cm = self._split_xbc(F.silu(out))
            ys, final = ssd_chunked(
                xs,
                self._time_step(dt[None, first : first + n]),
                a,
                bm,
                cm,
                self.chunk,
                self.D,
                ssm[slot][None],
            )
            y[first : first + n], ssm[slot] = ys[0], final[0]
        out = gated_rms_norm(
            y.view(x.shape[0], self.inner), z, self.norm.weight, self.inner // self.groups, self.eps
        )
        return self.out_proj(out.to(x.dtype))

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_xbc(xbc, self.n_heads, self.head_dim, self.groups, self.state)

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        return time_step(dt, self.dt_bias, self.dt_min, self.dt_max)


class _Weight(nn.Module):
    """HF's `mixer.norm.weight` (the gated norm's scale; the norm itself is ops/mamba2.py's)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
