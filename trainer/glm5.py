"""GLM-5 (arch glm_moe_dsa) in the trainer: torchtitan's DeepSeek-V3 plus DeepSeek Sparse Attention.

GLM-5 is DeepSeek-V3's layout (MLA, leading dense layers, sigmoid-routed MoE with a correction
bias and shared experts: trainer/moe_routing.py) whose attention adds a DSA indexer per layer
(HF `self_attn.indexer.*`, GlmMoeDsaIndexer; the engine's services/engine/layers/mla.py Indexer):

    q_I  = wq_b(q_resid)                 per indexer head, q_resid = q_norm(wq_a(x)) (MLA's own)
    k_I  = k_norm(wk(x))                 one key per token (LayerNorm, eps 1e-6)
    RoPE (interleaved) on the first qk_rope_head_dim dims of both
    w    = weights_proj(x) / sqrt(H_I)   float32
    I[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s] / sqrt(D_I))
    attention of query t runs over the index_topk visible keys s with the highest I[t, s]

Selection is the exact top-k of float32 scores computed in the engine's order (a head at a time),
equal scores going to the earlier key, so the engine and the trainer pick the same keys from the
same weights. While every query
sees at most index_topk keys (T <= index_topk) every visible key is selected and attention is
plain MLA through the block's inner attention (flash / flex / varlen / CP as configured); beyond
that the selection is a dense [T, T] mask and attention runs as SDPA with it (the CPU reference;
a long-context GPU run needs a sparse MLA kernel that reads the selected keys).

The indexer in training (`trainer.dsa_indexer`):
  "frozen" (default)  its weights are not updated: it runs under no_grad and its parameters do
                      not require gradients. The RL loss cannot train it anyway (top-k selection
                      is not differentiable), and a fixed indexer keeps the engine's key
                      selection the same function as the trainer's across weight versions.
  "kl"                DeepSeek-V3.2's sparse-stage objective, how the indexer was trained: the
                      indexer reads detached inputs and learns only from
                      L_I = sum_t KL(p_t,S_t || softmax(I_t,S_t)), p_t the block's attention
                      probabilities summed over heads and L1-normalised over the selected keys
                      S_t (detached); the rest of the model learns only from the RL loss. L_I is
                      scaled by `trainer.dsa_indexer_loss_coef` / the step's loss tokens and
                      enters backward through the attention output (IndexerLoss), so the step
                      loop needs nothing else.

Checkpoint names: `GlmMoeDsaAdapter` (DeepSeek-V3's map plus the indexer's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.model import Attention, apply_rotary_emb

from ops.topk import topk_first
from services.common.config import ModelConfig
from trainer.moe_routing import (
    LATENT_NORM_EPS,
    DeepSeekV3Adapter,
    RelayDeepSeekV3Model,
    deepseek_args,
    latent_norm_eps,
)

IndexerMode = Literal["frozen", "kl"]


class DSAIndexer(nn.Module):
    """HF `self_attn.indexer` (wq_b, wk, k_norm, weights_proj) computing index scores."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        if not m.q_lora_rank:
            raise ValueError("model.q_lora_rank: the DSA indexer reads the low-rank query (q_lora_rank > 0)")
        self.n_heads, self.head_dim, self.rope = m.index_n_heads, m.index_head_dim, m.qk_rope_head_dim
        self.topk = m.index_topk
        self.wq_b = nn.Linear(m.q_lora_rank, m.index_n_heads * m.index_head_dim, bias=False)
        self.wk = nn.Linear(m.dim, m.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(m.index_head_dim, eps=LATENT_NORM_EPS)
        self.weights_proj = nn.Linear(m.dim, m.index_n_heads, bias=False)
        self.scale = m.index_head_dim**-0.5

    def _rope(self, x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Interleaved RoPE on the first `rope` dims of x [B, T, heads, D]."""
        r = self.rope
        return torch.cat((apply_rotary_emb(x[..., :r], freqs_cis, positions), x[..., r:]), dim=-1)

    def scores(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        freqs_cis: torch.Tensor,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [B, T, dim], q_resid [B, T, q_lora_rank] -> index scores I [B, T(query), T(key)],
        float32, unmasked."""
        b, t, _ = x.shape
        q = self._rope(self.wq_b(q_resid).view(b, t, self.n_heads, self.head_dim), freqs_cis, positions)
        k = self._rope(self.k_norm(self.wk(x)).unsqueeze(2), freqs_cis, positions)[:, :, 0]
        w = self.weights_proj(x.float()).float() * self.n_heads**-0.5
        kt = k.float().transpose(1, 2)
        out = x.new_zeros(b, t, t, dtype=torch.float32)
        # A head at a time, in the engine's order (services/engine/layers/mla.py Indexer.select): the same
        # float32 sums, hence the same top-k; [B, T, T] live instead of [B, T, H, T].
        for h in range(self.n_heads):
            out = out + w[..., h, None] * F.relu(torch.matmul(q[:, :, h].float(), kt) * self.scale)
        return out

    def select(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """scores [B, T, T], visible [B|1, T, T] bool -> the visible keys among each query's
        index_topk best (bool [B, T, T]); invisible keys score -inf. Equal scores go to the
        earlier key (as a stable sort): keys whose every head's ReLU is 0 all score exactly 0, and
        torch.topk would break those ties by its own (shape-dependent) order."""
        masked = scores.masked_fill(~visible, float("-inf"))
        top = topk_first(masked, self.topk)  # a stable sort's first index_topk (ops/topk.py)
        keep = torch.zeros_like(masked, dtype=torch.bool).scatter_(-1, top, True)
        return keep & visible

    def init_weights(self) -> None:
        for lin in (self.wq_b, self.wk, self.weights_proj):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        self.k_norm.reset_parameters()


def visible_keys(t: int, positions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """[B|1, T, T] bool: causal, and within one sample of a packed row (positions restart at 0 at
    every sample, trainer/packing.py); positions None = one causal sequence per row."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril_()
    if positions is None:
        return causal[None]
    doc = torch.cumsum((positions == 0).to(torch.int32), dim=-1)  # [B, T]
    return causal[None] & (doc[:, :, None] == doc[:, None, :])


class IndexerLoss(torch.autograd.Function):
    """Identity on the attention output whose backward also seeds the indexer loss's gradient with
    `scale`: L_I joins the step's backward without the step loop adding it to its loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def indexer_kl(
    q: torch.Tensor, k: torch.Tensor, scale: float, selected: torch.Tensor, index_scores: torch.Tensor
) -> torch.Tensor:
    """DeepSeek-V3.2's sparse-stage indexer loss, summed over queries: KL(p || softmax(I)) over
    each query's selected keys, p = the attention probabilities (q [B, H, T, D], k [B, H, T, D],
    detached) summed over heads and L1-normalised. Float32."""
    logits = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~selected[:, None], float("-inf"))
    p = logits.softmax(dim=-1).sum(dim=1)
    p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    log_q = index_scores.masked_fill(~selected, float("-inf")).log_softmax(dim=-1)
    # 0 * log 0 = 0 at unselected keys (where both are 0 / -inf).
    kl = torch.where(selected, p * (torch.log(p.clamp_min(1e-30)) - log_q), torch.zeros_like(p))
    return kl.sum()


class GlmAttention(Attention):
    """torchtitan's MLA attention (same parameters and names) plus the DSA indexer."""

    indexer_mode: IndexerMode = "frozen"
    indexer_loss_scale: float = 0.0  # set per micro-batch by indexer_loss (kl mode)
    indexer_loss_sum: torch.Tensor | None = None  # the last forward's L_I (detached), kl mode

    def __init__(self, args: DeepSeekV3ModelArgs, m: ModelConfig) -> None:
        super().__init__(args)
        self.indexer = DSAIndexer(m)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        attention_masks: Any,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        q_resid = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_resid).view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, freqs_cis, positions)], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis, positions)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        sparse = seqlen > self.indexer.topk
        train_indexer = self.indexer_mode == "kl" and torch.is_grad_enabled()
        selected = index_scores = None
        if sparse or train_indexer:
            visible = visible_keys(seqlen, positions, x.device)
            with torch.set_grad_enabled(train_indexer):
                # kl: the indexer learns from L_I alone (DeepSeek-V3.2 detaches its input).
                index_scores = self.indexer.scores(x.detach(), q_resid.detach(), freqs_cis, positions)
            with torch.no_grad():
                selected = (
                    self.indexer.select(index_scores, visible) if sparse else visible.expand_as(index_scores)
                )
        if sparse:
            assert selected is not None
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=selected[:, None], scale=self.softmax_scale
            )
        else:
            assert attention_masks is None, "GLM-5 attention runs with attn_type 'sdpa'"
            out = self.inner_attention(q, k, v, scale=self.softmax_scale)
        if train_indexer:
            assert selected is not None and index_scores is not None
            loss = indexer_kl(q.detach(), k.detach(), self.softmax_scale, selected, index_scores)
            self.indexer_loss_sum = loss.detach()
            out = IndexerLoss.apply(out, loss, self.indexer_loss_scale)
        out = out.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.indexer.init_weights()


