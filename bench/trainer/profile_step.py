"""Where the trainer step's GPU time goes: torch.profiler over steps of chosen variants (issue 9).

    python3 bench/trainer/profile_step.py --out $OUT/profile.json \\
        --variants bf16,bf16+compile,baseline_hf          # ~1 min per variant on one H200

(Not `profile.py`: a file of that name next to step.py would shadow the standard library's
`profile`, which cProfile and so torch._dynamo import, for every script in this directory.)

The model, batch and step are bench/trainer/step.py's (`prepare_ours` / `prepare_hf`), so a
profile is of exactly what step.py times. Per variant: --warmup steps (compile, allocator), then
--steps profiled steps (CPU + CUDA activities) and as many unprofiled ones for the wall time.

Every CUDA kernel (plus memcpy/memset) is attributed to the CPU ops and record_function ranges
that launched it (the chrome trace's launch correlation and the launching thread's op stack;
backward ops run on the autograd thread and are named after their forward, e.g.
`ScaledDotProductCudnnAttentionBackward0`), and classified:

  attention_fwd / attention_bwd   SDPA (cuDNN / flash / efficient), varlen, flex kernels
  lm_head_logprob                 the chunked head (`relay::logprob_head_*` ranges in
                                  trainer/chunked.py: its GEMMs and softmax math), HF's log_softmax
  matmul                          every other GEMM (projections, MLP)
  optimizer                       AdamW and gradient clipping (foreach / fused kernels)
  communication                   NCCL and FSDP2's copy-in/out and casts (FSDP:: ranges)
  norms_elementwise               the remaining compute kernels (norms, RoPE, SiLU, casts, loss)
  other                           memcpy / memset and anything unmatched

Reported per step: GPU busy time (union of kernel intervals), the sum of kernel times, the wall
time, and the gap (wall - busy = host overhead / idle GPU); ms and share per category; the top 25
kernels by total time with their category; counts per step: kernels per category and copies
(`copies_per_step`: memcpy kernels on CUDA, `aten::copy_` ops on CPU, with their ms;
`fsdp_copies_per_step`: those launched inside FSDP2's hooks), which is where FSDP2's copy-in/out
on one rank shows (issue 9: `bf16+compile` vs `bf16+compile+nofsdp`). --device cpu profiles the tiny shape on CPU (the CPU
ops that do the work stand in for kernels): a smoke run of this script's logic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step  # noqa: E402  (installs the carried wheels on the GPU machine, puts the repo on sys.path)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

CATEGORIES = (
    "attention_fwd",
    "attention_bwd",
    "matmul",
    "lm_head_logprob",
    "norms_elementwise",
    "optimizer",
    "communication",
    "other",
)
_ATTN_BWD = (
    "attentionbackward",
    "attention_backward",
    "flash_bwd",
    "fmha_cutlassb",
    "bprop",
    "flexattentionbackward",
    "flex_attention_backward",
    "varlenattnbackward",
    "_varlen_attn_backward",
    "_flash_attention_backward",
    "_efficient_attention_backward",
    "_cudnn_attention_backward",
)
_ATTN_FWD = (
    "scaled_dot_product",
    "flash_fwd",
    "fmha_cutlassf",
    "fprop",
    "flex_attention",
    "varlen_attn",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "cudnn_attention",
    "flash_attention",
)
_GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "splitk", "triton_tem_fused_mm")
_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_scaled_mm")


@dataclass
class Kernel:
    name: str
    ts: float  # us
    dur: float  # us
    stack: list[str]  # enclosing CPU ops / record_function ranges, outermost first


def classify(name: str, stack: list[str]) -> str:
    """The category of one kernel from its name and its launching op stack (rules in order)."""
    n, st = name.lower(), " | ".join(stack).lower()
    both = n + " | " + st
    if "nccl" in n or "fsdp::" in st or "c10d::" in st or "record_param_comms" in st:
        return "communication"
    if "optimizer.step" in st or "_foreach_" in st or "multi_tensor_apply" in n or "adam" in n:
        return "optimizer"
    if "relay::logprob_head" in st or "_chunkedlogprobs" in st or "log_softmax" in st:
        return "lm_head_logprob"
    if any(x in both for x in _ATTN_BWD) or (
        ("attention" in both or "scaled_dot_product" in both) and "backward" in both
    ):
        return "attention_bwd"
    if any(x in both for x in _ATTN_FWD):
        return "attention_fwd"
    inner = [x.lower() for x in stack if x.lower().startswith("aten::")][-1:]
    if any(x in n for x in _GEMM) or (inner and inner[0] in _GEMM_OPS):
        return "matmul"
    if "memcpy" in n or "memset" in n:
        return "other"
    return "norms_elementwise"


def trace_events(prof: Any) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tdir:
        path = Path(tdir) / "trace.json"
        prof.export_chrome_trace(str(path))
        return list(json.loads(path.read_text()).get("traceEvents", []))


def _stacks_at(ranges: list[dict[str, Any]], points: list[tuple[float, int]]) -> dict[int, list[str]]:
    """For each (time, key) point, the names of the ranges of one thread enclosing it (ranges of
    one thread nest), by a sweep in time order."""
    ranges = sorted(ranges, key=lambda e: (e["ts"], -e.get("dur", 0)))
    out: dict[int, list[str]] = {}
    stack: list[tuple[float, str]] = []  # (end, name)
    i = 0
    for t, key in sorted(points):
        while i < len(ranges) and ranges[i]["ts"] <= t:
            r = ranges[i]
            while stack and stack[-1][0] < r["ts"]:
                stack.pop()
            stack.append((r["ts"] + r.get("dur", 0), r["name"]))
            i += 1
        while stack and stack[-1][0] < t:
            stack.pop()
        out[key] = [name for _, name in stack]
    return out


def kernels_from_trace(events: list[dict[str, Any]], cuda: bool) -> list[Kernel]:
    """CUDA kernels / memcpy / memset with their launching op stacks (cuda=True), or on CPU the
    leaf CPU ops (ops with no op inside them) as the units of work."""
    ranges: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ranges[(e.get("pid"), e.get("tid"))].append(e)
    if not cuda:
        # Every CPU op's self time (its duration less its direct children's) is a unit of work,
        # with the op itself innermost on its stack.
        out = []
        for rs in ranges.values():
            ops = sorted(rs, key=lambda e: (e["ts"], -e.get("dur", 0)))
            stack: list[list[Any]] = []  # [end, name, self_us, ts, ancestors, is_op]
            done: list[list[Any]] = []
            for r in ops:
                end = r["ts"] + r.get("dur", 0.0)
                while stack and stack[-1][0] <= r["ts"]:
                    done.append(stack.pop())
                if stack:
                    stack[-1][2] -= r.get("dur", 0.0)
                names = [x[1] for x in stack] + [r["name"]]
                stack.append([end, r["name"], r.get("dur", 0.0), r["ts"], names, r.get("cat") == "cpu_op"])
            done.extend(stack)
            # record_function ranges only label; their own time is not work
            out.extend(Kernel(x[1], x[3], max(0.0, x[2]), x[4]) for x in done if x[5])
        return out
    launches: dict[int, tuple[Any, Any, float]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e.get("pid"), e.get("tid"), e["ts"])
    by_thread: dict[tuple[Any, Any], list[tuple[float, int]]] = defaultdict(list)
    for corr, (pid, tid, ts) in launches.items():
        by_thread[(pid, tid)].append((ts, corr))
    stack_of: dict[int, list[str]] = {}
    for thread, points in by_thread.items():
        stack_of.update(_stacks_at(ranges.get(thread, []), points))
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            corr = e.get("args", {}).get("correlation")
            out.append(Kernel(e["name"], e["ts"], e.get("dur", 0.0), stack_of.get(corr, [])))
    return out


def busy_us(kernels: list[Kernel]) -> float:
    """Time the device had at least one kernel running (union of intervals; streams overlap)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.ts):
        a, b = k.ts, k.ts + k.dur
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def is_copy(name: str) -> bool:
    """A device copy (CUDA memcpy kernel) or, in a CPU profile, the op that does a copy's work."""
    n = name.lower()
    return "memcpy" in n or n == "aten::copy_"


