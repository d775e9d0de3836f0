"""Where does the block-scaled FP8 GEMM lose to cuBLAS at large M? Variants of one Triton kernel
(TMA loads, grouped tile order, one output tile per program), timed as CUDA-graph replays at
DeepSeek-V3 shapes against bf16 cuBLAS and torch's block-wise scaled_mm, each checked against the
float32 reference of the recipe:

  plain     acc = dot(a, w, acc): no scales at all (not the recipe: the ceiling Triton reaches)
  vector    acc += dot(a, w) * a_s[:, None] * w_s[None, :] (w_s read per column: the kernel in
            ops/fp8/triton_gemm.py)
  scalar    acc += dot(a, w) * (a_s * w_s)[:, None], w_s one value per 128-column tile
  unroll2   two K blocks per iteration: both dots issued, then both promotions

    python3 bench/fp8/kernel_probe.py --out $OUT/fp8_kernel_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.results import write_result
from ops.fp8 import recipe as ref  # noqa: E402

SHAPES = [(4096, 4096, 7168), (4096, 7168, 2048), (8192, 18432, 7168)]
# (mode, BLOCK_M, BLOCK_N, num_warps, num_stages)
VARIANTS = [
    ("plain", 128, 256, 8, 4),
    ("plain", 128, 128, 8, 4),
    ("vector", 128, 128, 8, 3),
    ("vector", 64, 256, 8, 3),
    ("scalar", 128, 128, 8, 3),
    ("scalar", 128, 128, 8, 4),
    ("scalar", 64, 128, 4, 4),
    ("scalar", 128, 128, 4, 3),
    ("unroll2", 128, 128, 8, 2),
    ("unroll2", 64, 128, 4, 2),
]
MODES = {"plain": 0, "vector": 1, "scalar": 2, "unroll2": 3}


@triton.jit
def _probe_kernel(
    a_desc,
    w_desc,
    as_ptr,
    ws_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_ask,
    stride_wsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,
):
    BK: tl.constexpr = 128
    GROUP_M: tl.constexpr = 8
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % size_m)
    pid_n = (pid % (GROUP_M * num_pid_n)) // size_m
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    k_tiles = K // BK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MODE == 0:
        for kb in range(k_tiles):
            acc = tl.dot(a_desc.load([off_m, kb * BK]), w_desc.load([off_n, kb * BK]).T, acc)
    elif MODE == 1:
        for kb in range(k_tiles):
            a_s = tl.load(as_ptr + rm + kb * stride_ask)
            w_s = tl.load(ws_ptr + (rn // BK) * stride_wsn + kb)
            d = tl.dot(a_desc.load([off_m, kb * BK]), w_desc.load([off_n, kb * BK]).T)
            acc += d * a_s[:, None] * w_s[None, :]
    elif MODE == 2:
        for kb in range(k_tiles):
            a_s = tl.load(as_ptr + rm + kb * stride_ask)
            w_s = tl.load(ws_ptr + pid_n * stride_wsn + kb)
            d = tl.dot(a_desc.load([off_m, kb * BK]), w_desc.load([off_n, kb * BK]).T)
            acc += d * (a_s * w_s)[:, None]
    else:
        for kb in range(0, k_tiles, 2):
            s0 = tl.load(as_ptr + rm + kb * stride_ask) * tl.load(ws_ptr + pid_n * stride_wsn + kb)
            s1 = tl.load(as_ptr + rm + (kb + 1) * stride_ask) * tl.load(ws_ptr + pid_n * stride_wsn + kb + 1)
            d0 = tl.dot(a_desc.load([off_m, kb * BK]), w_desc.load([off_n, kb * BK]).T)
            d1 = tl.dot(a_desc.load([off_m, (kb + 1) * BK]), w_desc.load([off_n, (kb + 1) * BK]).T)
            acc += d0 * s0[:, None] + d1 * s1[:, None]
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def launch(variant, a, a_s, w, w_s, out):  # noqa: ANN001, ANN201 - bench script
    mode, bm, bn, warps, stages = variant
    m, k = a.shape
    n = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [bm, 128])
    w_desc = TensorDescriptor.from_tensor(w, [bn, 128])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    return lambda: _probe_kernel[grid](
        a_desc, w_desc, a_s, w_s, out, m, n, k, a_s.stride(1), w_s.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, MODE=MODES[mode], num_warps=warps, num_stages=stages,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        wt = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        aq, a_s_row = ref.quantize_act(x)
        a_s = a_s_row.t().contiguous().t()  # column-major: one K block's M scales contiguous
        wq, w_s = ref.quantize_weight(wt)
        flops = 2 * m * n * k
        expect = ref.fp8_gemm_reference(aq[:256], a_s_row[:256], wq, w_s, torch.float32)
        row: dict[str, object] = {"M": m, "N": n, "K": k}
        t = triton.testing.do_bench_cudagraph(lambda x=x, wt=wt: torch.nn.functional.linear(x, wt))
        row["bf16_us"] = t * 1000
        try:
            t = triton.testing.do_bench_cudagraph(
                lambda aq=aq, a_s=a_s, wq=wq, w_s=w_s: ref.fp8_gemm(
                    aq, a_s, wq, w_s, torch.bfloat16, backend="torch"
                )
            )
            row["torch_blockwise_us"] = t * 1000
        except Exception as e:  # noqa: BLE001 - record and go on
            row["torch_blockwise_error"] = repr(e)[:300]
        for variant in VARIANTS:
            name = "%s_m%dn%d_w%d_st%d" % variant  # noqa: UP031
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            try:
                fn = launch(variant, aq, a_s, wq, w_s, out)
                fn()
                torch.cuda.synchronize()
                err = ((out[:256].float() - expect).norm() / expect.norm()).item()
                t = triton.testing.do_bench_cudagraph(fn)
                row[name] = {"us": t * 1000, "tflops": flops / t / 1e9, "rel_err_vs_recipe": err}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": repr(e)[:300]}
            print(name, row[name], flush=True)
        for key in ("bf16_us", "torch_blockwise_us"):
            if key in row:
                row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6  # type: ignore[operator]
        print(json.dumps({kk: v for kk, v in row.items() if not isinstance(v, dict)}), flush=True)
        rows.append(row)
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": torch.cuda.get_device_name(),
        "baseline": "bf16 cuBLAS (F.linear) and torch block-wise scaled_mm, same process",
        "rows": rows,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
