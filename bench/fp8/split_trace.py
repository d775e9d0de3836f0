"""Where the split ("_sk", stream-K) variants of the CUDA FP8 GEMM spend their time: a build of
fp8_wgmma.cu with RELAY_SPLIT_TRACE, whose math thread 0 of every CTA stamps the GPU's global
timer at the walk's events (start, first split item, partial sum left, flag raised, its own K
blocks done, the others' partial sums arrived and added, end), against the same variants'
unsplit counterparts traced the same way.

Why: the split variants, which should shorten the persistent walk's last round, measured slower
than their counterparts (results/deepgemm_h100_23_split.json), by more than their partial sums'
traffic explains. The trace says whether the owners wait, how long a partial sum takes to leave
and to be added, and when each CTA ends.

    python3 bench/fp8/split_trace.py --variants 18,25 --shapes 4096x9728x2560 --out $OUT/split_trace.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemm as bench  # noqa: E402
from wgmma import MAX_REL_ERR, quantised, weight_scales  # noqa: E402

from services.common import fp8 as ref  # noqa: E402
from services.engine.kernels.cuda import fp8_wgmma, nvcc  # noqa: E402

SLOTS = 8  # fp8_wgmma.cu's TRACE_SLOTS
EVENTS = [
    "start",
    "split_start",
    "partial_k_done",
    "partial_left",
    "own_k_done",
    "partials_in",
    "added",
    "end",
]


def trace_library() -> ctypes.CDLL:
    flags = (*fp8_wgmma.NVCC_FLAGS, "-DRELAY_SPLIT_TRACE")
    path = nvcc.library_path(fp8_wgmma.SOURCE, "fp8_wgmma_trace", flags)
    if not path.exists():
        nvcc.build(fp8_wgmma.SOURCE, path, flags)
    lib = fp8_wgmma.load(path)
    lib.relay_fp8_trace_read.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.relay_fp8_trace_read.restype = ctypes.c_int
    lib.relay_fp8_trace_clear.argtypes = []
    lib.relay_fp8_trace_clear.restype = ctypes.c_int
    return lib


def traced(lib: ctypes.CDLL, run: Any, ctas: int) -> list[list[int]]:
    """One launch's stamps: per CTA, ns since the earliest start (-1: the event did not happen)."""
    assert lib.relay_fp8_trace_clear() == 0
    run()
    torch.cuda.synchronize()
    buf = (ctypes.c_ulonglong * (SLOTS * ctas))()
    assert lib.relay_fp8_trace_read(buf, ctas) == 0
    raw = [[int(buf[c * SLOTS + e]) for e in range(SLOTS)] for c in range(ctas)]
    t0 = min(r[0] for r in raw)
    return [[t - t0 if t else -1 for t in r] for r in raw]


def summarise(launches: list[list[list[int]]]) -> dict[str, Any]:
    """Medians over launches of the per-launch figures (us)."""

    def per_launch(stamps: list[list[int]]) -> dict[str, float]:
        ends = [r[7] for r in stamps]
        out = {"kernel_us": max(ends) / 1e3, "first_end_us": min(ends) / 1e3}
        split = [r for r in stamps if r[1] >= 0]
        if split:
            out["split_start_us_min"] = min(r[1] for r in split) / 1e3
            out["split_start_us_max"] = max(r[1] for r in split) / 1e3
            left = [r[3] - r[2] for r in stamps if r[2] >= 0 and r[3] >= 0]
            wait = [r[5] - r[4] for r in stamps if r[4] >= 0 and r[5] >= 0]
            add = [r[6] - r[5] for r in stamps if r[5] >= 0 and r[6] >= 0]
            for name, xs in (("leave_partial_us", left), ("wait_us", wait), ("add_us", add)):
                if xs:
                    out[f"{name}_mean"] = statistics.mean(xs) / 1e3
                    out[f"{name}_max"] = max(xs) / 1e3
        return out

    rows = [per_launch(s) for s in launches]
    return {k: statistics.median(r[k] for r in rows if k in r) for k in rows[0]}


