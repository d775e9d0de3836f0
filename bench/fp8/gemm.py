"""FP8 block-scaled GEMM benchmark on one Hopper GPU: relay's tuned dispatch ("auto") vs
bf16 cuBLAS vs torch's block-wise `scaled_mm`, all in the same run (~3 minutes on an H200).
"auto" follows ops/fp8/fp8_configs.json (bench/fp8/tune.py writes it; run tune.py
first, then this with --sweep-budget-s 0); each row records the entry it used (`auto_choice`,
`auto_linear`: fused quantise+GEMM or not, `table_entry`: which run measured it).

    PYTHONPATH=. python3 bench/fp8/gemm.py --out $OUT/fp8_gemm.json
    bash bench/fp8/run.sh gemm      (on the device machine: installs the carried .whl first)

1. Self-check on the GPU against the exact reference (ops/fp8/recipe.py), fp32 and bf16
   outputs: Triton dense GEMM (mma.sync and wgmma configs, split-K, the config "auto" picks,
   ragged shapes), torch's block-wise scaled_mm (incl. ragged K/N/M), "auto" itself, the grouped
   GEMM (Triton and the torch loop), and the Triton 1x128 quantiser (bits must equal the torch
   reference, which must equal the CPU reference). Bounds: see FROB_BOUND / ELEM_BOUND. A failed
   check is recorded (`self_check.ok`, `self_check.failed`) and the timing still runs.
2. Dense: M in {64, ..., 8192} x (N, K) in {(7168, 2048), (4096, 7168), (2048, 7168),
   (18432, 7168)}. First pass, every shape: bf16 (torch.matmul), torch block-wise, auto (what
   the engine runs: ops/fp8/dispatch.py's measured table), the activation quantiser
   alone, the whole linear from a bf16 input (fp8: quantiser + auto) vs bf16 F.linear, and for
   M <= 256 the same two linears as CUDA-graph replays (the engine's decode step is captured, so
   that is its real cost). Then Triton config sweeps (decode M first) while SWEEP_BUDGET_S lasts,
   and `tuned_table_suggestion`: TUNED_CONFIGS lines from this run's fastest option per shape.
3. Grouped MoE: E experts, T routed rows spread unevenly (seeded), (N, K) = (4096, 7168) (fused
   gate/up, DeepSeek-V3 expert width 2048) and (7168, 2048) (down); decode-sized (T = 256) and
   prefill-sized (T = 16384). Variants: bf16 torch._grouped_mm, bf16 per-expert loop, torch
   block-wise scaled_mm per-expert loop, triton grouped (heuristic, and a BLOCK_M/N sweep).
The trainer's linear (forward + backward) is bench/fp8/train_linear.py's.

Timing: triton.testing.do_bench (median), which clears a 256 MB buffer before every call, so each
call reads its weight from HBM as in a real model (a decode step streams every layer's weights
once; L2-resident timings would flatter small M). Every variant is in try/except: a failure is
recorded as its error string. JSON: command, date, machine (nvidia-smi), the table in force,
every row, `summary` (the goals for auto) and the table suggestion.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

# `python3 bench/fp8/<script>.py` from the repo root works without PYTHONPATH=. (sys.path[0] is
# this directory); run.sh still sets it, plus the carried wheels.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from bench.kernels import triton_gemm_variants as variants
from bench.results import write_result
from ops.fp8 import dispatch as fl
from ops.fp8 import recipe as ref
from ops.fp8 import triton_gemm as kern

TABLE = kern.load_table()  # the dispatch table in force (ops/fp8/fp8_configs.json)
DENSE_NK = [(7168, 2048), (4096, 7168), (2048, 7168), (18432, 7168)]
DENSE_M = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
# Config sweeps after the tuned-dispatch pass, most useful first (decode sizes feed
# TUNED_CONFIGS; 4096/8192 try the large tiles), while the sweep budget lasts.
SWEEP_ORDER = [64, 128, 256, 4096, 512, 1024, 8192]
GRAPH_MAX_M = 256  # decode-sized M: also time the linear as a CUDA-graph replay
GROUPED = [  # (name, E, T, N, K)
    ("decode gate_up", 32, 256, 4096, 7168),
    ("decode down", 32, 256, 7168, 2048),
    ("prefill gate_up", 32, 16384, 4096, 7168),
    ("prefill down", 32, 16384, 7168, 2048),
]
SWEEP_BUDGET_S = 140.0  # no dense sweep starts after this (--sweep-budget-s; whole run ~3 minutes)
TIME_BUDGET_S = 150.0  # no grouped sweep starts after this


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    info["torch"] = torch.__version__
    info["triton"] = getattr(kern.triton, "__version__", None) if kern.HAS_TRITON else None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    try:
        info["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                "--format=csv",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except Exception as e:  # noqa: BLE001 - informational only
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


def host_top(step: Callable[[], Any], steps: int = 10, top: int = 25) -> list[tuple[str, int, float]]:
    """The `top` host functions by own time over `steps` calls of `step` (cProfile): (file:line
    (function), calls per step, ms per step). Profiled times are inflated; compare them with each
    other, and take host time per call from host_and_wall_ms."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = [
        (f"{Path(f).name}:{line}({fn})", cc // steps, tt / steps * 1e3)
        for (f, line, fn), (cc, _nc, tt, _ct, _callers) in stats.items()
    ]
    return sorted(rows, key=lambda r: -r[2])[:top]


