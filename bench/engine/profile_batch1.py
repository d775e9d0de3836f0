"""Where the batch-1 decode step's time goes (issue 3: a step within 2x of one weight read).

Builds W1's Qwen3-0.6B-shaped random-weight model, runs the engine with its CUDA defaults (Triton
paged attention, CUDA graphs, fused kernels, overlap scheduling), prefills one 512-token prompt,
decodes a few tokens, then profiles the captured batch-1 graph's replays with torch.profiler (CUPTI
records the kernels inside a graph) and, separately, the whole engine step. Reports per kernel
(name, calls per replay, mean us, share), per category (GEMM, attention, norm/rope/elementwise,
other), the kernel count per layer, and each decode GEMM's time next to the time to read its
weight at the measured copy bandwidth: which kernels are latency-bound, not bandwidth-bound.

    python3 bench/engine/profile_batch1.py --out $OUT/profile_batch1.json      (H200)
    .venv/bin/python bench/engine/profile_batch1.py --out /tmp/p.json --smoke  (CPU: eager, no graph)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.engine.w1 import build_model_dir, measure_bandwidth, profile_setup
from services.engine.kernels.gemv import graph_time_us, replay_us


def categorize(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "matmul", "splitk")):
        return "gemm"
    if any(s in n for s in ("attn", "attention", "paged", "decode_kernel", "reduce_partitions")):
        return "attention"
    if any(s in n for s in ("norm", "rope", "silu", "act_and_mul", "elementwise", "add", "mul", "copy")):
        return "norm_rope_elementwise"
    return "other"


def kernel_table(prof: Any, replays: int) -> list[dict[str, Any]]:
    agg: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            agg[e.name].append(e.device_time)  # us
    total = sum(sum(v) for v in agg.values()) or 1.0
    rows = [
        {
            "kernel": name[:160],
            "category": categorize(name),
            "calls_per_replay": round(len(ts) / replays, 2),
            "mean_us": round(sum(ts) / len(ts), 2),
            "us_per_replay": round(sum(ts) / replays, 1),
            "share": round(sum(ts) / total, 4),
        }
        for name, ts in agg.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_replay"])


def gemm_vs_bandwidth(model: Any, device: torch.device, bw: float) -> list[dict[str, Any]]:
    """Each distinct decode GEMM of one layer at M = 1, eager (cuBLAS, as the graph runs it): time vs its
    weight read at the copy bandwidth. Latency-bound GEMMs are what a 2x step cannot afford."""
    layer = model.model.layers[0]
    out = []
    seen = set()
    for name, mod in layer.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or tuple(w.shape) in seen:
            continue
        seen.add(tuple(w.shape))
        x = torch.randn(1, w.shape[1], device=device, dtype=w.dtype)
        for _ in range(10):
            torch.nn.functional.linear(x, w)
        us = graph_time_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        read_us = w.numel() * w.element_size() / bw * 1e6
        out.append(
            {
                "module": name,
                "shape": list(w.shape),
                "us_in_graph": round(us, 2),
                "weight_read_us": round(read_us, 2),
                "over_read": round(us / read_us, 2),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    cuda, device, dtype, model_kw, report = profile_setup(
        args.smoke,
        "the time to read the weights once at the measured device copy bandwidth (same process)",
    )
    from services.common.config import EngineConfig
    from services.common.schemas import GenerateRequest, SamplingParams
    from services.engine import LLMEngine

    root = Path(tempfile.mkdtemp(prefix="prof1-"))
    hf = build_model_dir(model_kw, device, dtype, root)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    del hf
    cfg = EngineConfig(
        device=device.type,
        dtype="bfloat16" if cuda else "float32",
        max_batch_size=8,
        max_seq_len=1536,
        num_kv_blocks=256,
        enable_prefix_caching=False,
    )
    eng = LLMEngine(root, cfg)
    prompt = list(range(2, 514)) if cuda else list(range(2, 40))
    state = eng.add_request(
        GenerateRequest(
            input_ids=prompt, sampling=SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
        )
    )
    step_ms = []
    while not state.finished:
        t0 = time.perf_counter()
        eng.step()
        if cuda:
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    report["engine_step_ms_median"] = sorted(step_ms[8:])[len(step_ms[8:]) // 2] if len(step_ms) > 8 else None
    if cuda and eng.graphs is not None:
        bw = measure_bandwidth(device)
        report["bandwidth_bytes_s"] = bw
        report["weight_read_ms"] = weight_bytes / bw * 1e3
        g = eng.graphs.graphs[1, eng.graphs.splits[1]]
        report["graph_replay_ms"] = replay_us(g, 50) / 1e3
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                g.replay()
            torch.cuda.synchronize()
        rows = kernel_table(prof, args.replays)
        report["kernels_per_replay"] = round(sum(r["calls_per_replay"] for r in rows), 1)
        report["kernels_per_layer"] = round(report["kernels_per_replay"] / len(eng.model.model.layers), 2)
        report["kernel_us_per_replay"] = round(sum(r["us_per_replay"] for r in rows), 1)
        cats: dict[str, float] = defaultdict(float)
        for r in rows:
            cats[r["category"]] += r["us_per_replay"]
        report["categories_us_per_replay"] = {k: round(v, 1) for k, v in cats.items()}
        report["kernels"] = rows[:40]
        report["gemm_vs_bandwidth"] = gemm_vs_bandwidth(eng.model, device, bw)
        from services.engine.kernels import gemv

        report["decode_gemm_choices"] = gemv.choices()  # kernels/gemv.py, chosen at graph warm-up
        # The whole step (graph + logits + sampler + host), for where the rest goes.
        state = eng.add_request(
            GenerateRequest(
                input_ids=prompt, sampling=SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
            )
        )
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.replays):
                eng.step()
            torch.cuda.synchronize()
        step_rows = kernel_table(prof, args.replays)
        report["step_kernels_outside_graph"] = [r for r in step_rows if r["calls_per_replay"] <= 3][:25]
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("kernels", "machine")}, indent=1)[:6000])


if __name__ == "__main__":
    main()
