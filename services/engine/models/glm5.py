"""GLM-5 (HF GlmMoeDsaForCausalLM; arch glm_moe_dsa): DeepSeek-V3's MLA and MoE plus DeepSeek Sparse
Attention, whose per-layer indexer (layers/mla.py Indexer, HF self_attn.indexer.*) MLAttention
builds from ModelConfig.index_topk: each query attends only to its index_topk best keys."""

from __future__ import annotations

from services.engine.models.deepseek_v3 import DeepseekV3DecoderLayer


class GlmMoeDsaDecoderLayer(DeepseekV3DecoderLayer):
    pass
