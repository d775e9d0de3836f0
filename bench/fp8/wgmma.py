"""The warp-specialised CUDA FP8 GEMM (ops/fp8/cuda/fp8_wgmma.cuh) in the configurations of
bench/kernels/fp8_wgmma_variants.cu (the product's first) against bf16 cuBLAS
and torch's block-wise scaled_mm (cuBLAS) in the same process, at DeepSeek-V3's large-M shapes.

First a self-check: build the library, then at ragged and full shapes (M tails, N not a multiple
of 128, K = 128..7168) compare with the float32 reference of the recipe (ops/fp8/recipe.py)
on freshly drawn inputs, the output poisoned with NaN before every launch. Then CUDA-graph timings
(triton.testing.do_bench_cudagraph, median) of each pipeline depth.

    python3 bench/fp8/wgmma.py --out $OUT/fp8_wgmma.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemm as bench  # noqa: E402

from bench.kernels import fp8_wgmma_variants as variants  # noqa: E402
from bench.results import write_result
from ops.fp8 import recipe as ref  # noqa: E402
from ops.fp8.cuda import fp8_wgmma  # noqa: E402

# (2048, 4096, 128): one K block per tile and ~2 tiles per CTA, so the "_tma" modes' lent epilogue
# slot wraps around the ring every other slot; (77, 2110, 256): N % 8 != 0, the "_tma" modes'
# fallback to the direct epilogue.
# (333, 18432, 1280): ragged rows, a cluster's second tile outside M.
CHECK_SHAPES = [
    (1, 256, 128),
    (77, 2112, 2048),
    (1000, 2048, 7168),
    (4096, 4096, 7168),
    (333, 18432, 1280),
    (2048, 4096, 128),
    (77, 2110, 256),
]
TIME_MS = [4096, 8192]
TIME_NK = [(7168, 2048), (4096, 7168), (2048, 7168), (18432, 7168)]
VARIANT_IDS: list[int] = []  # the dense ones by default (main); grouped.py checks the rest
MAX_REL_ERR = 5e-3  # bf16 output rounding (~2^-9 per element) over the float32 reference


def parse_nk(text: str) -> list[tuple[int, int]]:
    """--nk's "NxK,NxK" -> [(N, K), ...]."""
    return [(int(n), int(k)) for n, k in (nk.split("x") for nk in text.split(","))]


