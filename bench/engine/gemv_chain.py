"""The batch-1 GEMV chain the persistent-kernel probes run (stream_probe.py, dataflow_probe.py):
Qwen3-0.6B's q/k/v, o_proj, gate/up and down per layer, no norms or attention, and its float32
torch reference with the kernels' bf16 roundings. No Triton here, so CPU tests can import it."""

from __future__ import annotations

import torch

D, NQKV, NQ, INTER = 1024, 4096, 2048, 3072
# Each weight's (rows, K) per layer; a probe stacks `layers` of them along the rows.
WEIGHT_SHAPES = {"qkv": (NQKV, D), "o": (D, NQ), "gu": (2 * INTER, D), "dn": (D, INTER)}


def random_weights(
    layers: int, device: torch.device, seed: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Stacked bf16 weights scaled by K^-1/2 and a float32 input row."""
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {
        name: (torch.randn(layers * n, k, generator=g, device=device) * k**-0.5).bfloat16()
        for name, (n, k) in WEIGHT_SHAPES.items()
    }
    return weights, torch.randn(D, generator=g, device=device)


def first_layers(weights: dict[str, torch.Tensor], layers: int, keep: int) -> dict[str, torch.Tensor]:
    """The first `keep` of `layers` stacked layers (views)."""
    return {k: v[: v.shape[0] * keep // layers] for k, v in weights.items()}


def reference(weights: dict[str, torch.Tensor], h0: torch.Tensor, layers: int) -> torch.Tensor:
    """The chain in float32 with the kernels' bf16 roundings."""
    h = h0.clone()
    f = {k: v.float() for k, v in weights.items()}
    for layer in range(layers):

        def w(name: str, n: int, layer: int = layer) -> torch.Tensor:
            return f[name][layer * n : (layer + 1) * n]

        qkv = (w("qkv", NQKV) @ h.bfloat16().float()).bfloat16().float()
        h = h + (w("o", D) @ qkv[:NQ]).bfloat16().float()
        gu = (w("gu", 2 * INTER) @ h.bfloat16().float()).bfloat16().float()
        g, u = gu[:INTER], gu[INTER:]
        x = (g / (1 + torch.exp(-g)) * u).bfloat16().float()
        h = h + (w("dn", D) @ x).bfloat16().float()
    return h
