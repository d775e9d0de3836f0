"""The engine model of an architecture: CausalLM (models/causal_lm.py, every family with a decoder
layer in DECODER_LAYERS) or the hybrid NemotronHForCausalLM (models/nemotron_h.py); and either one
built in the FP8 layout from the start (build_fp8_model)."""

from __future__ import annotations

import torch

from services.common.config import ModelConfig
from services.engine.models.causal_lm import CausalLM
from services.engine.models.nemotron_h import NemotronHForCausalLM


def engine_model(m: ModelConfig, max_seq_len: int, attention_bias: bool = False) -> CausalLM:
    if m.is_hybrid:
        return NemotronHForCausalLM(m, max_seq_len, attention_bias)
    return CausalLM(m, max_seq_len, attention_bias)


def build_fp8_model(
    m: ModelConfig, max_seq_len: int, attention_bias: bool, device: torch.device, dtype: torch.dtype
) -> CausalLM:
    """An engine model whose attention/MLP linears and experts are FP8 from the start: built on the
    meta device, converted to the FP8 layout there, then materialised on `device` (the rope tables
    recomputed). Its high-precision linear and expert weights never exist, so a model whose bf16
    weights do not fit the device (GLM-5, Kimi-K2: ~2x their FP8 bytes) can be served. The
    weights are not loaded: fp8_linear.load_hf_state fills it (quantising high-precision tensors,
    copying an FP8 checkpoint's pairs). Same layout, dtypes and names as
    engine_model(...).to(device, dtype) + fp8_linear.convert_model."""
    from ops.fp8.dispatch import prepare_cuda_kernel
    from services.engine.layers import fp8 as fp8_linear

    with torch.device("meta"):
        model = engine_model(m, max_seq_len, attention_bias).to(dtype)
    fp8_linear.convert_model(model, empty=True)
    model.to_empty(device=device)
    model.reset_rope()
    prepare_cuda_kernel(device)
    return model
