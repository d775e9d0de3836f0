"""One launch of each given wgmma_lib variant and of torch's block-wise scaled_mm (cuBLAS), for
Nsight Compute to profile (bench/fp8/wgmma_ncu.sh): the inputs are quantised first, so only the
GEMMs match the profiler's kernel filter.

    ncu ... python3 bench/fp8/wgmma_profile.py --variants 1,3,5 --m 4096 --n 4096 --k 7168
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import wgmma_lib  # noqa: E402

from services.common import fp8 as ref  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="1")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=7168)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.m, args.k, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(args.n, args.k, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    aq, a_s = ref.quantize_act(x)
    a_s = ref._outer_major(a_s)
    wq, w_s = ref.quantize_weight(w)
    wgmma_lib.library()
    torch.cuda.synchronize()
    for v in (int(s) for s in args.variants.split(",")):
        wgmma_lib.fp8_gemm(aq, a_s, wq, w_s, variant=v)
    ref.fp8_gemm(aq, a_s, wq, w_s, torch.bfloat16, backend="torch")
    torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
