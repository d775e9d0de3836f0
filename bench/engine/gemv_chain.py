"""The batch-1 GEMV chain the persistent-kernel probes run (stream_probe.py, dataflow_probe.py):
Qwen3-0.6B's q/k/v, o_proj, gate/up and down per layer, no norms or attention, and its float32
torch reference with the kernels' bf16 roundings. No Triton here, so CPU tests can import it."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any

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


def layer_stages(w: dict[str, torch.Tensor], h: torch.Tensor) -> dict[str, torch.Tensor]:
    """One layer of the chain in float32 with the kernels' bf16 roundings (w: that layer's weights):
    every phase's output (q/k/v, the residual after o_proj, gate/up, the layer's residual `h`)."""
    f = {k: v.float() for k, v in w.items()}
    qkv = (f["qkv"] @ h.bfloat16().float()).bfloat16().float()
    hb = h + (f["o"] @ qkv[:NQ]).bfloat16().float()
    gu = (f["gu"] @ hb.bfloat16().float()).bfloat16().float()
    g, u = gu[:INTER], gu[INTER:]
    x = (g / (1 + torch.exp(-g)) * u).bfloat16().float()
    return {"qkv": qkv, "hb": hb, "gu": gu, "h": hb + (f["dn"] @ x).bfloat16().float()}


def reference(weights: dict[str, torch.Tensor], h0: torch.Tensor, layers: int) -> torch.Tensor:
    """The chain's final residual after `layers` stacked layers."""
    h = h0.clone()
    for layer in range(layers):
        w = {name: weights[name][layer * n : (layer + 1) * n] for name, (n, _) in WEIGHT_SHAPES.items()}
        h = layer_stages(w, h)["h"]
    return h


def time_variants(
    runners: dict[str, Callable[[], object]],
    results: dict[str, dict[str, Any]],
    time_us: Callable[[Callable[[], object], int], float],
    rounds: int,
    launches: int,
    layers: int,
    dram_read_us: float,
) -> None:
    """Time every runner `rounds` times, interleaved (so clock drift hits all alike), `launches`
    back-to-back calls each; their median, per-layer and over-DRAM-read figures go into `results`."""
    for name in runners:
        results[name]["us"] = []
    for _ in range(rounds):
        for name, fn in runners.items():
            results[name]["us"].append(round(time_us(fn, launches), 2))
    for name in runners:
        r = results[name]
        r["median_us"] = statistics.median(r["us"])
        r["us_per_layer"] = round(r["median_us"] / layers, 2)
        r["over_dram_read"] = round(r["median_us"] / dram_read_us, 3)


def setup(
    probe: str, baseline: str, layers: int, programs: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
    """A chain probe's start on the GPU: its random weights and input, and the report's header
    (command, date, machine, baseline, the weights' bytes and their DRAM read time). Exits 2
    without CUDA."""
    from bench.engine.w1 import measure_bandwidth, profile_setup

    cuda, device, _, _, report = profile_setup(False, baseline)
    if not cuda:
        print(f"{probe} needs a CUDA GPU (Hopper)", file=sys.stderr)
        sys.exit(2)
    weights, h0 = random_weights(layers, device)
    wbytes = sum(w.numel() * 2 for w in weights.values())
    report.update({"layers": layers, "programs": programs, "weight_bytes": wbytes,
                   "dram_read_us": wbytes / measure_bandwidth(device) * 1e6})  # fmt: skip
    return weights, h0, report
