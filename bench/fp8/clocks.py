"""SM clock and board power while bf16 and FP8 GEMMs run back to back, in one process: is the
FP8/bf16 speed ratio held below 2x by the chip's clock under the 700 W power limit?

The FP8 tensor cores do twice bf16's work per clock, so the best ratio of the two GEMMs' speeds is
2 x (FP8 clock / bf16 clock) x (FP8 efficiency / bf16 efficiency). Nsight Compute saw the SM clock
at 1.55-1.6 GHz under FP8 load on an H200 against a 1.98 GHz maximum; this
measures both clocks the same way, without a profiler: each GEMM is replayed from a CUDA graph for
`--seconds` while `nvidia-smi` samples the SM clock and power every 50 ms, and the samples of the
steady middle of each window are summarised (median, 10th and 90th percentiles).

GEMMs (M = 8192, N, K = 7168, 7168 by default): bf16 cuBLAS (F.linear), cuBLAS block-wise FP8
(torch's scaled_mm, the engine's large-M path) and relay's CUDA kernel (the product's library).
The bf16 GEMM runs first and last, so a drift of the chip's temperature over the run shows as a
difference between its two windows.

    python3 bench/fp8/clocks.py --out $OUT/fp8_clocks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.results import write_result  # noqa: E402

SMI_FIELDS = "clocks.sm,power.draw,temperature.gpu"
REPS = 20  # GEMM calls per graph replay


def parse_samples(text: str) -> list[tuple[float, float, float]]:
    """`nvidia-smi --format=csv,noheader,nounits` lines of SMI_FIELDS -> (MHz, W, C) tuples;
    lines that are not three numbers (a "[N/A]" field, a partial last line) are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            out.append((float(parts[0]), float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return out


def summarise(samples: list[tuple[float, float, float]], trim: float = 0.2) -> dict[str, Any]:
    """Median and 10th/90th percentiles of the clock and power over the middle of a window (the
    first and last `trim` of the samples dropped: ramp-up and the sampler's start and stop)."""
    n = len(samples)
    cut = int(n * trim)
    kept = samples[cut : n - cut] if n - 2 * cut >= 3 else samples
    if not kept:
        return {"samples": 0}

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]

    clocks = [s[0] for s in kept]
    power = [s[1] for s in kept]
    return {
        "samples": len(kept),
        "sm_mhz_median": statistics.median(clocks),
        "sm_mhz_p10": pct(clocks, 0.1),
        "sm_mhz_p90": pct(clocks, 0.9),
        "power_w_median": statistics.median(power),
        "power_w_p90": pct(power, 0.9),
        "temp_c_max": max(s[2] for s in kept),
    }


def window(name: str, replay: Callable[[], None], reps: int, flops: float, seconds: float) -> dict[str, Any]:
    """Run `replay` (a CUDA graph of `reps` calls of one GEMM) for `seconds` under an nvidia-smi
    sampler; TFLOP/s over the window."""
    torch.cuda.synchronize()
    sampler = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            replay()
            calls += reps
            if calls % (reps * 10) == 0:
                torch.cuda.synchronize()  # keep the host from queueing far ahead of the GPU
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    finally:
        sampler.terminate()
        out, _ = sampler.communicate(timeout=10)
    row = {"gemm": name, "seconds": elapsed, "calls": calls, "tflops": flops * calls / elapsed / 1e12}
    row.update(summarise(parse_samples(out)))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    # Here, not at the top: the sample parsing above is tested on CPU without Triton imported.
    import gemm as bench
    from wgmma import quantised

    from ops.fp8 import recipe as ref
    from ops.fp8.cuda import fp8_wgmma

    dev = torch.device("cuda")
    d = quantised(args.m, args.n, args.k, dev, seed=0)
    out = torch.empty(args.m, args.n, device=dev, dtype=torch.bfloat16)
    fp8_wgmma.build()
    flops = 2.0 * args.m * args.n * args.k
    gemms: list[tuple[str, Callable[[], Any]]] = [
        ("bf16", lambda: torch.nn.functional.linear(d["x"], d["w"])),
        ("cublas_blockwise_fp8", lambda: ref.fp8_gemm(d["aq"], d["as_col"], d["wq"], d["ws"], torch.bfloat16, backend="torch")),
        ("relay_wgmma_fp8", lambda: fp8_wgmma.fp8_gemm(d["aq"], d["as_col"], d["wq"], d["ws_col"], out=out)),
        ("bf16_again", lambda: torch.nn.functional.linear(d["x"], d["w"])),
    ]  # fmt: skip
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": torch.cuda.get_device_name(),
        "baseline": "bf16 cuBLAS (F.linear) windows before and after the FP8 ones, same process",
        "shape": {"M": args.m, "N": args.n, "K": args.k},
        "relay_variant": "the product's (fp8_wgmma.DENSE)",
        "smi_max": subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.max.sm,power.limit", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip(),
        "windows": [window(name, bench.graphed(fn, REPS), REPS, flops, args.seconds) for name, fn in gemms],
    }
    by = {w["gemm"]: w for w in result["windows"]}
    bf16 = by["bf16"]
    for name in ("cublas_blockwise_fp8", "relay_wgmma_fp8"):
        w = by[name]
        if "sm_mhz_median" in w and "sm_mhz_median" in bf16:
            clock_ratio = w["sm_mhz_median"] / bf16["sm_mhz_median"]
            # The speed ratio the clocks allow at equal efficiency (FP8 does 2x the work a clock).
            w["clock_vs_bf16"] = clock_ratio
            w["speed_vs_bf16"] = w["tflops"] / bf16["tflops"]
            w["speed_vs_bf16_at_bf16_clock"] = w["speed_vs_bf16"] / clock_ratio
            w["ceiling_vs_bf16_at_these_clocks"] = 2.0 * clock_ratio
    write_result(args.out, result)
    for w in result["windows"]:
        print(
            f"{w['gemm']:22s} {w['tflops']:6.0f} TFLOP/s  SM {w.get('sm_mhz_median', 0):5.0f} MHz "
            f"(p10 {w.get('sm_mhz_p10', 0):.0f}, p90 {w.get('sm_mhz_p90', 0):.0f})  "
            f"{w.get('power_w_median', 0):4.0f} W  max {w.get('temp_c_max', 0):.0f} C"
        )


if __name__ == "__main__":
    main()