def table(kernels: list[Kernel], steps: int, wall_s: list[float], top: int = 25) -> dict[str, Any]:
    cats: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    counts: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    copies, copy_us, fsdp_copies = 0, 0.0, 0
    per_kernel: dict[str, list[Any]] = {}
    for k in kernels:
        c = classify(k.name, k.stack)
        cats[c] += k.dur
        counts[c] += 1
        if is_copy(k.name):
            copies += 1
            copy_us += k.dur
            fsdp_copies += any("fsdp::" in x.lower() for x in k.stack)
        row = per_kernel.setdefault(k.name, [c, 0, 0.0])
        row[1] += 1
        row[2] += k.dur
    kernel_sum = sum(cats.values())
    wall_ms = 1e3 * sum(wall_s) / len(wall_s)
    busy_ms = busy_us(kernels) / 1e3 / steps
    tops = sorted(per_kernel.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "wall_step_ms": wall_ms,
        "gpu_busy_ms_per_step": busy_ms,
        "kernel_sum_ms_per_step": kernel_sum / 1e3 / steps,
        "gap_ms_per_step": wall_ms - busy_ms,
        "categories_ms_per_step": {c: v / 1e3 / steps for c, v in cats.items()},
        "kernels_per_step": {c: n / steps for c, n in counts.items()},
        "copies_per_step": copies / steps,
        "copies_ms_per_step": copy_us / 1e3 / steps,
        "fsdp_copies_per_step": fsdp_copies / steps,  # launched inside FSDP2's hooks
        "categories_share_of_kernel_sum": {
            c: (v / kernel_sum if kernel_sum else 0.0) for c, v in cats.items()
        },
        "top_kernels": [
            {
                "kernel": name[:240],
                "category": c,
                "calls_per_step": n / steps,
                "ms_per_step": us / 1e3 / steps,
                "avg_us": us / n,
            }
            for name, (c, n, us) in tops
        ],
    }


