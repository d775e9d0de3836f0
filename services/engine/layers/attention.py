"""GQA attention with HF's parameter names (q/k/v/o_proj, Qwen3's q_norm/k_norm) over the paged KV
cache: the torch path (gathered pages + SDPA, the CPU path) and the GPU path's Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.common.config import ModelConfig
from services.engine.batch import ForwardBatch
from services.engine.kv_cache import KVCache
from services.engine.layers.linear import FusedRows, fuse_rows
from services.engine.layers.norm import RMSNorm
from services.engine.layers.rope import norm_rope


class Attention(nn.Module):
    def __init__(self, m: ModelConfig, layer_idx: int, bias: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = m.n_heads, m.n_kv_heads, m.head_dim
        self.scale = m.head_dim**-0.5
        self.q_proj = nn.Linear(m.dim, m.n_heads * m.head_dim, bias=bias)
        self.k_proj = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=bias)
        self.v_proj = nn.Linear(m.dim, m.n_kv_heads * m.head_dim, bias=bias)
        self.o_proj = nn.Linear(m.n_heads * m.head_dim, m.dim, bias=False)
        # Qwen3 normalises each head's q and k before RoPE; Llama/Qwen2 do not.
        self.q_norm = RMSNorm(m.head_dim, m.norm_eps) if m.qk_norm else None
        self.k_norm = RMSNorm(m.head_dim, m.norm_eps) if m.qk_norm else None
        # Set by fuse(): one [q + k + v, dim] GEMM whose weight's row blocks ARE q/k/v_proj's.
        self.qkv: FusedRows | None = None

    def fuse(self) -> bool:
        """One GEMM instead of three (fuse_rows); False when nothing could be fused."""
        self.qkv = fuse_rows([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv is not None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv is not None and batch.paged is not None:
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = self.qkv(x).split([nq, nkv, nkv], dim=-1)  # strided views
            q = q.view(t, self.n_heads, self.head_dim)
            k = k.view(t, self.n_kv_heads, self.head_dim)
            v = v.view(t, self.n_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(t, self.n_kv_heads, self.head_dim)
            v = self.v_proj(x).view(t, self.n_kv_heads, self.head_dim)
        if batch.paged is not None:
            # GPU path (attention_backend "triton", services/engine/kernels/): one kernel
            # normalises and rotates q/k and stores k/v in the page pool, then attention reads the
            # pool directly (no gathered copy). Imported here so the CPU path never loads Triton.
            from services.engine.kernels.paged_attention import attend
            from services.engine.kernels.qk_rope import qk_rope_store

            kc, vc = kv.k[self.layer_idx], kv.v[self.layer_idx]
            qn, kn = self.q_norm, self.k_norm
            q = qk_rope_store(
                q, k, v, cos, sin, None if qn is None else qn.weight, None if kn is None else kn.weight,
                0.0 if qn is None else qn.eps, kc, vc, batch.slot_mapping,
            )  # fmt: skip
            out = attend(q, kc, vc, batch.paged, self.scale, kv.block_size).view(t, -1)
            if type(self.o_proj) is nn.Linear:  # not an fp8-converted layer
                from services.engine.kernels.gemv import decode_linear

                return decode_linear(out, self.o_proj.weight, self.o_proj.bias)
            return self.o_proj(out)
        q, k = norm_rope(q, cos, sin, self.q_norm), norm_rope(k, cos, sin, self.k_norm)

        # New keys/values go into the cache first, so every query reads its whole context
        # (earlier steps' tokens and this step's) from one place.
        kv.store(self.layer_idx, batch.slot_mapping, k, v)
        out = torch.empty_like(q)
        for g in batch.groups:
            kc, vc = kv.load(self.layer_idx, g.block_tables)  # [B, ctx, n_kv, D], gathered by page
            qg = q[g.q_index]  # [B, Lq, H, D], padding rows read some real token and are dropped
            o = F.scaled_dot_product_attention(
                qg.transpose(1, 2),
                kc.transpose(1, 2),
                vc.transpose(1, 2),
                attn_mask=g.mask,
                scale=self.scale,
                enable_gqa=self.n_heads != self.n_kv_heads,
            )
            out[g.out_index] = o.transpose(1, 2)[g.q_valid]
        return self.o_proj(out.view(t, -1))
