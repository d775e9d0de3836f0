"""DeepSeek-V3 and Kimi-K2 (HF DeepseekV3ForCausalLM; arch deepseek_v3): Multi-head Latent Attention
(layers/mla.py; GQA when the config has no kv_lora_rank) and MoE feed-forwards with grouped
sigmoid routing and shared experts after the first_k_dense dense layers."""

from __future__ import annotations

from services.common.config import ModelConfig
from services.engine.layers.attention import Attention
from services.engine.layers.mla import MLAttention
from services.engine.models.decoder import DecoderLayer, feed_forward


class DeepseekV3DecoderLayer(DecoderLayer):
    def __init__(self, m: ModelConfig, layer_idx: int, bias: bool):
        super().__init__(
            m,
            MLAttention(m, layer_idx, bias) if m.is_mla else Attention(m, layer_idx, bias),
            feed_forward(m, layer_idx),
        )