def host_and_wall_ms(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Per call: the host time to enqueue `calls` calls, and the time until they have run."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e3, (t2 - t0) / calls * 1e3


def bench_ms(
    fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None, short: bool = False
) -> float:
    from triton.testing import do_bench

    warmup, rep = (5, 15) if short else (10, 40)  # sweeps: shorter, many configs per shape
    return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))


def new_result(baseline: str) -> dict[str, Any]:
    """A results file's header: the command, the date, the machine and the baseline, then rows."""
    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": machine(),
        "baseline": baseline,
        "rows": [],
    }


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - every variant is isolated; the error is the result
        return None, f"{type(e).__name__}: {str(e)[:300]}"


def quantised(m: int, n: int, k: int, dev: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(m, k, device=dev, generator=g, dtype=torch.float32).to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    aq, as_ = ref.quantize_act(x)
    wq, ws = ref.quantize_weight(w)
    return {"x": x, "w": w, "aq": aq, "as": as_, "wq": wq, "ws": ws}


# ------------------------------------------------------------------ self-check


def rel(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)).item()


# Accumulation error allowed per 128-wide K block, relative to sum_k |a_k w_k| (absref below).
# Hopper's fp8 wgmma (Triton BLOCK_M >= 64, cuBLAS) keeps only ~14 bits while it accumulates
# (DeepSeek-V3 report, 3.3.2: why the recipe promotes to fp32 every 128 K); H200 run 1 measured
# 1.27e-4 (~2^-13) Frobenius error vs the exact fp32 reference for *every* wgmma config and shape,
# split-K or not, ragged or not, and 1e-7 for BLOCK_M = 16 (mma.sync, fp32 accumulation) on the
# same inputs, so it is the instruction, not a tile or boundary bug. Those bounds keep 4-16x
# margin; a real defect (a dropped or doubled K block, a wrong scale, a mis-masked edge tile)
# errs by ~1/sqrt(KB) = 0.1-0.3 in Frobenius and ~2^-7 of absref per element, far above them.
FROB_BOUND = {"wgmma": 2.0**-11, "mma": 1e-5}
ELEM_BOUND = {"wgmma": 2.0**-10, "mma": 2.0**-16}
BF16_HALF_ULP = 2.0**-8  # |y - bf16(y)| <= 2^-8 |y| (8 significant bits, round to nearest)


def mma_kind(block_m: int) -> str:
    """Triton 3.x on sm90 lowers tl.dot to wgmma when a warpgroup gets >= 64 rows."""
    return "wgmma" if block_m >= 64 else "mma"


def fp8_abs(q: torch.Tensor) -> torch.Tensor:
    """|q| for E4M3 bits (clear the sign bit; the quantiser never makes NaN)."""
    return (q.view(torch.uint8) & 0x7F).view(ref.FP8_DTYPE)


def accuracy(
    out32: torch.Tensor | None,
    out16: torch.Tensor | None,
    want: torch.Tensor,
    absref: torch.Tensor,
    kind: str,
) -> dict[str, Any]:
    """fp32 output: Frobenius error vs the exact reference under FROB_BOUND[kind]. bf16 output (what
    the engine uses): per element |out - want| <= 2^-8 |want| (bf16 rounding of the exact result)
    + 2 * ELEM_BOUND[kind] * absref (the accumulation error may also move it to the next bf16),
    and Frobenius <= 2^-8 + FROB_BOUND[kind] (rounding errs by at most 2^-8 |y| per element).
    Note: the Triton *interpreter* converts fp32 -> bf16 by truncation (checked: its bf16 output
    is the truncated fp32 output), so this bf16 check is for the GPU only."""
    res: dict[str, Any] = {"kind": kind}
    ok = True
    if out32 is not None:
        res["rel_err_fp32"] = rel(out32, want)
        res["frob_bound"] = FROB_BOUND[kind]
        ok = ok and res["rel_err_fp32"] < FROB_BOUND[kind]
    if out16 is not None:
        err = (out16.float() - want).abs()
        bound = BF16_HALF_ULP * want.abs() + 2 * ELEM_BOUND[kind] * absref + 1e-30
        res["rel_err_bf16"] = rel(out16, want)
        res["bf16_worst_err_over_bound"] = (err / bound).max().item()
        res["bf16_elements_over_bound"] = int((err > bound).sum())
        ok = ok and res["bf16_elements_over_bound"] == 0
        ok = ok and res["rel_err_bf16"] < BF16_HALF_ULP + FROB_BOUND[kind]
    res["ok"] = ok
    return res


