"""Decode-size GEMMs against the memory bandwidth that bounds them: how far the FP8 and bf16
GEMMs at M = 64-128 are from reading their weights at the HBM's peak.

At decode M a GEMM's cost is reading its weight once from HBM (an FP8 weight is half a bf16 one,
so at the limit FP8 is 2x bf16). gemm.py times one call per CUDA-graph replay, so its numbers at
these sizes include the replay's fixed cost (its quantiser, a kernel over a few KB, reads 6 us).
Here each variant's calls over R distinct weights (R x the FP8 weight's bytes >= MIN_BYTES, so
no weight is still in L2 when it is read) are captured back to back in one graph, as a decode
step runs its layers, and a call costs replay / R:

- `read_fp8`, `read_bf16`: a max over the R weights' bytes (as int32) with torch's reduction
  (its first run read no faster than the FP8 GEMMs, so it is a reference, not the limit);
- `empty`: R launches of a one-element kernel: the cost of a kernel in a graph, bytes aside;
- `bf16` (F.linear), `fp8_auto` (the engine's dispatch: fl.fp8_gemm_dispatch), `fp8_cublas`
  (torch's block-wise scaled_mm) and `linear_fp8` (the whole FP8 linear: quantiser + GEMM).

Per row: us per call, the weight's GB/s and its fraction of the HBM's peak (`HBM_TB_S` by GPU
name: the limit a decode GEMM can approach), and each FP8 variant's speed-up over bf16. Then, while
--sweep-budget-s lasts, the Triton kernel's decode configurations (BLOCK_M 64; BLOCK_N, split-K and
stages around the table's) are timed the same way: gemm.py's sweep chose the table's entries from
single-call replays, whose fixed cost hides differences of a few us.

    python3 bench/fp8/decode_stream.py --out $OUT/fp8_decode_stream.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemm as bench  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.results import write_result
from ops.fp8 import dispatch as fl  # noqa: E402
from ops.fp8 import recipe as ref  # noqa: E402
from ops.fp8 import triton_gemm as kern  # noqa: E402

MS = [128, 64]  # 128 first: the first run found the dispatch furthest from bf16 there
MIN_BYTES = 200 * 2**20  # 4x the H100's and H200's 50 MB L2
HBM_TB_S = {"H100 80GB HBM3": 3.35, "H200": 4.8}  # datasheet peaks (SXM)


def hbm_tb_s() -> float | None:
    name = torch.cuda.get_device_name()
    return next((v for key, v in HBM_TB_S.items() if key in name), None)


def per_call_us(fns: list[Callable[[], Any]]) -> float:
    """The median replay of one graph holding every fn once, divided by their number."""
    replay = bench.graphed(lambda: [f() for f in fns])
    return bench.bench_ms(replay) * 1e3 / len(fns)


def sweep_configs(m: int) -> list[kern.GemmConfig]:
    """BLOCK_M 64 (the table's at decode M; 128-row tiles and grouped row tiles ran no faster in
    this probe's first run), BLOCK_N 64 or 128, split-K reduced by a second kernel or in-kernel
    (fused_reduce), 3 or 6 stages."""
    return [
        kern.GemmConfig(64, bn, split, 1, 4, stages, fused_reduce=fused)
        for bn in (64, 128)
        for split in (1, 2, 4, 8)
        for fused in ((False, True) if split > 1 else (False,))
        for stages in (3, 6)
    ]


def row_for(m: int, n: int, k: int, dev: torch.device, sweep_until: float) -> dict[str, Any]:
    fp8_bytes = n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)
    r = max(2, math.ceil(MIN_BYTES / fp8_bytes))
    ws = [bench.quantised(m, n, k, dev, seed=1000 + i) for i in range(r)]
    x = ws[0]["x"]
    aq, as_col = bench.engine_act(ws[0])
    tiny = torch.zeros(1, device=dev)
    variants: dict[str, list[Callable[[], Any]]] = {
        "empty": [partial(tiny.add_, 0.0) for _ in ws],
        "read_fp8": [partial(torch.amax, d["wq"].view(torch.int32)) for d in ws],
        "read_bf16": [partial(torch.amax, d["w"].view(torch.int32)) for d in ws],
        "bf16": [partial(F.linear, x, d["w"]) for d in ws],
        "fp8_auto": [partial(fl.fp8_gemm_dispatch, aq, as_col, d["wq"], d["ws"], torch.bfloat16) for d in ws],
        "fp8_cublas": [
            partial(ref.fp8_gemm, aq, as_col, d["wq"], d["ws"], torch.bfloat16, "torch") for d in ws
        ],
        "linear_fp8": [partial(fl.fp8_matmul, x, d["wq"], d["ws"], torch.bfloat16) for d in ws],
    }
    row: dict[str, Any] = {
        "M": m,
        "N": n,
        "K": k,
        "weights": r,
        "fp8_bytes": fp8_bytes,
        "bf16_bytes": 2 * n * k,
    }
    row["auto_choice"] = bench.choice_name(fl.auto_choice(m, n, k, dev))
    us: dict[str, float] = {}
    for name, fns in variants.items():
        t, err = bench.attempt(partial(per_call_us, fns))
        if err:
            row.setdefault("errors", {})[name] = err
        else:
            us[name] = t
    row["us"] = us
    gbs = {}
    for name, v in us.items():
        if name != "empty":
            nbytes = row["bf16_bytes"] if name in ("bf16", "read_bf16") else fp8_bytes
            gbs[name] = nbytes / (v * 1e-6) / 1e9
    row["weight_gb_s"] = gbs
    peak = hbm_tb_s()
    if peak is not None:
        row["fraction_of_hbm_peak"] = {name: v / (peak * 1e3) for name, v in gbs.items()}
    if "bf16" in us:
        row["speedup_vs_bf16"] = {
            name: us["bf16"] / us[name]
            for name in ("fp8_auto", "fp8_cublas", "linear_fp8", "read_fp8")
            if name in us
        }
    sweep: dict[str, float] = {}
    for cfg in sweep_configs(m):
        if time.perf_counter() > sweep_until:
            row.setdefault("errors", {})["sweep"] = "stopped: time budget"
            break
        fns = [partial(kern.triton_fp8_gemm, aq, as_col, d["wq"], d["ws"], torch.bfloat16, cfg) for d in ws]
        t, err = bench.attempt(partial(per_call_us, fns))
        if err:
            row.setdefault("errors", {})[cfg.name()] = err
        else:
            sweep[cfg.name()] = t
    if sweep:
        best = min(sweep, key=sweep.__getitem__)
        row["sweep_us"] = sweep
        row["sweep_best"] = {"config": best, "us": sweep[best]}
        if "bf16" in us:
            row["speedup_vs_bf16"]["sweep_best"] = us["bf16"] / sweep[best]
    del ws
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--nk", default=",".join(f"{n}x{k}" for n, k in bench.DENSE_NK))
    p.add_argument("--sweep-budget-s", type=float, default=150.0, help="no config sweep starts after this")
    args = p.parse_args()
    sweep_until = time.perf_counter() + args.sweep_budget_s
    dev = torch.device("cuda")
    result = bench.new_result(
        "bf16 F.linear and a torch reduction over the same weight bytes, same graphs, same process"
    )
    for m in MS:
        for nk in args.nk.split(","):
            n, k = (int(v) for v in nk.split("x"))
            row = row_for(m, n, k, dev, sweep_until)
            print(
                json.dumps(
                    {
                        key: row[key]
                        for key in (
                            "M",
                            "N",
                            "K",
                            "us",
                            "fraction_of_hbm_peak",
                            "speedup_vs_bf16",
                            "sweep_best",
                        )
                        if key in row
                    }
                ),
                flush=True,
            )
            result["rows"].append(row)
            write_result(args.out, result)


if __name__ == "__main__":
    main()
