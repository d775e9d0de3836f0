"""The one-pass quantiser of x and x^T (ops/fp8/triton_quant.triton_quantize_act_both) against the two
passes it replaces (triton_quantize_act + triton_quantize_act_t, the baseline, same process), at
num_warps 4, 8 and 16, with its outputs checked bit for bit across the settings.

    python3 bench/fp8/quant_warps_probe.py --out $OUT/fp8_quant_warps.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gemm as bench  # noqa: E402

from bench.results import write_result
from ops.fp8.triton_gemm import triton_quantize_act  # noqa: E402
from ops.fp8.triton_quant import triton_quantize_act_both, triton_quantize_act_t  # noqa: E402

SHAPES = [(8192, 2048), (8192, 7168), (16384, 1024), (16384, 9728), (8192, 18432)]


def same(a: Any, b: Any) -> bool:
    """Bits of fp8 tensors, values (IEEE equality) of float32 scales, whatever their strides."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.element_size() == 1 else t

    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = bench.new_result("triton_quantize_act + triton_quantize_act_t (two passes), same process")
    for m, c in SHAPES:
        x = torch.randn(m, c, device="cuda").to(torch.bfloat16)
        sep = (triton_quantize_act(x), triton_quantize_act_t(x, scale_layout="col"))
        row: dict[str, Any] = {"M": m, "C": c, "us": {}, "bits_equal_two_passes": {}}
        row["us"]["two_passes"] = (
            bench.bench_ms(lambda x=x: (triton_quantize_act(x), triton_quantize_act_t(x))) * 1e3
        )
        for nw in (4, 8, 16):
            (q, s), (qt, st) = triton_quantize_act_both(x, num_warps=nw)
            row["bits_equal_two_passes"][nw] = same((q, qt), (sep[0][0], sep[1][0])) and same(
                (s, st), (sep[0][1], sep[1][1])
            )
            row["us"][f"one_pass_w{nw}"] = (
                bench.bench_ms(lambda x=x, nw=nw: triton_quantize_act_both(x, num_warps=nw)) * 1e3
            )
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
