"""The engine model of an architecture: CausalLM (models/causal_lm.py, every family with a decoder
layer in DECODER_LAYERS) or the hybrid NemotronHForCausalLM (models/nemotron_h.py)."""

from __future__ import annotations

from services.common.config import ModelConfig
from services.engine.models.causal_lm import CausalLM
from services.engine.models.nemotron_h import NemotronHForCausalLM


def engine_model(m: ModelConfig, max_seq_len: int, attention_bias: bool = False) -> CausalLM:
    if m.is_hybrid:
        return NemotronHForCausalLM(m, max_seq_len, attention_bias)
    return CausalLM(m, max_seq_len, attention_bias)
