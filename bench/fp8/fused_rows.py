"""FP8 q/k/v and gate/up as one linear (services/engine/layers/fp8.fuse_fp8_rows) on the GPU:
bit-equality with the separate linears, and the time of both as CUDA-graph replays, at Qwen3-0.6B's
widths (dim 1024: q 2048 + k 1024 + v 1024, gate 3072 + up 3072) and the engine's decode and
prefill M. bf16 F.linear of the fused weight is timed alongside as the baseline.

    python3 bench/fp8/fused_rows.py --out $OUT/fp8_fused_rows.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.results import write_result
from services.engine.layers.fp8 import Fp8Linear, fuse_fp8_rows  # noqa: E402

GROUPS = {"qkv": (1024, (2048, 1024, 1024)), "gate_up": (1024, (3072, 3072))}
MS = (1, 8, 64, 256, 4096)


def graph_us(fn: object, reps: int = 50) -> float:
    """Median of `reps` CUDA-graph replays of fn() (each replay timed with events)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()  # type: ignore[operator]
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    ok = True
    for name, (k, ns) in GROUPS.items():
        lins = [nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16) for n in ns]
        parts = [Fp8Linear.from_linear(lin) for lin in lins]
        bf16_w = torch.cat([lin.weight for lin in lins])
        for m in MS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            separate = torch.cat([p(x) for p in parts], dim=-1)
            fused = fuse_fp8_rows(parts)  # parts become views of the fused buffers: same bits
            assert fused is not None
            same = torch.equal(fused(x), separate)
            ok &= same
            row = {
                "group": name,
                "M": m,
                "N": sum(ns),
                "K": k,
                "bit_equal": same,
                "fused_us": graph_us(lambda fused=fused, x=x: fused(x)),
                "separate_us": graph_us(lambda x=x, ps=parts: [p(x) for p in ps]),
                "bf16_us": graph_us(lambda x=x, w=bf16_w: torch.nn.functional.linear(x, w)),
            }
            row["fused_vs_separate"] = row["separate_us"] / row["fused_us"]
            row["fused_vs_bf16"] = row["bf16_us"] / row["fused_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            parts = [Fp8Linear.from_linear(lin) for lin in lins]  # fresh, unfused, for the next M
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": torch.cuda.get_device_name(),
        "baseline": "the separate FP8 linears and bf16 F.linear of the fused weight, same process",
        "ok": ok,
        "rows": rows,
    }
    write_result(args.out, result)
    print("ok" if ok else "MISMATCH")


if __name__ == "__main__":
    main()
