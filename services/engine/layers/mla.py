"""Multi-head Latent Attention (DeepSeek-V3, Kimi-K2, GLM-5) over the paged KV cache.

HF's DeepseekV3Attention, with HF parameter names:

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x) without q_lora_rank)
               -> per head [qk_nope | qk_rope]
    c, k_pe  = kv_a_proj_with_mqa(x) -> [kv_lora_rank | qk_rope]; c = kv_a_layernorm(c)
    k, v     = kv_b_proj(c) -> per head [qk_nope | v_head_dim]; k = [k_nope | k_pe] (k_pe shared)
    out      = o_proj(softmax(q k^T / sqrt(qk_nope + qk_rope)) v)

Only the compressed KV is cached: per token and layer the latent c (kv_lora_rank) and the roped
shared key k_pe (qk_rope_head_dim), one "head" of kv_lora_rank + qk_rope_head_dim in the KVCache's
K pool (its V pool has width 0). For DeepSeek-V3 that is 576 values instead of 128 heads x 320.

Attention reads the latents and takes one of two equal routes:
  * expanded (prefill groups): kv_b_proj over the context's latents gives per-head K and V, then
    SDPA. Cheapest when many queries share the expansion.
  * absorbed (decode groups): W_UK is folded into the query (q_nope W_UK -> a kv_lora_rank vector
    per head) and W_UV applied after attention, so attention is MQA directly over the cached
    latents (keys [c | k_pe], values c) and the context is never expanded.

On the GPU path (attention_backend "triton", kernels/mla_decode.py) the decode rows of a step take
the absorbed route in Triton: the latents are read straight from the page pool (no gathered
copy), GLM-5's indexer scores the paged indexer keys and the query attends its top-k through
the page table, and a decode step is CUDA-graph capturable (cuda_graphs.DecodeGraphs). Prefill
spans of the same step keep the expanded torch route over their gathered groups.

RoPE is DeepSeek's interleaved variant (pairs (x0, x1), (x2, x3), ... share a frequency; HF's
rope_interleave = true, torchtitan's complex-number RoPE), written out in HF's de-interleaved
order; q and k use the same order, so scores are those of the original.

GLM-5 (arch glm_moe_dsa) adds DeepSeek Sparse Attention: a lightweight indexer per layer
(`Indexer`, HF `self_attn.indexer.*`, GlmMoeDsaIndexer) scores every visible key for each query,
and the query attends only to its `index_topk` best keys. The indexer's own key (index_head_dim
values per token and layer) is cached next to the latent. While a context holds at most index_topk
keys every key is selected, so the indexer is skipped and attention is plain MLA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ops.topk import topk_first
from services.common.config import ModelConfig
from services.engine.batch import ForwardBatch
from services.engine.kv_cache import KVCache

# DeepSeek's q_a_layernorm / kv_a_layernorm are built with the RMSNorm default eps, not
# rms_norm_eps (HF DeepseekV3Attention does the same).
LATENT_NORM_EPS = 1e-6


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, rope_dim]; cos/sin [T, rope_dim] in rotate_half layout (angles duplicated).
    Returns the rotated pairs as [even parts | odd parts], HF's apply_rotary_pos_emb_interleave."""
    half = x.shape[-1] // 2
    c = cos[:, None, :half].to(x.dtype)
    s = sin[:, None, :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class Indexer(nn.Module):
    """DSA indexer: score(q, key) = sum_h w_h(q) relu(q_h . key / sqrt(D)), with per-query head
    weights w = weights_proj(x) / sqrt(H); RoPE (interleaved) on the first qk_rope_head_dim dims."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        if not m.q_lora_rank:
            raise ValueError("the DSA indexer reads the low-rank query: it needs q_lora_rank > 0")
        self.n_heads, self.head_dim, self.rope, self.topk = (
            m.index_n_heads,
            m.index_head_dim,
            m.qk_rope_head_dim,
            m.index_topk,
        )
        self.wq_b = nn.Linear(m.q_lora_rank, m.index_n_heads * m.index_head_dim, bias=False)
        self.wk = nn.Linear(m.dim, m.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(m.index_head_dim, eps=LATENT_NORM_EPS)
        self.weights_proj = nn.Linear(m.dim, m.index_n_heads, bias=False)
        self.scale = m.index_head_dim**-0.5

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # HF keeps weights_proj in float32 (_keep_in_fp32_modules); so does the engine.
        super()._apply(fn, recurse)
        if isinstance(self.weights_proj, nn.Linear):  # (not once quantised by fp8_linear)
            self.weights_proj.weight.data = self.weights_proj.weight.data.float()
        return self

    def project(
        self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token: queries [T, H, D], head weights [T, H] (float32) and the key [T, D]."""
        r = self.rope
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim)
        q = torch.cat((apply_rope_interleaved(q[..., :r], cos, sin), q[..., r:]), -1)
        k = self.k_norm(self.wk(x))
        k = torch.cat((apply_rope_interleaved(k[:, None, :r], cos, sin)[:, 0], k[:, r:]), -1)
        w = self.weights_proj(x.float()).float() * self.n_heads**-0.5
        return q, w, k

    def select(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [B, Lq, H, D], w [B, Lq, H], keys [B, ctx, D], mask [B, 1, Lq, ctx] (causal) -> the
        mask narrowed to each query's top-k keys."""
        kt = keys.float().transpose(1, 2)
        scores = torch.zeros(mask.shape[0], mask.shape[2], mask.shape[3], device=q.device)
        # One head at a time: [B, Lq, ctx] live instead of [B, Lq, H, ctx].
        for h in range(self.n_heads):
            scores += w[..., h, None] * F.relu(torch.matmul(q[:, :, h].float(), kt) * self.scale)
        scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        # Ties go to the earlier key, as in the trainer (trainer/glm5.py): keys whose every head's
        # ReLU is 0 score exactly 0, and torch.topk breaks such ties in a shape-dependent order,
        # so the trainer would attend to other keys than the ones the sample was drawn with.
        top = topk_first(scores, self.topk)
        keep = torch.zeros_like(mask[:, 0]).scatter_(-1, top, True)
        return mask & keep[:, None]


class MLAttention(nn.Module):
    def __init__(self, m: ModelConfig, layer_idx: int, bias: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = m.n_heads
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.rank = m.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        qk = m.n_heads * (self.nope + self.rope)
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(m.dim, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, qk, bias=False)
        else:
            self.q_proj = nn.Linear(m.dim, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(m.dim, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, m.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(m.n_heads * self.v_dim, m.dim, bias=bias)
        self.q_lora = bool(m.q_lora_rank)
        self.indexer = Indexer(m) if m.index_topk else None
        # None: absorbed for decode groups (one query per sequence), expanded otherwise. Tests pin
        # it to compare the two routes.
        self.absorb: bool | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        t, h = x.shape[0], self.n_heads
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else x
        q = self.q_b_proj(q_resid) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        q_pe = apply_rope_interleaved(q_pe, cos, sin)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = torch.cat(
            (self.kv_a_layernorm(c), apply_rope_interleaved(k_pe[:, None], cos, sin)[:, 0]), -1
        )
        iq = iw = ik = None
        if self.indexer is not None:
            iq, iw, ik = self.indexer.project(x, q_resid, cos, sin)
        if batch.paged is not None:
            out = self._paged_decode(q_nope, q_pe, latent, iq, iw, ik, batch, kv)
        else:
            kv.store(self.layer_idx, batch.slot_mapping, latent[:, None], latent.new_empty(t, 1, 0))
            if ik is not None:
                kv.store_index(self.layer_idx, batch.slot_mapping, ik)
            out = q.new_empty(t, h, self.v_dim)
        # The torch path's groups; on the paged path only the prefill spans' (expanded route).
        for g in batch.groups:
            ctx = kv.load(self.layer_idx, g.block_tables)[0][:, :, 0]  # [B, ctx, rank + rope]
            qn, qp = q_nope[g.q_index], q_pe[g.q_index]  # [B, Lq, H, *]
            mask = g.mask
            if self.indexer is not None and g.ctx_len > self.indexer.topk:
                assert iq is not None and iw is not None
                keys = kv.load_index(self.layer_idx, g.block_tables)
                mask = self.indexer.select(iq[g.q_index], iw[g.q_index], keys, mask)
            absorb = self.absorb if self.absorb is not None else qn.shape[1] == 1
            o = self._absorbed(qn, qp, ctx, mask) if absorb else self._expanded(qn, qp, ctx, mask)
            out[g.out_index] = o[g.q_valid]
        return self.o_proj(out.reshape(t, h * self.v_dim))  # (the absorbed einsum's layout may differ)

    def _paged_decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        iq: torch.Tensor | None,
        iw: torch.Tensor | None,
        ik: torch.Tensor | None,
        batch: ForwardBatch,
        kv: KVCache,
    ) -> torch.Tensor:
        """The GPU path (attention_backend "triton", kernels/mla_decode.py): stores this step's
        latents (and indexer keys) in the pools, then the decode rows attend over the pool in the
        absorbed form, DSA rows over their indexer's top-k. [T, H, v_dim]: decode rows filled,
        prefill rows left to the groups (their expanded route), padding rows zero."""
        # Imported here so the CPU path never loads Triton.
        from services.engine.kernels.mla_decode import index_scores, mla_decode, select_topk, store_rows

        paged = batch.paged
        assert paged is not None
        pool = kv.k[self.layer_idx].view(kv.k.shape[1], -1)  # [rows, rank + rope]
        store_rows(latent, pool, batch.slot_mapping)
        if ik is not None:
            assert kv.index_k is not None
            store_rows(ik, kv.index_k[self.layer_idx], batch.slot_mapping)
        dec = paged.decode
        if dec is None:
            return q_nope.new_empty(q_nope.shape[0], self.n_heads, self.v_dim)
        w_uk, w_uv = self._absorb_weights(q_nope.dtype)
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        top = None
        # A batch whose tables span at most index_topk keys selects every key: dense attention,
        # the indexer skipped (a static shape, so a CUDA graph decides it at capture).
        if self.indexer is not None and dec.block_tables.shape[1] * kv.block_size > self.indexer.topk:
            assert iq is not None and iw is not None and kv.index_k is not None
            scores = index_scores(iq, iw, kv.index_k[self.layer_idx], dec, self.indexer.scale, kv.block_size)
            top = select_topk(scores, self.indexer.topk)
        o_lat = mla_decode(
            torch.cat((q_lat, q_pe), -1), pool, dec, self.scale, kv.block_size, self.rank, top, paged.padded
        )
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def _absorb_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, rank] and W_UV [H, v_dim, rank] out of kv_b_proj."""
        lin = self.kv_b_proj
        # fp8 quantisation (fp8_linear) replaces the Linear: absorb its dequantised weight.
        weight = lin.dequantized_weight() if hasattr(lin, "dequantized_weight") else lin.weight
        w = weight.to(dtype).view(self.n_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def _expanded(
        self, qn: torch.Tensor, qp: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b, n = ctx.shape[:2]
        kvb = self.kv_b_proj(ctx[..., : self.rank]).view(b, n, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kvb.split([self.nope, self.v_dim], dim=-1)
        k_pe = ctx[:, :, None, self.rank :].expand(b, n, self.n_heads, self.rope)
        o = F.scaled_dot_product_attention(
            torch.cat((qn, qp), -1).transpose(1, 2),
            torch.cat((k_nope, k_pe), -1).transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
        )
        return o.transpose(1, 2)  # [B, Lq, H, v_dim]

    def _absorbed(
        self, qn: torch.Tensor, qp: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        w_uk, w_uv = self._absorb_weights(qn.dtype)
        q_lat = torch.einsum("blhn,hnr->bhlr", qn, w_uk)
        o_lat = F.scaled_dot_product_attention(
            torch.cat((q_lat, qp.transpose(1, 2)), -1),  # [B, H, Lq, rank + rope]
            ctx[:, None],  # keys [c | k_pe], one head shared by all
            ctx[:, None, :, : self.rank],  # values c
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return torch.einsum("bhlr,hvr->blhv", o_lat, w_uv)
