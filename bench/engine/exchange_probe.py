"""What one all-to-all exchange costs in a persistent kernel, and whether self-validating data beats
a grid barrier (the batch-1 kernel's layer is six such exchanges).

A chain of E exchanges among P resident programs: in exchange e every program reads the whole
vector the previous exchange wrote (N values), averages it, and writes its own N / P values of
the next one (the mean plus a ramp). So each exchange is a true all-to-all dependency, as between two GEMV phases of a
layer, with no weights. Two ways to exchange, timed in one process (rounds alternating):

- `barrier`: plain stores, a grid barrier (an atomic counter: release add, acquire polling, as
  kernels/megakernel.py does), then the loads of the vector (.cg);
- `epoch`: no barrier; every value is stored as a 64-bit word (its float32 bits, and the exchange
  number in the high half), and a reader reloads the vector until every word carries the
  exchange it waits for. One store and one load round trip, no atomics, no fence: a word is valid
  by itself.

Checked against the same chain in float64 on the host (the sums differ in order only).

    python3 bench/engine/exchange_probe.py --out $OUT/exchange_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench.results
from bench.results import write_result  # noqa: E402


@triton.jit
def _barrier_chain(buf_ptr, bar_ptr, E, N: tl.constexpr, R: tl.constexpr, P: tl.constexpr):
    """buf: [E + 1, N] float32; row 0 is the input. Exchange e reads row e, writes row e + 1."""
    pid = tl.program_id(0)
    offs = tl.arange(0, N)
    mine = pid * R + tl.arange(0, R)
    for e in range(E):
        x = tl.load(buf_ptr + e * N + offs, cache_modifier=".cg")
        s = tl.sum(x, 0) / N
        tl.store(buf_ptr + (e + 1) * N + mine, s + mine.to(tl.float32) * 1e-6)
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        while seen < (e + 1) * P:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def _epoch_chain(buf_ptr, E, N: tl.constexpr, R: tl.constexpr):
    """buf: [E + 1, N] int64 words (float32 bits | exchange << 32); row 0 is the input (epoch 0).
    Exchange e waits until every word of row e carries epoch e, then writes row e + 1."""
    pid = tl.program_id(0)
    offs = tl.arange(0, N)
    mine = pid * R + tl.arange(0, R)
    for e in range(E):
        w = tl.load(buf_ptr + e * N + offs, volatile=True)
        ready = tl.min(((w >> 32) == e).to(tl.int32), 0)
        while ready == 0:
            w = tl.load(buf_ptr + e * N + offs, volatile=True)
            ready = tl.min(((w >> 32) == e).to(tl.int32), 0)
        x = (w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        s = tl.sum(x, 0) / N
        y = s + mine.to(tl.float32) * 1e-6
        word = y.to(tl.uint32, bitcast=True).to(tl.int64) | ((e + 1).to(tl.int64) << 32)
        tl.store(buf_ptr + (e + 1) * N + mine, word)


def reference(x0: torch.Tensor, exchanges: int, r: int) -> torch.Tensor:
    n = x0.numel()
    x = x0.double()
    ramp = torch.arange(n, dtype=torch.float64) * 1e-6
    for _ in range(exchanges):
        x = x.mean() + ramp
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--exchanges", type=int, default=168)  # 28 layers x 6
    ap.add_argument("--programs", type=int, default=128)
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--launches", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from bench.engine.megakernel_probe import time_us
    from bench.engine.w1 import profile_setup

    cuda, device, _, _, report = profile_setup(False, "the barrier exchange (same process)")
    if not cuda:
        print("exchange_probe needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    p, e = args.programs, args.exchanges
    report.update({"programs": p, "exchanges": e})
    results: dict[str, Any] = {}
    for n in (int(v) for v in args.sizes.split(",")):
        r = n // p
        x0 = torch.randn(n, generator=torch.Generator().manual_seed(n))
        ref = reference(x0, e, r)
        fbuf = torch.zeros(e + 1, n, dtype=torch.float32, device=device)
        wbuf = torch.zeros(e + 1, n, dtype=torch.int64, device=device)
        bar = torch.zeros(1, dtype=torch.int32, device=device)
        words0 = x0.view(torch.int32).to(torch.int64) & 0xFFFFFFFF

        def run_barrier(fbuf: torch.Tensor = fbuf, bar: torch.Tensor = bar, x0: torch.Tensor = x0,
                        n: int = n, r: int = r) -> None:  # fmt: skip
            fbuf[0].copy_(x0)
            bar.zero_()
            _barrier_chain[(p,)](fbuf, bar, e, N=n, R=r, P=p, num_warps=4)

        def run_epoch(
            wbuf: torch.Tensor = wbuf, words0: torch.Tensor = words0, n: int = n, r: int = r
        ) -> None:
            wbuf.fill_(-1 << 32)  # epoch -1: nothing written yet
            wbuf[0].copy_(words0)
            _epoch_chain[(p,)](wbuf, e, N=n, R=r, num_warps=4)

        row: dict[str, Any] = {}
        for name, fn in (("barrier", run_barrier), ("epoch", run_epoch)):
            fn()
            torch.cuda.synchronize()
            last = (
                fbuf[e] if name == "barrier" else (wbuf[e] & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
            )
            got = last.double().cpu()
            err = float((got - ref).abs().max() / ref.abs().max())
            row[name] = {"max_err_over_max": err, "ok": err < 1e-4, "us": []}
        for _ in range(args.rounds):
            for name, fn in (("barrier", run_barrier), ("epoch", run_epoch)):
                row[name]["us"].append(round(time_us(fn, args.launches), 2))
        for v in row.values():
            v["median_us"] = statistics.median(v["us"])
            v["us_per_exchange"] = round(v["median_us"] / e, 3)
        results[f"N={n}"] = row
        print(n, json.dumps(row))
    report["sizes"] = results
    write_result(args.out, report)


if __name__ == "__main__":
    main()