def glm_attentions(model: nn.Module) -> list[GlmAttention]:
    return [a for b in model.layers.values() if isinstance(a := getattr(b, "attention", None), GlmAttention)]  # type: ignore[union-attr]


def set_indexer_mode(model: nn.Module, mode: IndexerMode) -> None:
    """trainer.dsa_indexer: "frozen" (no gradients, never updated) or "kl" (module docstring)."""
    for attn in glm_attentions(model):
        attn.indexer_mode = mode
        attn.indexer.requires_grad_(mode == "kl")


@contextmanager
def indexer_loss(model: nn.Module, scale: float) -> Iterator[list[GlmAttention]]:
    """Inside (forward AND backward): kl mode's L_I enters backward with gradient `scale`. Yields
    the GLM attentions, whose `indexer_loss_sum` holds each layer's last L_I."""
    attns = glm_attentions(model)
    for a in attns:
        a.indexer_loss_scale, a.indexer_loss_sum = scale, None
    try:
        yield attns
    finally:
        for a in attns:
            a.indexer_loss_scale = 0.0


def build_glm5(m: ModelConfig) -> RelayDeepSeekV3Model:
    """torchtitan's DeepSeek-V3 with every block's attention a GlmAttention (frozen indexer)."""
    args = deepseek_args(m)
    model = RelayDeepSeekV3Model(args)
    for block in model.layers.values():
        block.attention = GlmAttention(args, m)
    latent_norm_eps(model)
    set_indexer_mode(model, "frozen")
    return model


class GlmMoeDsaAdapter(DeepSeekV3Adapter):
    """GLM-5's HF names: DeepSeek-V3's map plus the indexer (`self_attn.indexer.*`)."""

    def __init__(self, m: ModelConfig) -> None:
        super().__init__(m)
        for hf, tt in (
            ("wq_b.weight", "wq_b.weight"),
            ("wk.weight", "wk.weight"),
            ("k_norm.weight", "k_norm.weight"),
            ("k_norm.bias", "k_norm.bias"),
            ("weights_proj.weight", "weights_proj.weight"),
        ):
            self.from_hf_map[f"model.layers.{{}}.self_attn.indexer.{hf}"] = (
                f"layers.{{}}.attention.indexer.{tt}"
            )
