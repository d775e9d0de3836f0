"""Where a mixed decode step's time goes (issue 6 interference: steps that carry any prefill).

On the GPU a decode-only step is one CUDA-graph replay (~3 ms at 64 streams); a step that also
feeds prefill tokens runs the model eagerly and measured 25-46 ms in the interference bench
whatever its token count (17, 128 or 2,048 prefill tokens). This script builds W1's
Qwen3-0.6B-shaped random-weight model with the engine's CUDA defaults, keeps `--streams` requests
decoding, and for each prefill size adds one request and times the step that feeds it
(host-synchronised, so the figure is what the streams' inter-token latency sees). Then it profiles
one such step (CPU + CUDA): host time per op, kernel launches, the GPU's busy time, so the report
says whether the eager step is launch-bound (host) or compute-bound (device). It also times the
bare launch cost of a Triton kernel and of a torch op from Python (the floor of an eager step:
kernels per layer x layers x launch cost).

    python3 bench/engine/profile_mixed.py --out $OUT/profile_mixed.json        (H200)
    .venv/bin/python bench/engine/profile_mixed.py --out /tmp/m.json --smoke   (CPU: eager only)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.engine.w1 import QWEN3_0_6B, SMOKE_MODEL, build_model_dir, environment  # noqa: E402


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def timed_step(eng: Any, cuda: bool) -> tuple[float, dict[str, float], int]:
    """One engine step, synchronised: (ms, the engine's phase split, tokens it fed)."""
    fed0 = eng.stats.computed_tokens_total
    sync(cuda)
    t0 = time.perf_counter()
    eng.step()
    sync(cuda)
    ms = (time.perf_counter() - t0) * 1e3
    phases = {k: round(v * 1e3, 3) for k, v in eng.stats.last_step_phases.items()}  # seconds -> ms
    return ms, phases, eng.stats.computed_tokens_total - fed0


def launch_cost_us(device: torch.device, n: int = 2000) -> dict[str, float]:
    """Host microseconds per launch from Python, no graph: a Triton kernel (silu_mul), a torch
    pointwise op, a cuBLAS GEMM. The GPU work is tiny, so this is the launch path's cost."""
    from services.engine.kernels.fused_norm import silu_mul

    g = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    u = torch.randn_like(g)
    w = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    out: dict[str, float] = {}
    for name, fn in (
        ("triton_silu_mul", lambda: silu_mul(g, u)),
        ("torch_mul", lambda: g * u),
        ("torch_linear", lambda: torch.nn.functional.linear(g, w)),
    ):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t0) * 1e6 / n
        torch.cuda.synchronize()
    return out


def host_op_table(prof: Any, top: int = 30) -> list[dict[str, Any]]:
    """CPU self time per op name over the profiled steps, largest first."""
    agg: dict[str, list[float]] = defaultdict(list)
    for e in prof.key_averages():
        agg[e.key] = [e.self_cpu_time_total, e.count]
    rows = [{"op": k[:120], "self_cpu_ms": round(v[0] / 1e3, 3), "calls": v[1]} for k, v in agg.items()]
    return sorted(rows, key=lambda r: -r["self_cpu_ms"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--sizes", default="17,128,2048")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model_kw = QWEN3_0_6B if cuda else SMOKE_MODEL
    streams = args.streams if cuda else min(args.streams, 8)
    sizes = [int(s) for s in args.sizes.split(",")] if cuda else [5, 17]
    report: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), **environment(device)},
        "baseline": "a decode-only step of the same streams (CUDA graph), same process",
    }
    from services.common.config import EngineConfig
    from services.common.schemas import GenerateRequest, SamplingParams
    from services.engine import LLMEngine

    root = Path(tempfile.mkdtemp(prefix="profmix-"))
    hf = build_model_dir(model_kw, device, dtype, root)
    del hf
    cfg = EngineConfig(
        device=device.type,
        dtype="bfloat16" if cuda else "float32",
        max_batch_size=max(128, streams + 8),
        max_seq_len=4096,
        num_kv_blocks=(streams + 16) * 4096 // 16,
        enable_prefix_caching=False,
    )
    eng = LLMEngine(root, cfg)
    report["config"] = {"streams": streams, "sizes": sizes, "engine": cfg.model_dump()}
    long = SamplingParams(temperature=1.0, max_tokens=100_000, ignore_eos=True)
    plen = 128 if cuda else 8
    for i in range(streams):
        eng.add_request(
            GenerateRequest(input_ids=[(7 * i + j) % 1000 + 2 for j in range(plen)], sampling=long)
        )
    for _ in range(8):  # every stream prefilled and decoding
        eng.step()
    dec = [timed_step(eng, cuda)[0] for _ in range(30)]
    report["decode_step_ms"] = {"median": statistics.median(dec), "max": max(dec)}
    mixed: dict[str, Any] = {}
    one = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    for n in sizes:
        runs = []
        for r in range(args.repeats):
            eng.add_request(
                GenerateRequest(input_ids=[(13 * r + j) % 1000 + 2 for j in range(n)], sampling=one)
            )
            ms, phases, fed = timed_step(eng, cuda)
            runs.append({"ms": round(ms, 2), "fed_tokens": fed, "phases_ms": phases})
            for _ in range(3):
                eng.step()
        mixed[str(n)] = {"median_ms": statistics.median(x["ms"] for x in runs), "runs": runs}
    report["mixed_step"] = mixed
    if cuda:
        report["launch_us"] = launch_cost_us(device)
        from torch.profiler import ProfilerActivity, profile

        n = sizes[0]
        eng.add_request(GenerateRequest(input_ids=list(range(2, 2 + n)), sampling=one))
        sync(cuda)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.step()
            sync(cuda)
            wall = (time.perf_counter() - t0) * 1e3
        gpu_us = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        launches = sum(1 for e in prof.events() if "LaunchKernel" in e.name or e.name == "cuLaunchKernelEx")
        report["profiled_mixed_step"] = {
            "prefill_tokens": n,
            "wall_ms_under_profiler": round(wall, 2),
            "gpu_kernel_ms": round(gpu_us / 1e3, 2),
            "kernel_launches": launches,
            "host_ops": host_op_table(prof),
        }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine", "config")}, indent=1)[:8000])


if __name__ == "__main__":
    main()
