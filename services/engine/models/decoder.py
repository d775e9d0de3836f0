"""What every model family shares: the pre-norm decoder block (attention and MLP chosen by the
family) and the MoE-or-dense choice of its feed-forward."""

from __future__ import annotations

import torch
from torch import nn

from services.common.config import ModelConfig
from services.engine.batch import ForwardBatch
from services.engine.kv_cache import KVCache
from services.engine.layers.attention import Attention
from services.engine.layers.mla import MLAttention
from services.engine.layers.mlp import MLP
from services.engine.layers.moe import MoE
from services.engine.layers.norm import RMSNorm


def feed_forward(m: ModelConfig, layer_idx: int) -> MLP | MoE:
    """MoE for layers first_k_dense.. of an MoE model (their routing goes to the cache), the dense
    MLP for the others."""
    if m.is_moe and layer_idx >= m.first_k_dense:
        return MoE(m, layer_idx - m.first_k_dense)
    return MLP(m)


class DecoderLayer(nn.Module):
    """One pre-norm block (HF names: self_attn, mlp, input_layernorm, post_attention_layernorm);
    each family's layer (models/<family>.py) chooses its attention and its MLP."""

    def __init__(self, m: ModelConfig, self_attn: Attention | MLAttention, mlp: MLP | MoE):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(m.dim, m.norm_eps)
        self.post_attention_layernorm = RMSNorm(m.dim, m.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv)
        if not isinstance(self.mlp, MoE):
            return x + self.mlp(self.post_attention_layernorm(x))
        out, ids = self.mlp(self.post_attention_layernorm(x))
        kv.store_routing(self.mlp.moe_index, batch.slot_mapping, ids)
        return x + out

    def forward_fused(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As forward, with the residual adds fused into the following RMSNorms (Triton): takes the
        residual stream h and the previous layer's not yet added MLP output `delta`, and returns
        the stream after attention and this layer's MLP output (added by the next norm)."""
        from ops.fused_norm import add_rms_norm

        ln, post = self.input_layernorm, self.post_attention_layernorm
        if delta is None:
            y = ln(h)
        else:
            h, y = add_rms_norm(h, delta, ln.weight, ln.eps)
        h, y = add_rms_norm(h, self.self_attn(y, cos, sin, batch, kv), post.weight, post.eps)
        if isinstance(self.mlp, MoE):
            out, ids = self.mlp(y)
            kv.store_routing(self.mlp.moe_index, batch.slot_mapping, ids)
            return h, out
        return h, self.mlp.forward_fused(y)