def walk_steps(v: int, m: int, n: int) -> int:
    """The walk's steps for variant v at an (M, N) output (one per cluster of tiles)."""
    bn, _, mode, cluster = fp8_wgmma.VARIANTS[v]
    tiles_m, tiles_n = math.ceil(m / fp8_wgmma.tile_rows(v)), math.ceil(n / bn)
    if fp8_wgmma.mode_parts(mode)[0] == "tall":  # clusters share A: neighbouring columns
        return tiles_m * math.ceil(tiles_n / cluster)
    return math.ceil(tiles_m / cluster) * tiles_n


def phases(lib: ctypes.CDLL, v: int, m: int, n: int, k: int, stamps: list[list[int]]) -> dict[str, float]:
    """Where one launch's time went, per walker (its cluster's first CTA), from the kernel's own
    schedule (fp8_wgmma.walk): a whole step's time, a split K block's time and the partial-sum
    exchange (leaving one, waiting for and adding the others'), against the K blocks the split
    phase gives each walker and the plain walk's two last rounds it replaces (us, medians)."""
    cluster = fp8_wgmma.VARIANTS[v][3]
    walkers = len(stamps) // cluster
    steps, nkb = walk_steps(v, m, n), k // 128
    out: dict[str, list[float]] = {
        "whole_step_us": [],
        "split_block_us": [],
        "exchange_us": [],
        "split_blocks": [],
    }
    for w in range(walkers):
        x = stamps[w * cluster]
        items = fp8_wgmma.walk(steps, walkers, nkb, w, split=fp8_wgmma.splits_k(v), lib=lib)
        if x[1] < 0:  # no split phase: the plain walk
            out["whole_step_us"].append(x[7] / 1e3 / len(items))
            continue
        # Walk's whole steps: w, w + P, ... below the first split step, one round before the last.
        split_base = max(0, (steps // walkers - 1) * walkers)
        whole = max(0, -(-(split_base - w) // walkers))
        blocks = sum(hi - lo for _, lo, hi, _ in items[whole:])
        exchange = sum(max(0, x[b] - x[a]) for a, b in ((2, 3), (4, 6)) if x[a] >= 0 and x[b] >= 0)
        if whole:
            out["whole_step_us"].append(x[1] / 1e3 / whole)
        out["split_blocks"].append(blocks)
        out["exchange_us"].append(exchange / 1e3)
        out["split_block_us"].append((x[7] - x[1] - exchange) / 1e3 / blocks)
    return {k_: statistics.median(vs) for k_, vs in out.items() if vs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="18,25,22,26")
    ap.add_argument("--shapes", default="4096x9728x2560,4096x7168x2048", help="MxNxK comma list")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    lib = trace_library()
    result = bench.new_result(
        "each split variant's unsplit counterpart (18 for 25, 22 for 26), traced the same way in "
        "the same process; medians over --launches eager launches after 5 warm-up launches"
    )
    result["events"] = EVENTS
    for shape in args.shapes.split(","):
        m, n, k = (int(x) for x in shape.split("x"))
        d = quantised(m, n, k, dev, seed=m + n + k)
        want = ref.fp8_gemm_reference(d["aq"], d["as"], d["wq"], d["ws"], torch.float32)
        for v in (int(x) for x in args.variants.split(",")):
            out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)

            def run(v: int = v, out: torch.Tensor = out, d: dict[str, torch.Tensor] = d) -> None:
                fp8_wgmma.fp8_gemm(
                    d["aq"], d["as_col"], d["wq"], weight_scales(d, v), out=out, variant=v, lib=lib
                )

            run()
            torch.cuda.synchronize()
            err = bench.rel(out, want)
            ok = bool(torch.isfinite(out).all()) and err < MAX_REL_ERR
            for _ in range(5):
                run()
            ctas = int(lib.relay_fp8_gemm_grid(v, m, n, k, fp8_wgmma.num_sms(dev)))
            launches = [traced(lib, run, ctas) for _ in range(args.launches)]
            per = [phases(lib, v, m, n, k, s) for s in launches]
            row = {"M": m, "N": n, "K": k, "variant": v, "ctas": ctas, "rel_err": err, "ok": ok,
                   **summarise(launches), "phases": {kk: statistics.median(p[kk] for p in per) for kk in per[0]},
                   "last_launch": launches[-1]}  # fmt: skip
            result["rows"].append(row)
            print(json.dumps({kk: vv for kk, vv in row.items() if kk != "last_launch"}), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