def check_dense_shape(m: int, n: int, k: int, dev: torch.device) -> list[dict[str, Any]]:
    d = quantised(m, n, k, dev, seed=m)
    ops = (d["aq"], d["as"], d["wq"], d["ws"])
    want = ref.fp8_gemm_reference(*ops)
    absref = ref.fp8_gemm_reference(fp8_abs(d["aq"]), d["as"], fp8_abs(d["wq"]), d["ws"])
    rows = []
    cfgs = [kern.GemmConfig(16, 64, 4, 1, 4, 3), kern.GemmConfig(64, 128, 3, 1, 4, 4)]
    cfgs += [kern.GemmConfig(128, 128, 1, 8, 8, 3), kern.pick_config(m, n, k, kern.num_sms(dev))]
    # The in-kernel split-K reduction (mma.sync and wgmma) and the persistent TMA kernel.
    cfgs += [
        kern.GemmConfig(16, 128, 4, 1, 4, 4, fused_reduce=True),
        kern.GemmConfig(64, 256, 3, 1, 8, 4, fused_reduce=True),
    ]
    cfgs += [
        variants.VariantConfig(128, 256, 1, 8, 8, 3, kernel="tma"),
        variants.VariantConfig(128, 128, 1, 8, 8, 4, kernel="tma", warp_spec=True),
    ]
    choice = fl.auto_choice(m, n, k, dev)
    if isinstance(choice, kern.GemmConfig):
        cfgs.append(choice)
    for cfg in dict.fromkeys(c for c in cfgs if variants.supports(c, m, n, k)):
        o32, e32 = attempt(partial(variants.variant_fp8_gemm, *ops, torch.float32, cfg))
        o16, e16 = attempt(partial(variants.variant_fp8_gemm, *ops, torch.bfloat16, cfg))
        acc = accuracy(o32, o16, want, absref, mma_kind(cfg.block_m))
        rows.append({"shape": [m, n, k], "variant": f"triton {cfg.name()}"} | acc | {"error": e32 or e16})
    o32, e32 = attempt(partial(ref.fp8_gemm, *ops, torch.float32, "torch"))
    o16, e16 = attempt(partial(ref.fp8_gemm, *ops, torch.bfloat16, "torch"))
    # cuBLAS may refuse fp32 output for block-wise scaling: then the bf16 check alone decides.
    row = {"shape": [m, n, k], "variant": "torch scaled_mm blockwise", "fp32_output_error": e32}
    row |= accuracy(o32, o16, want, absref, "wgmma") | {"error": e16}
    # And the bf16 end result against the exact product: the E4M3 error itself (~3.7e-2).
    row["rel_err_vs_bf16_matmul"] = None if o16 is None else rel(o16, d["x"].float() @ d["w"].float().T)
    rows.append(row)
    fused_cfgs = [choice] if isinstance(choice, kern.GemmConfig) else []
    fused_cfgs.append(kern.GemmConfig(32, 128, 4, 1, 4, 4, fused_reduce=True))
    x = d["x"]
    for fcfg in fused_cfgs:
        # The fused quantise+GEMM kernel must give the quantiser + GEMM kernels' bits.
        fused, ef = attempt(partial(kern.triton_fp8_linear_fused, x, d["wq"], d["ws"], torch.bfloat16, fcfg))
        two, et = attempt(
            lambda fcfg=fcfg: kern.triton_fp8_gemm(
                *kern.triton_quantize_act(x), d["wq"], d["ws"], torch.bfloat16, fcfg
            )
        )
        equal = fused is not None and two is not None and bool(torch.equal(fused, two))
        ef = ef or et
        rows.append(
            {"shape": [m, n, k], "variant": f"fused linear {fcfg.name()}", "bitwise_equal": equal}
            | {"ok": equal, "error": ef}
        )
    o16, e16 = attempt(partial(fl.fp8_gemm_dispatch, *ops, torch.bfloat16))
    kind = mma_kind(choice.block_m) if isinstance(choice, kern.GemmConfig) else "wgmma"
    rows.append(
        {"shape": [m, n, k], "variant": f"auto ({choice_name(choice)})"}
        | accuracy(None, o16, want, absref, kind)
        | {"error": e16}
    )
    for r in rows:
        r["ok"] = bool(r["ok"]) and r["error"] is None
    return rows


