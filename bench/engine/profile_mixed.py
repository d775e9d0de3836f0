"""Where a mixed decode step's time goes (interference: steps that carry any prefill).

On the GPU a decode-only step is one CUDA-graph replay (~3 ms at 64 streams); a step that also
feeds prefill tokens replays a mixed-step graph (cuda_graphs.MixedGraphs; run eagerly such a step
took 25-46 ms in the interference bench whatever its token count), and `eager_mixed` (decode.engine.cuda_graph_mixed = false) is the
comparison in the same process. This script builds W1's
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
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.engine.w1 import build_model_dir, profile_setup  # noqa: E402
from bench.results import write_result


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
    from ops.fused_norm import silu_mul

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


def iter_same(a: list[int], b: list[int]):  # noqa: ANN201
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


def greedy_outputs(eng: Any) -> tuple[list[list[int]], list[float]]:
    """16 greedy requests, half added after the first have started decoding: every step mixes."""
    from services.common.schemas import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    states = []
    for i in range(16):
        n = 40 + 37 * i
        states.append(
            eng.add_request(
                GenerateRequest(input_ids=[(11 * i + j) % 400 + 3 for j in range(n)], sampling=sp)
            )
        )
        if i % 4 == 3:
            for _ in range(2):
                eng.step()
    while not all(s.finished for s in states):
        eng.step()
    outs = [s.response().choices[0] for s in states]
    return [c.output_ids for c in outs], [c.logprobs[0] for c in outs]


def measure(eng: Any, cuda: bool, streams: int, sizes: list[int], repeats: int) -> dict[str, Any]:
    from services.common.schemas import GenerateRequest, SamplingParams

    out: dict[str, Any] = {}
    long = SamplingParams(temperature=1.0, max_tokens=100_000, ignore_eos=True)
    plen = 128 if cuda else 8
    for i in range(streams):
        eng.add_request(
            GenerateRequest(input_ids=[(7 * i + j) % 400 + 2 for j in range(plen)], sampling=long)
        )
    for _ in range(8):  # every stream prefilled and decoding
        eng.step()
    dec = [timed_step(eng, cuda)[0] for _ in range(30)]
    out["decode_step_ms"] = {"median": statistics.median(dec), "max": max(dec)}
    mixed: dict[str, Any] = {}
    one = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    for n in sizes:
        runs = []
        for r in range(repeats):
            eng.add_request(
                GenerateRequest(input_ids=[(13 * r + j) % 400 + 2 for j in range(n)], sampling=one)
            )
            ms, phases, fed = timed_step(eng, cuda)
            runs.append({"ms": round(ms, 2), "fed_tokens": fed, "phases_ms": phases})
            for _ in range(3):
                eng.step()
        mixed[str(n)] = {"median_ms": statistics.median(x["ms"] for x in runs), "runs": runs}
    out["mixed_step"] = mixed
    if cuda:
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
        out["profiled_mixed_step"] = {
            "prefill_tokens": n,
            "wall_ms_under_profiler": round(wall, 2),
            "gpu_kernel_ms": round(gpu_us / 1e3, 2),
            "kernel_launches": launches,
            "host_ops": host_op_table(prof, top=12),
        }
    eng.abort_all()
    while eng.has_work():
        eng.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--sizes", default="17,128,2048")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cuda, device, dtype, model_kw, report = profile_setup(
        args.smoke,
        "the same steps with mixed steps eager (cuda_graph_mixed = false), and a decode-only step of the same streams; same process",
    )
    streams = args.streams if cuda else min(args.streams, 8)
    sizes = [int(s) for s in args.sizes.split(",")] if cuda else [5, 17]
    from services.common.config import EngineConfig
    from services.engine import LLMEngine

    root = Path(tempfile.mkdtemp(prefix="profmix-"))
    hf = build_model_dir(model_kw, device, dtype, root)
    del hf
    base = dict(
        device=device.type,
        dtype="bfloat16" if cuda else "float32",
        max_batch_size=max(128, streams + 8),
        max_seq_len=4096,
        num_kv_blocks=(streams + 16) * 4096 // 16,
        enable_prefix_caching=False,
    )
    report["config"] = {"streams": streams, "sizes": sizes, "engine": base}
    variants = {"mixed_graphs": True, "eager_mixed": False} if cuda else {"eager_mixed": False}
    tokens: dict[str, list[list[int]]] = {}
    for name, mixed_graphs in variants.items():
        eng = LLMEngine(root, EngineConfig(**base, cuda_graph_mixed=mixed_graphs))
        report[name] = measure(eng, cuda, streams, sizes, args.repeats)
        tokens[name], report[name]["logprobs_head"] = greedy_outputs(eng)
        del eng
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        report["launch_us"] = launch_cost_us(device)
    if len(tokens) == 2:
        a, b = tokens.values()
        same = sum(x == y for x, y in zip(a, b, strict=True))
        first = [sum(1 for _ in iter_same(x, y)) for x, y in zip(a, b, strict=True)]
        report["correctness"] = {
            "what": "greedy outputs of 16 staggered requests (mixed steps throughout): graphs vs eager",
            "identical_sequences": f"{same}/{len(a)}",
            "leading_tokens_agree_min": min(first),
            "logprob_max_abs_diff_first_token": max(
                abs(x - y)
                for x, y in zip(
                    report["mixed_graphs"]["logprobs_head"],
                    report["eager_mixed"]["logprobs_head"],
                    strict=True,
                )
            ),
        }
    write_result(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine", "config")}, indent=1)[:8000])


if __name__ == "__main__":
    main()
