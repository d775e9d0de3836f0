"""Where the trainer step's GPU time goes: torch.profiler over steps of chosen variants.

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
on one rank shows (`bf16+compile` vs `bf16+compile+nofsdp`). --device cpu profiles the tiny shape on CPU (the CPU
ops that do the work stand in for kernels): a smoke run of this script's logic.

Where the GPU idles (`idle`, `idle_report`): each profiled step runs inside a `relay::profile_step`
range (the step and the sync after it). Within it, every interval with no kernel / copy running
longer than --idle-threshold-us (50) is listed with the host's state when the GPU went idle: the
innermost CPU event (aten:: op, record_function range, python function or CUDA runtime call such
as cudaStreamSynchronize / cudaMemcpyAsync) active at that moment on the thread that matters: one
blocked in a synchronising runtime call if any, else the thread that launched the kernel ending
the gap, else the deepest stack. Each gap also names that next kernel, the op that launched it,
and how long after the GPU went idle it was launched (> 0: the host was behind). Summed per
attributed op (`by_op`, ms per step) and per launching op (`by_next_launch`). On CPU (the smoke
run) the spans of CPU ops stand in for kernels, so its gaps are host Python between ops.
`allocator_per_step`: the CUDA caching allocator's device allocations, frees and retries per
profiled step (a retry frees cached blocks with cudaFree, which waits for the whole device).
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
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from bench.results import write_result  # noqa: E402

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


# ------------------------------------------------------------------ GPU idle attribution

STEP_RANGE = "relay::profile_step"  # the record_function range around each profiled step
# CPU-side events that can be "what the host was doing": ops, ranges, python frames, CUDA calls
_HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
_WORK_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# CUDA runtime/driver calls that block the host until queued GPU work is done
_SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaFree",  # the caching allocator frees blocks (an allocation retry): synchronises the device
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuEventSynchronize",
    "cuMemcpyDtoH_v2",
)
NO_OP = "(host outside any profiled op)"
_AFTER_US = 1e-3


@dataclass
class Work:
    """One GPU kernel / copy (or, on CPU, one CPU op's span) as an interval of device time."""

    ts: float  # us
    end: float  # us
    name: str
    corr: int | None = None  # the launch's correlation id (CUDA)


def work_intervals(events: list[dict[str, Any]], cuda: bool) -> list[Work]:
    """The device's work: kernels, memcpy and memset (cuda=True), or on CPU every CPU op's span
    (their union is the time the host spent inside ops; the gaps are Python between them)."""
    cats = _WORK_CATS if cuda else ("cpu_op",)
    return [
        Work(
            e["ts"],
            e["ts"] + e.get("dur", 0.0),
            e["name"],
            e.get("args", {}).get("correlation") if cuda else None,
        )
        for e in events
        if e.get("ph") == "X" and e.get("cat") in cats
    ]


def idle_intervals(work: list[Work], start: float, end: float) -> list[tuple[float, float, Work | None]]:
    """The gaps in [start, end] with no work running (the union of `work` clipped to the window),
    each with the work item that ends it (None for a gap running to `end`)."""
    inside = sorted((w for w in work if w.end > start and w.ts < end), key=lambda w: w.ts)
    gaps: list[tuple[float, float, Work | None]] = []
    t = start
    for w in inside:
        if w.ts > t:
            gaps.append((t, w.ts, w))
        t = max(t, w.end)
    if t < end:
        gaps.append((t, end, None))
    return gaps


def step_windows(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The profiled steps' [start, end] (us) from their STEP_RANGE ranges, in time order; the
    whole trace's CPU/GPU span if there are none (a profile made without them)."""
    wins = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0.0))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == STEP_RANGE
    )
    if wins:
        return wins
    spans = [(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events if e.get("ph") == "X" and "ts" in e]
    return [(min(a for a, _ in spans), max(b for _, b in spans))] if spans else []


def _host_stacks(events: list[dict[str, Any]]) -> dict[tuple[Any, Any], list[dict[str, Any]]]:
    out: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _HOST_CATS:
            out[(e.get("pid"), e.get("tid"))].append(e)
    return out


def _is_sync(name: str) -> bool:
    return any(name == c or name.startswith(c + "_") for c in _SYNC_CALLS)


def _is_runtime_call(name: str) -> bool:
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


def _label(stack: list[str]) -> str:
    """The attributed op: the innermost event, with the innermost op around a runtime call
    (e.g. `aten::_local_scalar_dense / cudaStreamSynchronize`)."""
    inner = [x for x in stack if x != STEP_RANGE]
    if not inner:
        return NO_OP
    if _is_runtime_call(inner[-1]) and len(inner) > 1:
        return f"{inner[-2]} / {inner[-1]}"
    return inner[-1]


def idle_report(
    events: list[dict[str, Any]], cuda: bool, threshold_us: float = 50.0, max_listed: int = 400
) -> dict[str, Any]:
    """Per profiled step (step_windows), the device's idle intervals longer than `threshold_us`,
    each attributed to the host's state when the device went idle (module docstring); the
    shorter ones only counted. Sums per attributed op and per launching op, ms per step."""
    work = work_intervals(events, cuda)
    wins = step_windows(events)
    host = _host_stacks(events)
    launches: dict[int, tuple[Any, Any, float]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e.get("pid"), e.get("tid"), e["ts"])
    gaps: list[dict[str, Any]] = []
    per_step: list[dict[str, Any]] = []
    for i, (s, e) in enumerate(wins):
        idle = idle_intervals(work, s, e)
        big = [(a, b, w) for a, b, w in idle if b - a > threshold_us]
        small = [b - a for a, b, w in idle if b - a <= threshold_us]
        per_step.append(
            {
                "step": i,
                "window_ms": (e - s) / 1e3,
                "idle_ms": sum(b - a for a, b, _ in idle) / 1e3,
                "idle_listed_ms": sum(b - a for a, b, _ in big) / 1e3,
                "small_gaps": {"count": len(small), "ms": sum(small) / 1e3},
                "gaps": [],
            }
        )
        for a, b, w in big:
            launch = launches.get(w.corr) if w is not None and w.corr is not None else None
            gaps.append({"step": i, "a": a, "b": b, "next": w, "launch": launch, "t0": s})
    # The host stacks at every gap's start (all threads) and at every next kernel's launch.
    points: dict[tuple[Any, Any], list[tuple[float, int]]] = defaultdict(list)
    for k, g in enumerate(gaps):
        for thread in host:
            # Just after the device went idle: a host event ending at that very moment is over.
            points[thread].append((g["a"] + _AFTER_US, 2 * k))
        if g["launch"] is not None:
            pid, tid, ts = g["launch"]
            points[(pid, tid)].append((ts, 2 * k + 1))
    stacks: dict[tuple[Any, Any], dict[int, list[str]]] = {
        thread: _stacks_at(host.get(thread, []), pts) for thread, pts in points.items()
    }
    by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_launch: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for k, g in enumerate(gaps):
        at_idle = {thread: st[2 * k] for thread, st in stacks.items() if 2 * k in st}
        launch_thread = (g["launch"][0], g["launch"][1]) if g["launch"] is not None else None
        syncing = [t for t, st in at_idle.items() if st and _is_sync(st[-1])]
        if syncing:
            thread = syncing[0]
        elif launch_thread is not None and at_idle.get(launch_thread):
            thread = launch_thread
        else:
            thread = max(at_idle, key=lambda t: len(at_idle[t]), default=None)
        stack = at_idle.get(thread, []) if thread is not None else []
        dur = g["b"] - g["a"]
        label = _label(stack)
        by_op[label][0] += 1
        by_op[label][1] += dur
        row: dict[str, Any] = {
            "start_ms": (g["a"] - g["t0"]) / 1e3,
            "dur_us": dur,
            "cpu_op": label,
            "stack": [x for x in stack if x != STEP_RANGE][-6:],
            "thread": None if thread is None else str(thread[1]),
        }
        nxt: Work | None = g["next"]
        if nxt is not None:
            row["next_kernel"] = nxt.name[:160]
        if g["launch"] is not None:
            launched_by = _label(stacks.get(launch_thread, {}).get(2 * k + 1, []))  # type: ignore[arg-type]
            row["launched_by"] = launched_by
            row["launch_after_idle_us"] = g["launch"][2] - g["a"]
            by_launch[launched_by][0] += 1
            by_launch[launched_by][1] += dur
        lst = per_step[g["step"]]["gaps"]
        if len(lst) < max_listed:
            lst.append(row)
        else:
            per_step[g["step"]]["gaps_not_listed"] = per_step[g["step"]].get("gaps_not_listed", 0) + 1
    n = max(1, len(wins))

    def summed(d: dict[str, list[float]]) -> dict[str, dict[str, float]]:
        rows = sorted(d.items(), key=lambda kv: -kv[1][1])
        return {k: {"ms_per_step": us / 1e3 / n, "gaps_per_step": c / n} for k, (c, us) in rows}

    return {
        "threshold_us": threshold_us,
        "steps": len(wins),
        "idle_ms_per_step": sum(p["idle_ms"] for p in per_step) / n,
        "idle_listed_ms_per_step": sum(p["idle_listed_ms"] for p in per_step) / n,
        "by_op": summed(by_op),
        "by_next_launch": summed(by_launch),
        "per_step": per_step,
    }


def allocator_counts(cuda: bool) -> dict[str, int]:
    """The caching allocator's cumulative counters that mean device-level (possibly syncing) work."""
    if not cuda:
        return {}
    st = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    return {k: int(st.get(k, 0)) for k in keys}


def profile_variant(
    ctx: step.Ctx,
    shape: str,
    variant: str,
    tokens: int,
    warmup: int,
    steps: int,
    idle_threshold_us: float = 50.0,
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
    mem0 = allocator_counts(ctx.cuda)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step.sync()
            t = time.perf_counter()
            with record_function(STEP_RANGE):  # the window idle_report measures
                prep.one()
                step.sync()
            walls.append(time.perf_counter() - t)
    events = trace_events(prof)
    kernels = kernels_from_trace(events, ctx.cuda)
    res = table(kernels, steps, walls)
    res["idle"] = idle_report(events, ctx.cuda, idle_threshold_us)
    # Device allocations / frees / retries in the profiled steps: a retry frees cached blocks
    # with cudaFree, which waits for the whole device (an idle gap labelled cudaFree).
    mem1 = allocator_counts(ctx.cuda)
    res["allocator_per_step"] = {k: (mem1[k] - mem0[k]) / steps for k in mem1}
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
    p.add_argument(
        "--idle-threshold-us",
        type=float,
        default=50.0,
        help="list (and attribute) idle gaps longer than this",
    )
    args = p.parse_args()
    ctx = step.Ctx(args.device)
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": step.machine(),
        "method": (
            "torch.profiler over --steps steps after --warmup; kernels attributed to their launching "
            "op stack and classified (profile_step.classify); ms are per step; `idle`: the GPU's idle "
            "gaps per step over --idle-threshold-us, attributed to the host's op when the GPU went idle "
            "(profile_step.idle_report)"
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
            report["results"][key] = profile_variant(
                ctx, args.shape, v, args.tokens, args.warmup, args.steps, args.idle_threshold_us
            )
        except Exception as e:  # recorded, the rest goes on
            report["results"][key] = {"error": repr(e), "trace": traceback.format_exc()[-3000:]}
        report["results"][key]["wall_s"] = time.monotonic() - t
        step.free()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, report)
        r = report["results"][key]
        cats = {c: round(ms, 1) for c, ms in r.get("categories_ms_per_step", {}).items()}
        copies = f"copies {r.get('copies_per_step', 0):.0f}/step ({r.get('copies_ms_per_step', 0):.1f} ms)"
        print(
            f"[{time.monotonic() - ctx.t0:5.0f}s] {key}: wall {r.get('wall_step_ms', 0):.1f} ms {copies} {cats} {r.get('error', '')}",
            flush=True,
        )
        if "idle" in r:
            top = list(r["idle"]["by_op"].items())[:8]
            print(
                f"    idle {r['idle']['idle_ms_per_step']:.2f} ms/step, allocator {r.get('allocator_per_step')}; top: "
                + "; ".join(f"{k} {v['ms_per_step']:.2f} ms" for k, v in top),
                flush=True,
            )
    report["total_s"] = time.monotonic() - ctx.t0
    write_result(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
