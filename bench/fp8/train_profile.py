"""Where the trainer's FP8 linear (trainer/fp8.py, `fp8_all`: FP8 forward, dgrad and wgrad) spends
a training step's time, next to bf16 F.linear, at a few of train_linear.py's shapes:

  host_ms   Python + launch time to enqueue one forward + backward (the GPU queue not full)
  host_ms_through_ops   the same with the FP8 step forced through its custom ops (what it runs
            under torch.compile or selective AC; eager calls the ops' bodies)
  wall_ms   forward + backward back to back, synchronised at the end (what train_linear.py sees)
  gpu_ms    the sum of the step's GPU kernel times (torch.profiler), i.e. the time if the host
            kept up; wall_ms well above it means the host is what limits the step
  kernels   each kernel's GPU time per step, largest first
  host_top  the host functions with the most own time (cProfile), per step
  pieces    host time per call of each piece of the FP8 step (10 calls, then one synchronise:
            the GPU queue never fills, so this is the host's own cost), and of the custom ops
            next to their Python bodies called directly (what torch.library adds)
  cpu_ops   the aten ops' own CPU time per step (torch.profiler), largest first
  stages    host time per step inside each stage of the FP8 step, from timing wrappers around
            trainer/fp8.py's calls (no profiler: its own overhead blurs the host picture)

    python3 bench/fp8/train_profile.py --out $OUT/fp8_train_profile.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gemm as bench  # noqa: E402

from bench.results import write_result
from ops.fp8 import recipe as ref  # noqa: E402
from ops.fp8.dispatch import (  # noqa: E402
    fp8_gemm_dispatch,
    quantize_activation,
    quantize_activation_both,
    quantize_activation_t,
    quantize_weight_fast,
)
from trainer.fp8 import fp8_linear, fp8_linear_bwd, fp8_linear_fwd  # noqa: E402

SHAPES = [(8192, 7168, 2048), (16384, 3072, 1024)]
STEPS = 20


def step_fn(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, fp8: bool) -> Callable[[], None]:
    def step() -> None:
        x.grad = w.grad = None
        out = fp8_linear(x, w, None, False, "auto", True, True) if fp8 else F.linear(x, w)
        out.backward(grad)

    return step


def kernel_times(step: Callable[[], None], steps: int = 5) -> tuple[float, list[tuple[str, int, float]]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name].append(ev.device_time_total)
    rows = sorted(
        ((name[:90], len(v) // steps, sum(v) / steps / 1e3) for name, v in per.items()),
        key=lambda r: -r[2],
    )
    return sum(r[2] for r in rows), rows


def host_us(fn: Callable[[], Any], calls: int = 10) -> float:
    return bench.host_and_wall_ms(fn, calls)[0] * 1e3


def pieces(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    xd, wd, bf = x.detach(), w.detach(), torch.bfloat16
    wq, ws, wq_t = quantize_weight_fast(wd, False, True)
    xq, xs = quantize_activation(xd)
    gq, gs = quantize_activation(grad)
    xq_t, xs_t = quantize_activation_both(xd)[1]
    gq_t, gs_t = quantize_activation_both(grad)[1]
    assert wq_t is not None
    fwd_body = getattr(fp8_linear_fwd, "_init_fn", None)
    bwd_body = getattr(fp8_linear_bwd, "_init_fn", None)
    saved = fp8_linear_fwd(xd, wd, False, "auto", True, True, bf)[1:]
    out: dict[str, float] = {
        "torch.empty": host_us(lambda: torch.empty(16, device=x.device)),
        "F.linear": host_us(lambda: F.linear(xd, wd)),
        "quantize_weight_fast(transposed)": host_us(lambda: quantize_weight_fast(wd, False, True)),
        "quantize_activation": host_us(lambda: quantize_activation(xd)),
        "quantize_activation_t": host_us(lambda: quantize_activation_t(xd)),
        "quantize_activation_both": host_us(lambda: quantize_activation_both(xd)),
        "gemm fwd (auto)": host_us(lambda: fp8_gemm_dispatch(xq, xs, wq, ws, bf)),
        "gemm dgrad (auto)": host_us(lambda: fp8_gemm_dispatch(gq, gs, wq_t, ws.t(), bf)),
        "gemm wgrad (tokens, torch)": host_us(
            lambda: ref.fp8_gemm_tokens(gq_t, gs_t, xq_t, xs_t, bf, "torch")
        ),
        "fp8_linear_fwd (custom op)": host_us(lambda: fp8_linear_fwd(xd, wd, False, "auto", True, True, bf)),
        "fp8_linear_bwd (custom op)": host_us(
            lambda: fp8_linear_bwd(grad, *saved, False, "auto", True, True, bf)  # type: ignore[misc]
        ),
    }
    from ops.fp8.cuda import fp8_wgmma

    lib, index = fp8_wgmma.library(), x.device.index or 0
    out["current_stream().cuda_stream"] = host_us(
        lambda: torch.cuda.current_stream(x.device).cuda_stream, 100
    )
    out["_cuda_getCurrentRawStream"] = host_us(lambda: torch._C._cuda_getCurrentRawStream(index), 100)
    out["ctypes call, refused variant"] = host_us(
        lambda: lib.relay_fp8_gemm(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -1, 0), 100
    )
    if fwd_body is not None and bwd_body is not None:
        out["fp8_linear_fwd (body)"] = host_us(lambda: fwd_body(xd, wd, False, "auto", True, True, bf))
        out["fp8_linear_bwd (body)"] = host_us(lambda: bwd_body(grad, *saved, False, "auto", True, True, bf))
    return out


def cpu_ops(step: Callable[[], None], steps: int = 5, top: int = 30) -> list[tuple[str, int, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count // steps, e.self_cpu_time_total / steps) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[2])[:top]


def stages(step: Callable[[], None], steps: int = 30) -> dict[str, float]:
    """Host microseconds per step spent inside each wrapped stage (nested stages count in both)."""
    import trainer.fp8 as tf
    from ops.fp8.cuda import fp8_wgmma

    spent: dict[str, float] = defaultdict(float)
    patched: list[tuple[Any, str, Any]] = []

    def wrap(module: Any, name: str) -> None:
        fn = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t

        patched.append((module, name, fn))
        setattr(module, name, timed)

    for name in (
        "_fp8_linear_fwd",
        "_fp8_linear_bwd",
        "quantize_weight_fast",
        "quantize_activation_both",
        "fp8_gemm_dispatch",
        "fp8_gemm_tokens",
    ):
        wrap(tf, name)
    wrap(fp8_wgmma, "_launch")
    try:
        step()
        torch.cuda.synchronize()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for module, name, fn in patched:
            setattr(module, name, fn)
    return {"step": total / steps * 1e6} | {k: v / steps * 1e6 for k, v in spent.items()}


def profile_row(m: int, n: int, k: int, fp8: bool) -> dict[str, Any]:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16)
    step = step_fn(x, w, grad, fp8)
    for _ in range(5):
        step()
    host_ms, wall_ms = bench.host_and_wall_ms(step, STEPS)
    through_ops = None
    if fp8:
        import trainer.fp8 as tf

        direct = tf._through_op
        tf._through_op = lambda: True
        try:
            through_ops = bench.host_and_wall_ms(step, STEPS)[0]
        finally:
            tf._through_op = direct
    gpu_ms, kernels = kernel_times(step)
    return {
        "M": m,
        "N": n,
        "K": k,
        "variant": "fp8_all" if fp8 else "bf16",
        "host_ms": host_ms,
        "wall_ms": wall_ms,
        "host_ms_through_ops": through_ops,
        "gpu_ms": gpu_ms,
        "kernels": kernels,
        "host_top": bench.host_top(step) if fp8 else [],
        "pieces": pieces(x, w, grad) if fp8 else {},
        "cpu_ops": cpu_ops(step) if fp8 else [],
        "stages": stages(step) if fp8 else {},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = bench.new_result("bf16 F.linear forward + backward (cuBLAS), same process")
    for m, n, k in SHAPES:
        for fp8 in (False, True):
            row = profile_row(m, n, k, fp8)
            result["rows"].append(row)
            print(
                f"M={m} N={n} K={k} {row['variant']:8s} host={row['host_ms']:.3f} ms "
                f"wall={row['wall_ms']:.3f} ms gpu={row['gpu_ms']:.3f} ms "
                f"host_through_ops={row['host_ms_through_ops']}",
                flush=True,
            )
            for name, count, ms in row["kernels"][:12]:
                print(f"    gpu {ms * 1e3:8.1f} us x{count} {name}")
            for name, count, ms in row["host_top"][:15]:
                print(f"    host {ms * 1e3:8.1f} us x{count} {name}")
            for name, us in row["pieces"].items():
                print(f"    piece {us:8.1f} us {name}")
            for name, us in row["stages"].items():
                print(f"    stage {us:8.1f} us {name}")
            for name, count, us in row["cpu_ops"][:20]:
                print(f"    cpu_op {us:8.1f} us x{count} {name}")
            write_result(args.out, result)


if __name__ == "__main__":
    main()
