"""Nemotron-H / Nemotron-3 (HF NemotronHForCausalLM; arch nemotron_h): NVIDIA's hybrid stack, HF's
module names (`backbone.embeddings`, `backbone.layers.<i>.{norm,mixer}`, `backbone.norm_f`,
`lm_head`), so a checkpoint the trainer publishes (trainer/nemotron.py NemotronHAdapter) loads
with nothing to rename.

Every layer is `x + mixer(RMSNorm(x))` with the mixer chosen by ModelConfig.hybrid_pattern:

  M  Mamba-2 (layers/mamba2.py) over the per-sequence state cache (state_cache.py)
  *  GQA attention over the paged KV cache, without positional encoding: the model's rope tables
     are the identity rotation (cos 1, sin 0), so layers/attention.py runs unchanged
  -  squared-ReLU MLP (layers/mlp.py Relu2MLP)
  E  MoE with sigmoid routing and squared-ReLU routed and shared experts (layers/moe.py), whose
     expert ids go to the cache's routing store (Router Replay)

The residual stream stays in the model dtype, as the trainer's NemotronHModel keeps it. On CUDA the
attention layers run the paged Triton kernels, the Mamba-2 decode step is the Triton kernel over the
state pool, and decode-only steps replay CUDA graphs (cuda_graphs.py: each row's state slot in a
static buffer, padding rows on the cache's padding slot); steps with prompt chunks run eagerly (a
chunk's scan is per span). No fused elementwise path or batch-1 megakernel for this family.
"""

from __future__ import annotations

import torch
from torch import nn

from ops.pdl import scope as pdl_scope
from services.common.config import ModelConfig
from services.engine.batch import ForwardBatch
from services.engine.kv_cache import KVCache
from services.engine.layers.attention import Attention
from services.engine.layers.mamba2 import Mamba2Mixer
from services.engine.layers.moe import MoE
from services.engine.layers.norm import RMSNorm
from services.engine.layers.relu2_mlp import Relu2MLP
from services.engine.models.causal_lm import CausalLM


class HybridLayer(nn.Module):
    """HF NemotronHBlock: `norm` and one `mixer`; `index` is the mixer's row in its own cache (the
    i-th attention layer's KV pool, the i-th Mamba-2 layer's states, the i-th MoE layer's routing)."""

    def __init__(self, m: ModelConfig, kind: str, index: int, bias: bool):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(m.dim, m.norm_eps)
        self.mixer: nn.Module
        if kind == "M":
            self.mixer = Mamba2Mixer(m, index)
        elif kind == "*":
            self.mixer = Attention(m, index, bias)
        elif kind == "-":
            self.mixer = Relu2MLP(m.dim, m.hidden_dim)
        else:
            self.mixer = MoE(m, index)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVCache
    ) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "M":
            assert batch.state is not None and kv.states is not None
            return x + self.mixer(h, batch.state, kv.states)
        if self.kind == "*":
            return x + self.mixer(h, cos, sin, batch, kv)
        if self.kind == "-":
            return x + self.mixer(h)
        out, ids = self.mixer(h)
        kv.store_routing(self.mixer.moe_index, batch.slot_mapping, ids)
        return x + out


class HybridStack(nn.Module):
    """HF's `backbone.`: embeddings, layers, norm_f."""

    def __init__(self, m: ModelConfig, bias: bool):
        super().__init__()
        self.embeddings = nn.Embedding(m.vocab_size, m.dim)
        seen: dict[str, int] = {}
        layers = []
        for kind in m.hybrid_pattern:
            layers.append(HybridLayer(m, kind, seen.get(kind, 0), bias))
            seen[kind] = seen.get(kind, 0) + 1
        self.layers = nn.ModuleList(layers)
        self.norm_f = RMSNorm(m.dim, m.norm_eps)


class NemotronHForCausalLM(CausalLM):
    def build_stack(self, m: ModelConfig, attention_bias: bool) -> None:
        self.backbone = HybridStack(m, attention_bias)

    def _rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        # No positional encoding: the identity rotation (x * 1 + rotate_half(x) * 0 is x exactly).
        shape = (self.max_seq_len, self.config.head_dim)
        return torch.ones(shape), torch.zeros(shape)

    def fuse_projections(self) -> list[str]:
        return []  # the torch path only (module docstring)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        with pdl_scope(self.pdl):
            if batch.state is not None and kv.states is not None and batch.state.fresh.numel():
                kv.states.reset(batch.state.fresh)  # first tokens of a sequence: zero states
            h = self.backbone.embeddings(batch.input_ids)
            cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
            for layer in self.backbone.layers:
                h = layer(h, cos, sin, batch, kv)
            return self.backbone.norm_f(h)