def quantised(m: int, n: int, k: int, dev: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """gemm.py's inputs plus the activation and weight scales K-block-major (what the Triton
    quantiser writes, and what the kernel reads without a copy)."""
    d = bench.quantised(m, n, k, dev, seed)
    return {**d, "as_col": ref._outer_major(d["as"]), "ws_col": ref._outer_major(d["ws"])}


def vname(variant: int) -> str:
    return variants.VARIANTS[variant].name


def gemm(*args: Any, **kw: Any) -> torch.Tensor:
    """fp8_wgmma.fp8_gemm on the variants library."""
    return fp8_wgmma.fp8_gemm(*args, lib=variants.library(), **kw)


def self_check(dev: torch.device) -> list[dict[str, Any]]:
    rows = []
    for i, (m, n, k) in enumerate(CHECK_SHAPES):
        d = quantised(m, n, k, dev, seed=100 + i)
        want = ref.fp8_gemm_reference(d["aq"], d["as"], d["wq"], d["ws"], torch.float32)
        for variant in VARIANT_IDS:
            # "col": both scale tensors K-block-major; "row": both row-major (copied as needed).
            for layout in ("col", "row"):
                out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
                scales = d["as_col"] if layout == "col" else d["as"]
                w_scales = d["ws_col"] if layout == "col" else d["ws"]
                gemm(d["aq"], scales, d["wq"], w_scales, out=out, variant=variant)
                torch.cuda.synchronize()
                finite = bool(torch.isfinite(out).all())
                err = bench.rel(out, want)
                ok = finite and err < MAX_REL_ERR
                rows.append({"M": m, "N": n, "K": k, "variant": vname(variant), "scales": layout, "rel_err": err,
                             "all_written": finite, "ok": ok})  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def add_tflops(row: dict[str, Any], flops: float) -> None:
    """A `<name>_tflops` next to every `<name>_us` timing of the row."""
    for key in [kk for kk in row if kk.endswith("_us")]:
        row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6


def bench_us(fn: Any) -> float:
    return float(triton.testing.do_bench_cudagraph(fn)) * 1000


# Rounds of bench_rounds (--rounds).
ROUNDS = [5]


def bench_rounds(fns: dict[str, Callable[[], Any]], row: dict[str, Any]) -> None:
    """`<name>_us` in `row`: the median over ROUNDS rounds of each function's CUDA-graph timing,
    the functions taking turns within a round, each round starting one later (and every sample
    kept as `<name>_us_samples`).

    Why: back to back at the 700 W cap the card's clock drifts with its temperature and power
    draw, by 10% within one run (one kernel timed 1147 and 1003 TFLOP/s minutes apart
    at the same shape), so one reading per kernel in a fixed order favours whichever ran at the
    better moment. Taking turns spreads the drift over all of them, bf16 included."""
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(ROUNDS[0]):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            samples[name].append(bench_us(fns[name]))
    for name in names:
        row[f"{name}_us"] = statistics.median(samples[name])
        row[f"{name}_us_samples"] = samples[name]


def time_rows(dev: torch.device) -> list[dict[str, Any]]:
    rows = []
    for m in TIME_MS:
        for n, k in TIME_NK:
            d = quantised(m, n, k, dev, seed=m + n + k)
            flops = 2 * m * n * k
            row: dict[str, Any] = {"M": m, "N": n, "K": k}
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            fns = {
                "bf16": lambda d=d: torch.nn.functional.linear(d["x"], d["w"]),
                "torch_blockwise": lambda d=d: ref.fp8_gemm(
                    d["aq"], d["as_col"], d["wq"], d["ws"], torch.bfloat16, backend="torch"
                ),
            }
            for v in VARIANT_IDS:
                fns[f"wgmma_{vname(v)}"] = lambda d=d, v=v, o=out: gemm(
                    d["aq"], d["as_col"], d["wq"], d["ws_col"], out=o, variant=v
                )
            bench_rounds(fns, row)
            add_tflops(row, flops)
            for v in VARIANT_IDS:
                row[f"wgmma_{vname(v)}_grid"] = fp8_wgmma.launch_grid(v, m, n, dev, lib=variants.library())
            best = min(row[f"wgmma_{vname(v)}_us"] for v in VARIANT_IDS)
            row["wgmma_best_vs_bf16"] = row["bf16_us"] / best
            row["wgmma_best_vs_torch_blockwise"] = row["torch_blockwise_us"] / best
            row["torch_blockwise_vs_bf16"] = row["bf16_us"] / row["torch_blockwise_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument(
        "--variants",
        default="",
        help="comma-separated indices into fp8_wgmma_variants.cu's table (default: every dense one)",
    )
    ap.add_argument("--ms", default="", help="comma-separated M values to time (default 4096,8192)")
    ap.add_argument(
        "--nk", default="", help="(N, K) shapes to time, NxK comma list (default the DeepSeek-V3 four)"
    )
    ap.add_argument("--rounds", type=int, default=ROUNDS[0], help="timing rounds (bench_rounds)")
    args = ap.parse_args()
    ROUNDS[0] = args.rounds
    if args.ms:
        TIME_MS[:] = [int(m) for m in args.ms.split(",")]
    if args.nk:
        TIME_NK[:] = parse_nk(args.nk)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    lib = variants.build()
    VARIANT_IDS[:] = [int(v) for v in args.variants.split(",")] if args.variants else variants.dense()
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": torch.cuda.get_device_name(),
        "baseline": "bf16 cuBLAS (F.linear) and torch block-wise scaled_mm (cuBLAS), same process, "
        "taking turns with our kernels (bench_rounds: median of --rounds)",
        "build_s": time.perf_counter() - t0,
        "library": lib.name,
    }
    result["check"] = self_check(dev)
    result["check_ok"] = all(r["ok"] for r in result["check"])
    write_result(args.out, result)
    if result["check_ok"] and not args.skip_timing:
        result["rows"] = time_rows(dev)
        write_result(args.out, result)
    print("check_ok", result["check_ok"])
    for r in result.get("rows", []):
        print(
            f"M={r['M']:5d} N={r['N']:5d} K={r['K']:5d} bf16 {r['bf16_tflops']:6.0f} TF  cublas-bw "
            f"{r['torch_blockwise_tflops']:6.0f} ({r['torch_blockwise_vs_bf16']:.2f}x)  wgmma "
            + " ".join(f"{vname(v)} {r[f'wgmma_{vname(v)}_tflops']:5.0f}" for v in VARIANT_IDS)
            + f"  best {r['wgmma_best_vs_bf16']:.2f}x bf16, {r['wgmma_best_vs_torch_blockwise']:.2f}x cublas-bw"
        )


if __name__ == "__main__":
    main()