def choice_name(choice: kern.GemmConfig | str) -> str:
    return choice.name() if isinstance(choice, kern.GemmConfig) else str(choice)


def check_grouped(name: str, e: int, t: int, n: int, k: int, dev: torch.device) -> list[dict[str, Any]]:
    gi = grouped_inputs(e, t, n, k, dev, seed=1)
    ops = (gi["a"][0], gi["a"][1], gi["wq"], gi["ws"], gi["offs"])
    want = ref.grouped_fp8_gemm(*ops, torch.float32, backend="reference")
    abs_ops = (fp8_abs(gi["a"][0]), gi["a"][1], fp8_abs(gi["wq"]), gi["ws"], gi["offs"])
    absref = ref.grouped_fp8_gemm(*abs_ops, torch.float32, backend="reference")
    rows = []
    for bm in (None, 16, 64):
        o32, e32 = attempt(partial(kern.triton_grouped_fp8_gemm, *ops, torch.float32, block_m=bm))
        o16, e16 = attempt(partial(kern.triton_grouped_fp8_gemm, *ops, torch.bfloat16, block_m=bm))
        kind = mma_kind(bm or kern.pick_grouped_block_m(t, e))
        acc = accuracy(o32, o16, want, absref, kind)
        rows.append({"case": name, "block_m": bm} | acc | {"error": e32 or e16})
    o16, e16 = attempt(partial(ref.grouped_fp8_gemm, *ops, torch.bfloat16, "torch"))
    rows.append(
        {"case": name, "block_m": "torch loop"} | accuracy(None, o16, want, absref, "wgmma") | {"error": e16}
    )
    # What the engine runs: ops/fp8/dispatch.py (the CUDA kernel from
    # GROUPED_CUDA_MIN_ROWS rows per expert on Hopper, Triton below).
    o16, e16 = attempt(partial(fl.grouped_fp8_gemm_dispatch, *ops, torch.bfloat16))
    rows.append(
        {"case": name, "block_m": "auto"} | accuracy(None, o16, want, absref, "wgmma") | {"error": e16}
    )
    for r in rows:
        r["ok"] = bool(r["ok"]) and r["error"] is None
    return rows


def check_quant(dev: torch.device) -> list[dict[str, Any]]:
    """The Triton 1x128 quantiser must give the reference's bits (values and scales), and the
    reference must give the same bits on the GPU as on the CPU (run 1: the GPU reference's
    `amax / 448` was a reciprocal multiply, 1471 of 2664 scales one ulp off)."""
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(333, 1000, device=dev, generator=g)
    x = x * torch.exp(2 * torch.randn(333, 1000, device=dev, generator=g))
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for pow2 in (False, True):
            xx = x.to(dtype)
            got, err = attempt(partial(kern.triton_quantize_act, xx, pow2))
            rq, rs = ref.quantize_act(xx, pow2)
            cq, cs = ref.quantize_act(xx.cpu(), pow2)
            entry: dict[str, Any] = {"dtype": str(dtype), "pow2": pow2, "error": err, "ok": False}
            entry["gpu_ref_vs_cpu_ref_value_mismatches"] = int(
                (rq.cpu().view(torch.uint8) != cq.view(torch.uint8)).sum()
            )
            entry["gpu_ref_vs_cpu_ref_scale_mismatches"] = int((rs.cpu() != cs).sum())
            if got is not None:
                q, sc = got
                entry["value_mismatches"] = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
                entry["scale_mismatches"] = int((sc != rs).sum())
                entry["ok"] = (
                    entry["value_mismatches"] == 0
                    and entry["scale_mismatches"] == 0
                    and entry["gpu_ref_vs_cpu_ref_value_mismatches"] == 0
                    and entry["gpu_ref_vs_cpu_ref_scale_mismatches"] == 0
                )
            rows.append(entry)
    return rows


def self_check(dev: torch.device) -> dict[str, Any]:
    shapes = [(64, 7168, 2048), (128, 2048, 7168), (300, 1000, 1300), (4096, 4096, 7168), (5, 384, 640)]
    res: dict[str, Any] = {"dense": [row for m, n, k in shapes for row in check_dense_shape(m, n, k, dev)]}
    res["grouped"] = [
        row
        for case in [("small", 8, 100, 512, 640), ("decode", 32, 256, 4096, 7168)]
        for row in check_grouped(*case, dev)
    ]
    res["quant"] = check_quant(dev)
    res["ok"] = all(r["ok"] for part in ("dense", "grouped", "quant") for r in res[part])
    res["failed"] = [
        f"{part}: {r.get('variant') or r.get('case')} {r.get('shape') or r.get('block_m') or r.get('dtype')}"
        for part in ("dense", "grouped", "quant")
        for r in res[part]
        if not r["ok"]
    ]
    return res


