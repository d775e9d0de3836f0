"""The MoE grouped FP8 GEMM on one Hopper GPU: our CUDA kernel's grouped variants
(ops/fp8/cuda/fp8_wgmma.fp8_grouped_gemm, bench/kernels/fp8_wgmma_variants.cu's grouped ones) checked against the recipe's reference,
then timed against bf16 `torch._grouped_mm` and the Triton grouped kernel (what "auto" ran before)
in the same process, at DeepSeek-V3's expert shapes over a range of rows per expert.

    PYTHONPATH=. python3 bench/fp8/grouped.py --out $OUT/fp8_grouped.json

1. Self-check: uneven groups (empty experts, a 1-row expert, groups ending inside a 128-row tile
   and on its edge, N not a multiple of 256), the output poisoned with NaN first; the float32
   reference is ops/fp8/recipe.grouped_fp8_gemm's per-expert reference path. Timing runs
   only when every check passed.
2. Timing: E = 32 experts, rows routed unevenly (gemm.py's `grouped_inputs`: Gamma-distributed
   expert popularity), T = E x rows per expert; (N, K) = (4096, 7168) (fused gate/up) and
   (7168, 2048) (down). CUDA-graph replays, the kernels taking turns over rounds
   (wgmma.bench_rounds, median; bf16 in the same rounds). The row records the Triton block the
   dispatch picked and every sample.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemm as bench  # noqa: E402
from wgmma import MAX_REL_ERR, ROUNDS, add_tflops, bench_rounds  # noqa: E402

from bench.kernels import fp8_wgmma_variants as variants  # noqa: E402
from bench.results import write_result
from ops.fp8 import recipe as ref  # noqa: E402
from ops.fp8 import triton_gemm as kern  # noqa: E402
from ops.fp8.cuda import fp8_wgmma  # noqa: E402

# (group sizes, N, K): empty experts, a 1-row expert, groups ending inside a tile and on its edge
# (128, 256), N = 384 (3 weight-scale blocks padded to 4, a 256-wide tile past N), K = 128 (one K
# block: the lent epilogue slot wraps every other slot).
CHECK_CASES: list[tuple[list[int], int, int]] = [
    ([0, 1, 300, 129, 0, 128, 256, 7], 256, 256),
    ([5, 0, 0, 700, 64, 1000], 384, 1024),
    ([128, 128, 1, 255], 4096, 128),
]
CHECK_RANDOM = [(32, 2048, 7168, 2048), (8, 1000, 4096, 7168)]  # (E, T, N, K), routed as in gemm.py
TIME_E = 32
TIME_ROWS_PER_EXPERT = [32, 64, 128, 256, 512]
TIME_NK = [(4096, 7168), (7168, 2048)]


def grouped_variants() -> list[int]:
    return variants.grouped()


def check_one(d: dict[str, Any], n: int, k: int) -> list[dict[str, Any]]:
    aq, a_s = d["a"]
    want = ref.grouped_fp8_gemm(aq, a_s, d["wq"], d["ws"], d["offs"], torch.float32, backend="reference")
    rows = []
    for variant in grouped_variants():
        out = torch.full((aq.shape[0], n), float("nan"), device=aq.device, dtype=torch.bfloat16)
        fp8_wgmma.fp8_grouped_gemm(
            aq, a_s, d["wq"], d["ws"], d["offs"], out=out, variant=variant, lib=variants.library()
        )
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(out).all())
        # Per expert, so that one small expert's wrong rows cannot hide in the whole output's norm.
        ends = [0, *d["offs"].tolist()]
        err = max(bench.rel(out[s:e], want[s:e]) for s, e in zip(ends, ends[1:], strict=False) if e > s)
        rows.append({"T": aq.shape[0], "E": len(d["sizes"]), "N": n, "K": k, "variant": variant,
                     "max_expert_rel_err": err, "all_written": finite, "ok": finite and err < MAX_REL_ERR})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def self_check(dev: torch.device) -> list[dict[str, Any]]:
    rows = []
    for i, (sizes, n, k) in enumerate(CHECK_CASES):
        rows += check_one(
            bench.grouped_inputs(len(sizes), sum(sizes), n, k, dev, seed=10 + i, sizes=sizes), n, k
        )
    for i, (e, t, n, k) in enumerate(CHECK_RANDOM):
        gi = bench.grouped_inputs(e, t, n, k, dev, seed=20 + i)
        rows += check_one(gi, n, k)
    return rows


def time_row(e: int, t: int, n: int, k: int, dev: torch.device) -> dict[str, Any]:
    gi = bench.grouped_inputs(e, t, n, k, dev)
    (aq, a_s), wq, ws, offs = gi["a"], gi["wq"], gi["ws"], gi["offs"]
    a_s = ref._outer_major(a_s)  # K-block-major, as the Triton quantiser writes it
    row: dict[str, Any] = {
        "E": e,
        "T": t,
        "N": n,
        "K": k,
        "rows_per_expert": t / e,
        "group_sizes": gi["sizes"],
    }
    row["triton_block"] = list(kern.grouped_launch(t, e, n, k))
    fns = {
        "bf16_grouped_mm": partial(torch._grouped_mm, gi["x"], gi["w"].transpose(-2, -1), offs=offs),
        "triton_grouped": partial(kern.triton_grouped_fp8_gemm, aq, a_s, wq, ws, offs, torch.bfloat16),
    }
    for v in grouped_variants():
        fns[f"cuda_v{v}"] = partial(
            fp8_wgmma.fp8_grouped_gemm, aq, a_s, wq, ws, offs, variant=v, lib=variants.library()
        )
    bench_rounds(fns, row)
    add_tflops(row, 2.0 * t * n * k)
    base = row["bf16_grouped_mm_us"]
    row["speedup_vs_bf16"] = {name: base / row[f"{name}_us"] for name in fns if name != "bf16_grouped_mm"}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=ROUNDS[0], help="timing rounds (wgmma.bench_rounds)")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--experts", type=int, default=TIME_E, help="E of the timed shapes")
    ap.add_argument(
        "--rows",
        default=",".join(map(str, TIME_ROWS_PER_EXPERT)),
        help="rows per expert to time (comma list)",
    )
    ap.add_argument(
        "--nk",
        default=",".join(f"{n}x{k}" for n, k in TIME_NK),
        help="expert (N, K) shapes as NxK comma list (default DeepSeek-V3's gate/up and down; "
        "Qwen3-30B-A3B's: 1536x2048,2048x768)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fp8/grouped.py needs a Hopper GPU")
    ROUNDS[0] = args.rounds
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    result: dict[str, Any] = {
        "command": " ".join(["python3", *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": bench.machine(),
        "baseline": "bf16 torch._grouped_mm (cuBLAS) and relay's Triton grouped FP8 kernel, same process, "
        "taking turns with ours (wgmma.bench_rounds: median of --rounds)",
        "variants": {v: variants.VARIANTS[v].name for v in grouped_variants()},
        "default_variant": variants.DEFAULT_GROUPED,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["check"] = self_check(dev)
    result["check_ok"] = all(r["ok"] for r in result["check"])
    print("check_ok", result["check_ok"], flush=True)
    write_result(out, result)
    if args.skip_timing or not result["check_ok"]:
        return
    result["rows"] = []
    e = args.experts
    nks = [tuple(int(v) for v in nk.split("x")) for nk in args.nk.split(",") if nk]
    for n, k in nks:
        for per in [int(v) for v in args.rows.split(",") if v]:
            row = time_row(e, e * per, n, k, dev)
            result["rows"].append(row)
            print(
                f"E={e} T={e * per:6d} N={n:5d} K={k:5d} bf16 {row['bf16_grouped_mm_tflops']:5.0f} "
                + " ".join(f"{name} {sp:.2f}x" for name, sp in row["speedup_vs_bf16"].items()),
                flush=True,
            )
            write_result(out, result)


if __name__ == "__main__":
    main()