def profile_variant(
    ctx: step.Ctx, shape: str, variant: str, tokens: int, warmup: int, steps: int
) -> dict[str, Any]:
    if variant == "baseline_hf":
        prep = step.prepare_hf(ctx, shape, tokens)
    else:
        prep = step.prepare_ours(ctx, shape, variant, tokens)
    for _ in range(warmup):
        prep.one()
    step.sync()
    plain = step.timed(prep.one, steps)  # the wall time without the profiler's overhead
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    walls = []
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step.sync()
            t = time.perf_counter()
            prep.one()
            step.sync()
            walls.append(time.perf_counter() - t)
    kernels = kernels_from_trace(trace_events(prof), ctx.cuda)
    res = table(kernels, steps, walls)
    res["profiled_wall_s"] = walls
    res["unprofiled_wall_s"] = plain
    med = sorted(plain)[len(plain) // 2]
    res["mfu_unprofiled"] = prep.flops / med / step.PEAK
    res["tokens"] = prep.tokens
    res.update(prep.info, losses=prep.losses[:4])
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "profile.json"))
    p.add_argument("--shape", default="0.6b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument(
        "--variants", default="bf16,bf16+compile,baseline_hf", help="step.py VARIANTS or baseline_hf"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a logic smoke run")
    p.add_argument("--budget-s", type=float, default=400.0, help="skip variants once this is spent")
    args = p.parse_args()
    ctx = step.Ctx(args.device)
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": step.machine(),
        "method": (
            "torch.profiler over --steps steps after --warmup; kernels attributed to their launching "
            "op stack and classified (profile_step.classify); ms are per step"
        ),
        "results": {},
    }
    for v in [x for x in args.variants.split(",") if x]:
        key = f"{args.shape}/{v}"
        if time.monotonic() - ctx.t0 > args.budget_s:
            report["results"][key] = {"skipped": f"time budget {args.budget_s}s spent"}
            continue
        t = time.monotonic()
        try:
            report["results"][key] = profile_variant(ctx, args.shape, v, args.tokens, args.warmup, args.steps)
        except Exception as e:  # recorded, the rest goes on
            report["results"][key] = {"error": repr(e), "trace": traceback.format_exc()[-3000:]}
        report["results"][key]["wall_s"] = time.monotonic() - t
        step.free()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        r = report["results"][key]
        cats = {c: round(ms, 1) for c, ms in r.get("categories_ms_per_step", {}).items()}
        copies = f"copies {r.get('copies_per_step', 0):.0f}/step ({r.get('copies_ms_per_step', 0):.1f} ms)"
        print(
            f"[{time.monotonic() - ctx.t0:5.0f}s] {key}: wall {r.get('wall_step_ms', 0):.1f} ms {copies} {cats} {r.get('error', '')}",
            flush=True,
        )
    report["total_s"] = time.monotonic() - ctx.t0
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