# ------------------------------------------------------------------ dense


def timed(
    row: dict[str, Any],
    name: str,
    flops: float,
    fn: Callable[[], Any],
    grad_to_none: list[torch.Tensor] | None = None,
    graph: bool = False,
    short: bool = False,
) -> float | None:
    """Time fn (or its CUDA-graph replay) into row["ms"][name] / row["tflops"][name], or record
    its error."""
    if graph:
        replay, err = attempt(partial(graphed, fn))
        if err:
            row["errors"][name] = err
            return None
        fn = replay
    ms, err = attempt(partial(bench_ms, fn, grad_to_none, short))
    if err:
        row["errors"][name] = err
        return None
    row["ms"][name] = ms
    row["tflops"][name] = tflops(flops, ms)
    return ms


def graphed(fn: Callable[[], Any], calls: int = 1) -> Callable[[], None]:
    """`calls` calls of fn captured in a CUDA graph, as the engine's decode step runs: the replay
    has no Python or launch overhead, so it times the GPU work alone. Run 1 timed eager calls only, and at M <= 256
    the fp8 paths' host time (several torch ops and launches per call) showed up in the numbers:
    the same Triton config measured 41 us in one variant and 98 us in another (64 x 4096 x 7168),
    and the whole fp8 linear 125-250 us against 16-77 us for bf16."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile / autotune outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


# (fp8 variant, its bf16 baseline) for speedup_vs_bf16; "_graph" = CUDA-graph replay (GPU time).
PAIRS = [
    ("torch_blockwise", "bf16"),
    ("auto", "bf16"),
    ("linear_fp8_auto", "linear_bf16"),
    ("torch_blockwise_graph", "bf16_graph"),
    ("auto_graph", "bf16_graph"),
    ("sweep_best_graph", "bf16_graph"),
    ("linear_fp8_graph", "linear_bf16_graph"),
    ("linear_fp8_fused_graph", "linear_bf16_graph"),
]


def engine_act(d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation as the engine hands it to the GEMM: the Triton quantiser's bits (equal to
    the reference's, self-check) with its column-major scales. Runs 1-2 timed the reference's
    row-major scales, which the torch path transposes (a copy per call) and the Triton kernels
    read with strided loads; tune.py times this layout."""
    return kern.triton_quantize_act(d["x"])


def dense_row(m: int, n: int, k: int, dev: torch.device) -> dict[str, Any]:
    """The tuned dispatch ("auto") against bf16 and cuBLAS block-wise, eager and as CUDA-graph
    replays, and where the whole linear's time goes (the activation quantiser alone)."""
    d = quantised(m, n, k, dev)
    ops = (*engine_act(d), d["wq"], d["ws"], torch.bfloat16)
    flops = 2.0 * m * n * k
    row: dict[str, Any] = {"M": m, "N": n, "K": k, "ms": {}, "tflops": {}, "errors": {}}
    choice = fl.auto_choice(m, n, k, dev)
    row["auto_choice"] = choice_name(choice)
    row["auto_repr"] = "TORCH" if choice == kern.TORCH else repr(choice)
    row["auto_from_table"] = kern.tuned_choice(m, n, k) is not None
    # Which table entry won this shape (bench/fp8/tune.py's output): the whole linear runs fused
    # quantise+GEMM where the table says so (ops/fp8/dispatch.fp8_matmul).
    fused_cfg = kern.tuned_linear_fused(m, n, k)
    row["auto_linear"] = "separate" if fused_cfg is None else f"fused {fused_cfg.name()}"
    bucket = kern.m_bucket(m)
    entry = next((e for e in TABLE.dense if (e.m, e.n, e.k) == (bucket, n, k)), None)
    row["table_entry"] = (
        None if entry is None else {"m_bucket": bucket, "source": entry.source, "us": entry.us}
    )
    linear_fp8 = partial(fl.fp8_matmul, d["x"], d["wq"], d["ws"], torch.bfloat16)
    variants: list[tuple[str, Callable[[], Any]]] = [
        ("bf16", partial(torch.matmul, d["x"], d["w"].t())),
        ("torch_blockwise", partial(ref.fp8_gemm, *ops, "torch")),
        ("auto", partial(fl.fp8_gemm_dispatch, *ops)),
        ("quant_act", partial(fl.quantize_activation, d["x"])),
        ("linear_bf16", partial(F.linear, d["x"], d["w"])),
        ("linear_fp8_auto", linear_fp8),
    ]
    for name, fn in variants:
        timed(row, name, flops, fn)
        if name != "linear_fp8_auto":
            timed(row, f"{name}_graph", flops, fn, graph=True)
    timed(row, "linear_fp8_graph", flops, linear_fp8, graph=True)
    if m <= GRAPH_MAX_M:  # decode sizes: the quantiser fused into the GEMM (benchmark variant)
        cfg = choice if isinstance(choice, kern.GemmConfig) else kern.pick_config(m, n, k, kern.num_sms(dev))
        row["fused_config"] = cfg.name()
        fused = partial(kern.triton_fp8_linear_fused, d["x"], d["wq"], d["ws"], torch.bfloat16, cfg)
        timed(row, "linear_fp8_fused_graph", flops, fused, graph=True)
    speedups(row)
    return row


