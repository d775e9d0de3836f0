"""Qwen3-MoE (HF Qwen3MoeForCausalLM; arch qwen3_moe): Qwen3's GQA attention, and MoE feed-forwards
(softmax router, no shared experts) after the first_k_dense dense layers (HF mlp_only_layers)."""

from __future__ import annotations

from services.common.config import ModelConfig
from services.engine.layers.attention import Attention
from services.engine.models.decoder import DecoderLayer, feed_forward


class Qwen3MoeDecoderLayer(DecoderLayer):
    def __init__(self, m: ModelConfig, layer_idx: int, bias: bool):
        super().__init__(m, Attention(m, layer_idx, bias), feed_forward(m, layer_idx))
