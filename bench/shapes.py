"""Model shapes the benchmarks share (relay ModelConfig keyword arguments; the vocabulary apart)."""

from __future__ import annotations

from typing import Any

VOCAB = 151936  # Qwen3's
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-0.6B / Qwen3-4B (HF config.json of the released models)
    "0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, hidden_dim=3072),
    "4b": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=9728),
    "tiny": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=256),
    "tiny-moe": dict(
        arch="qwen3_moe",
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=256,
        n_routed_experts=8,
        n_experts_per_tok=2,
        moe_hidden_dim=64,
    ),
    # Qwen3-30B-A3B with 12 of its 48 layers (fits 2 GPUs with float32 master weights + Adam)
    "30b-a3b": dict(
        arch="qwen3_moe",
        dim=2048,
        n_layers=12,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=6144,
        n_routed_experts=128,
        n_experts_per_tok=8,
        moe_hidden_dim=768,
        tie_embeddings=False,
    ),
}
SHAPES["30b-a3b-4l"] = {**SHAPES["30b-a3b"], "n_layers": 4}  # one GPU: FP8 MoE vs bf16
