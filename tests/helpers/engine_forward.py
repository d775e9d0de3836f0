"""The engine decoder's full-sequence logits on CPU, for tests that compare it with another
computation (FP8 against float32, a reloaded engine against a fresh one)."""

from __future__ import annotations

import torch

from services.common.config import ModelConfig
from services.engine.batch import ForwardBatch, Span
from services.engine.kv_cache import KVCache
from services.engine.models.causal_lm import CausalLM


def engine_logits(model: CausalLM, m: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits of the engine decoder (paged KV, flat batch) for each row of tokens
    (B, L <= 64)."""
    bs, max_len = 16, 64
    kv = KVCache(
        m.n_layers,
        tokens.shape[0] * max_len // bs,
        bs,
        max_len,
        m.n_kv_heads,
        m.head_dim,
        torch.float32,
        torch.device("cpu"),
        # MoE models record each layer's routing in the cache.
        moe_layers=m.n_layers - m.first_k_dense if m.is_moe else 0,
        top_k=m.n_experts_per_tok,
        n_experts=m.n_routed_experts,
    )
    n = max_len // bs
    spans = [Span(list(range(i * n, (i + 1) * n)), 0, tokens[i].tolist()) for i in range(tokens.shape[0])]
    with torch.inference_mode():
        batch = ForwardBatch.build(spans, torch.device("cpu"), max_len, bs)
        return model.logits(model(batch, kv)).view(*tokens.shape, -1)