def speedups(row: dict[str, Any]) -> None:
    ms = row["ms"]
    row["speedup_vs_bf16"] = {fp8: ms[bf] / ms[fp8] for fp8, bf in PAIRS if fp8 in ms and bf in ms}


def sweep_row(row: dict[str, Any], dev: torch.device, sms: int) -> None:
    """Every candidate Triton config for this shape, as CUDA-graph replays (GPU time; the data for
    the next TUNED_CONFIGS)."""
    m, n, k = row["M"], row["N"], row["K"]
    d = quantised(m, n, k, dev)
    ops = (*engine_act(d), d["wq"], d["ws"], torch.bfloat16)
    flops = 2.0 * m * n * k
    trial: dict[str, Any] = {"ms": {}, "tflops": {}, "errors": row["errors"]}
    best: tuple[float, kern.GemmConfig] | None = None
    for cfg in kern.candidate_configs(m, n, k, sms):
        fn = partial(kern.triton_fp8_gemm, *ops, cfg)
        ms = timed(trial, f"sweep {cfg.name()}", flops, fn, graph=True, short=True)
        if ms is not None and (best is None or ms < best[0]):
            best = (ms, cfg)
    row["sweep_ms"] = trial["ms"]
    if best is not None:
        row["ms"]["sweep_best_graph"] = best[0]
        row["tflops"]["sweep_best_graph"] = tflops(flops, best[0])
        row["sweep_best_config"] = best[1].name()
        row["sweep_best_repr"] = repr(best[1])
    speedups(row)


def dense_rows(dev: torch.device, t0: float, sweep_budget_s: float = SWEEP_BUDGET_S) -> list[dict[str, Any]]:
    """First the tuned dispatch at every shape, then config sweeps in priority order (decode M
    first) while the time budget lasts."""
    rows = []
    sms = kern.num_sms(dev)
    for n, k in DENSE_NK:
        for m in DENSE_M:
            row = dense_row(m, n, k, dev)
            rows.append(row)
            sp = row["speedup_vs_bf16"]
            print(
                f"M={m:5d} N={n:5d} K={k:5d} | auto={row['auto_choice']:28s} "
                f"linear={row['auto_linear'][:5]} | x bf16: "
                + " ".join(f"{v}={x:.2f}" for v, x in sp.items())
                + f" | quant {row['ms'].get('quant_act_graph', 0) * 1e3:.0f} us",
                flush=True,
            )
    for sweep_m in SWEEP_ORDER:
        for row in rows:
            if row["M"] != sweep_m:
                continue
            if time.perf_counter() - t0 > sweep_budget_s:
                row["errors"]["sweep"] = "skipped: time budget"
                continue
            sweep_row(row, dev, sms)
            sp = row["speedup_vs_bf16"]
            print(
                f"sweep M={row['M']:5d} N={row['N']:5d} K={row['K']:5d} | best "
                f"{row.get('sweep_best_config')} x bf16 {sp.get('sweep_best_graph', 0):.2f}"
                f" (auto {sp.get('auto_graph', 0):.2f}, torch {sp.get('torch_blockwise_graph', 0):.2f};"
                " graph replays)",
                flush=True,
            )
    return rows


