"""One launch of each given configuration of bench/kernels/fp8_wgmma_variants.cu and of torch's block-wise scaled_mm (cuBLAS), for
Nsight Compute to profile (bench/fp8/wgmma_ncu.sh): the inputs are quantised first, so only the
GEMMs match the profiler's kernel filter.

    ncu ... python3 bench/fp8/wgmma_profile.py --variants 0,1,2 --m 4096 --n 4096 --k 7168
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma import quantised  # noqa: E402

from bench.kernels import fp8_wgmma_variants as variants  # noqa: E402
from ops.fp8 import recipe as ref  # noqa: E402
from ops.fp8.cuda import fp8_wgmma  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="0", help="indices into fp8_wgmma_variants.cu's table")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    args = ap.parse_args()
    dev = torch.device("cuda")
    d = quantised(args.m, args.n, args.k, dev, seed=0)
    aq, a_s, wq, w_s = d["aq"], d["as_col"], d["wq"], d["ws"]
    lib = variants.library()
    torch.cuda.synchronize()
    for v in (int(s) for s in args.variants.split(",")):
        fp8_wgmma.fp8_gemm(aq, a_s, wq, d["ws_col"], variant=v, lib=lib)
    ref.fp8_gemm(aq, a_s, wq, w_s, torch.bfloat16, backend="torch")
    torch.nn.functional.linear(d["x"], d["w"])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
