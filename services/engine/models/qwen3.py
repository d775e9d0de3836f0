"""Qwen3 and Llama-3 dense decoders (HF Qwen3ForCausalLM, LlamaForCausalLM; arch qwen3, llama3):
GQA attention, with Qwen3's per-head q/k RMSNorm when ModelConfig.qk_norm, and a SwiGLU MLP in
every layer."""

from __future__ import annotations

from services.common.config import ModelConfig
from services.engine.layers.attention import Attention
from services.engine.layers.mlp import MLP
from services.engine.models.decoder import DecoderLayer


class Qwen3DecoderLayer(DecoderLayer):
    def __init__(self, m: ModelConfig, layer_idx: int, bias: bool):
        super().__init__(m, Attention(m, layer_idx, bias), MLP(m))