def table_suggestion(rows: list[dict[str, Any]]) -> list[str]:
    """TUNED_CONFIGS lines (ops/fp8/triton_gemm.py format) from this run: per bucket
    M, the fastest (CUDA-graph replay, i.e. GPU time) of cuBLAS block-wise, the auto choice and
    every swept Triton config; the comment is its speedup over bf16 (also replayed)."""
    lines = []
    for r in rows:
        ms = r["ms"]
        if r["M"] not in kern.M_BUCKETS or "bf16_graph" not in ms:
            continue
        options: list[tuple[float, str]] = []
        if "torch_blockwise_graph" in ms:
            options.append((ms["torch_blockwise_graph"], "TORCH"))
        if "auto_graph" in ms and r["auto_repr"] != "TORCH":
            options.append((ms["auto_graph"], r["auto_repr"]))
        if "sweep_best_graph" in ms:
            options.append((ms["sweep_best_graph"], r["sweep_best_repr"]))
        if options:
            best_ms, what = min(options)
            lines.append(f"({r['M']}, {r['N']}, {r['K']}): {what},  # {ms['bf16_graph'] / best_ms:.2f}")
    return lines


# ------------------------------------------------------------------ grouped


def grouped_inputs(
    e: int, t: int, n: int, k: int, dev: torch.device, seed: int = 0, sizes: list[int] | None = None
) -> dict[str, Any]:
    """bf16 inputs x (T, K), w (E, N, K), their fp8 quantisations, group sizes and end offsets.
    The rows are routed unevenly at random unless `sizes` gives each expert's count."""
    if sizes is None:
        g = torch.Generator().manual_seed(seed)
        # Uneven routing: Dirichlet-like expert popularity, some experts may get no rows.
        probs = torch.distributions.Gamma(torch.full((e,), 0.7), torch.ones(e)).sample()
        sizes = torch.bincount(
            torch.multinomial(probs / probs.sum(), t, replacement=True, generator=g), minlength=e
        ).tolist()
    gd = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(t, k, device=dev, generator=gd).to(torch.bfloat16)
    w = (torch.randn(e, n, k, device=dev, generator=gd) * 0.02).to(torch.bfloat16)
    a = ref.quantize_act(x)
    qs = [ref.quantize_weight(w[i]) for i in range(e)]
    wq = torch.stack([q for q, _ in qs])
    ws = torch.stack([s for _, s in qs])
    offs = ref.group_offsets(sizes).to(dev)
    return {"x": x, "w": w, "a": a, "sizes": list(sizes), "offs": offs, "wq": wq, "ws": ws}


def bf16_loop(x: torch.Tensor, w: torch.Tensor, bounds: list[int]) -> None:
    for i in range(len(bounds) - 1):
        if bounds[i + 1] > bounds[i]:
            torch.matmul(x[bounds[i] : bounds[i + 1]], w[i].t())


def grouped_row(name: str, e: int, t: int, n: int, k: int, dev: torch.device, sweep: bool) -> dict[str, Any]:
    gi = grouped_inputs(e, t, n, k, dev)
    x, w, offs = gi["x"], gi["w"], gi["offs"]
    ops = (gi["a"][0], gi["a"][1], gi["wq"], gi["ws"])
    flops = 2.0 * t * n * k
    row: dict[str, Any] = {"case": name, "E": e, "T": t, "N": n, "K": k, "group_sizes": gi["sizes"]}
    row.update(ms={}, tflops={}, errors={})
    bounds = [0, *torch.as_tensor(gi["sizes"]).cumsum(0).tolist()]
    if hasattr(torch, "_grouped_mm"):
        timed(row, "bf16_grouped_mm", flops, partial(torch._grouped_mm, x, w.transpose(-2, -1), offs=offs))
    timed(row, "bf16_loop", flops, partial(bf16_loop, x, w, bounds))
    timed(
        row,
        "torch_blockwise_loop",
        flops,
        partial(ref.grouped_fp8_gemm, *ops, bounds[1:], torch.bfloat16, "torch"),
    )
    timed(row, "triton_grouped", flops, partial(kern.triton_grouped_fp8_gemm, *ops, offs, torch.bfloat16))
    timed(row, "auto_grouped", flops, partial(fl.grouped_fp8_gemm_dispatch, *ops, offs, torch.bfloat16))
    row["auto_grouped_backend"] = "cuda" if fl.grouped_cuda_choice(t, e, dev) else "triton"
    row["triton_block_m"] = kern.pick_grouped_block_m(t, e)
    if sweep:
        best: tuple[float, str] | None = None
        for bm in (16, 32, 64, 128):
            for bn in (64, 128):
                fn = partial(kern.triton_grouped_fp8_gemm, *ops, offs, torch.bfloat16, bm, bn)
                ms, err = attempt(partial(bench_ms, fn))
                if err:
                    row["errors"][f"sweep m{bm}n{bn}"] = err
                elif best is None or ms < best[0]:
                    best = (ms, f"block_m={bm} block_n={bn}")
        if best is not None:
            row["ms"]["triton_grouped_best"] = best[0]
            row["tflops"]["triton_grouped_best"] = tflops(flops, best[0])
            row["triton_grouped_best_config"] = best[1]
    base = min([row["ms"][v] for v in ("bf16_grouped_mm", "bf16_loop") if v in row["ms"]], default=None)
    row["speedup_vs_best_bf16"] = {
        v: base / ms for v, ms in row["ms"].items() if base and not v.startswith("bf16")
    }
    return row


def grouped_rows(dev: torch.device, t0: float) -> list[dict[str, Any]]:
    rows = []
    for name, e, t, n, k in GROUPED:
        row = grouped_row(name, e, t, n, k, dev, sweep=time.perf_counter() - t0 < TIME_BUDGET_S)
        rows.append(row)
        print(
            f"{name:16s} E={e} T={t:5d} N={n} K={k} | "
            + " ".join(f"{v}={row['tflops'][v]:.0f}" for v in row["tflops"])
            + " | x best bf16: "
            + " ".join(f"{v}={sp:.2f}" for v, sp in row["speedup_vs_best_bf16"].items()),
            flush=True,
        )
    return rows


def summary(dense: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals for what the engine runs ("auto", the tuned dispatch): >= 1.7x bf16 at
    M >= 4096, never slower than bf16 at M = 64-128. Speedups from CUDA-graph replays (GPU time:
    the engine captures its decode step) and, for the whole linear (quantiser included), eager too."""

    def sp(r: dict[str, Any], key: str) -> float | None:
        v = r["speedup_vs_bf16"].get(key)
        return None if v is None else round(v, 3)

    def met(rows: list[dict[str, Any]], key: str, goal: float) -> bool:
        return bool(rows) and all((sp(r, key) or 0.0) >= goal for r in rows)

    large = [r for r in dense if r["M"] >= 4096]
    small = [r for r in dense if r["M"] <= 128]
    keys = (
        "auto_graph",
        "auto",
        "linear_fp8_graph",
        "linear_fp8_auto",
        "sweep_best_graph",
        "linear_fp8_fused_graph",
    )
    return {
        "columns": ["M", "N", "K", *keys],
        "large_M": [[r["M"], r["N"], r["K"], *(sp(r, key) for key in keys)] for r in large],
        "small_M": [[r["M"], r["N"], r["K"], *(sp(r, key) for key in keys)] for r in small],
        "large_M_goal_1.7x_met_by_auto_gemm": met(large, "auto_graph", 1.7),
        "large_M_goal_1.7x_met_by_auto_linear": met(large, "linear_fp8_graph", 1.7),
        "small_M_never_slower_met_by_auto_gemm": met(small, "auto_graph", 1.0),
        "small_M_never_slower_met_by_auto_linear": met(small, "linear_fp8_graph", 1.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fp8_gemm.json")
    ap.add_argument("--skip-grouped", action="store_true")
    ap.add_argument(
        "--sweep-budget-s",
        type=float,
        default=SWEEP_BUDGET_S,
        help="seconds from the start after which no dense config sweep starts (0: no sweeps)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fp8/gemm.py needs a CUDA GPU (Hopper)")
    dev = torch.device("cuda")
    # The reference GEMM relies on exact float32 products of E4M3 values: no TF32.
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": machine(),
        "triton_max_m": fl.TRITON_MAX_M,
        "tuned_configs": {str(key): choice_name(v) for key, v in kern.TUNED_CONFIGS.items()},
        "tuned_linear_fused": {str(key): v.name() for key, v in kern.TUNED_FUSED.items()},
        "table_path": str(kern.table_path()),
        "errors": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        result["triton_failures_in_auto"] = dict(fl.TRITON_FAILURES)
        write_result(out, result)

    for section, fn in (
        ("self_check", lambda: self_check(dev)),
        ("dense", lambda: dense_rows(dev, t0, args.sweep_budget_s)),
        ("grouped", (lambda: []) if args.skip_grouped else (lambda: grouped_rows(dev, t0))),
    ):
        try:
            result[section] = fn()
        except Exception:  # noqa: BLE001 - keep what was measured
            result["errors"].append(f"{section}: {traceback.format_exc()[-2000:]}")
        if section == "self_check":
            print("self-check ok:", result.get("self_check", {}).get("ok"), flush=True)
        save()
    if result.get("dense"):
        result["summary"] = summary(result["dense"])
        result["tuned_table_suggestion"] = table_suggestion(result["dense"])
        print(json.dumps(result["summary"], indent=1))
        print("TUNED_CONFIGS suggestion:\n    " + "\n    ".join(result["tuned_table_suggestion"]))
    save()
    print(f"wrote {out} in {result['elapsed_s']} s")


if __name__ == "__main__":
    main()
