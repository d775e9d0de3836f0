"""Causal attention forward + backward on one H200, every backend that runs (trainer MFU).

    python3 bench/trainer/attn.py --out $OUT/attn.json          # ~1-2 min

At 16k tokens attention is ~60% of the trainer step's counted FLOPs, so its kernel decides the
MFU. Cases (bf16, head_dim 128): T = 16,384 as one causal document, and a pack of 8 documents
of 2,048 (block-diagonal causal); shapes Qwen3-0.6B (16 q heads, 8 kv heads) and Qwen3-4B
(32 q, 8 kv). Backends:

  sdpa/<cudnn|flash|efficient>/<gqa|expand>  F.scaled_dot_product_attention with exactly that
        SDPBackend allowed (sdpa_kernel([b])); gqa = enable_gqa=True on the 8 kv heads, expand =
        kv heads repeated to the q heads first (the copy and its backward are timed too). A
        pack needs a [T, T] mask (/mask) unless the documents run one SDPA each (/doc_loop).
  sdpa/trainer  the trainer's own module today (trainer.attention.DocumentAttention with the
        default trainer.* knobs): which kernel it really launches is read from the profiler.
  varlen        torch.nn.attention.varlen.varlen_attn over cumulative lengths (the trainer's
        `attention = "varlen"` call, GQA native).
  flex          FlexAttention, torch.compile'd (default mode unless --flex-autotune), causal or
        document BlockMask, enable_gqa (the block mask's build time is reported separately).

Per backend and case: forward ms, forward+backward ms (median of --iters after --warmup, CUDA
events), TFLOP/s with the MFU convention of bench/trainer/step.py (causal forward = 2*H*D*sum(len^2),
forward+backward = 3x that), the fraction of the H200's 989 TFLOP/s dense bf16 peak, peak memory,
and the CUDA kernels one forward+backward launched (names, so "which backend did it hit" is a
fact). Correctness first on a small size (T = 512 in 3 documents): output and dq/dk/dv against
a float32 math reference with the kv heads expanded. A backend that refuses a case (an SDPA
backend without GQA, a kernel this torch lacks) is recorded with its error; the rest goes on.

`baseline` in the JSON names what the trainer runs today for each case (attention "sdpa", the
default: one document = sdpa/trainer; a pack = the dense mask through the same module).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import profile_step  # noqa: E402  (the kernel attribution)
import step  # noqa: E402  (installs the carried wheels on the GPU machine, puts the repo on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from bench.results import write_result
from trainer.attention import (  # noqa: E402
    DocumentAttention,
    _varlen_causal_kwargs,
    flex_block_mask,
    varlen_metadata,
)
from trainer.packing import block_causal_mask  # noqa: E402

PEAK = step.PEAK
SHAPES = {"0.6b": (16, 8, 128), "4b": (32, 8, 128)}  # (q heads, kv heads, head dim)
SDPA = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
Attn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------ the backends


def _expand(k: torch.Tensor, v: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    rep = h // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def sdpa_fn(backend: SDPBackend, gqa: bool, lens: list[int], mode: str) -> Attn:
    """mode: "causal" (one document), "mask" (dense block-causal mask), "doc_loop" (one causal
    SDPA per document, outputs concatenated)."""

    masks: list[torch.Tensor] = []  # built once, as the trainer shares one over all layers

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not gqa:
            k, v = _expand(k, v, q.shape[1])
        with sdpa_kernel([backend]):
            if mode == "causal":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            if mode == "mask":
                if not masks:
                    masks.append(block_causal_mask(lens, q.device))
                return F.scaled_dot_product_attention(q, k, v, attn_mask=masks[0], enable_gqa=gqa)
            outs, s = [], 0
            for n in lens:
                sl = slice(s, s + n)
                outs.append(
                    F.scaled_dot_product_attention(
                        q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, enable_gqa=gqa
                    )
                )
                s += n
            return torch.cat(outs, dim=2)

    return fn


def trainer_fn(lens: list[int]) -> Attn:
    """The trainer's module as configured by default (attention "sdpa", sdpa_backend "auto"):
    a one-document pack runs its plain causal path, a pack its dense mask (as
    micro_batch_attention sets it)."""
    mod = DocumentAttention("sdpa")
    masks: list[torch.Tensor] = []  # built once per micro-batch in the trainer, not per layer

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if len(lens) > 1 and not masks:
            masks.append(block_causal_mask(lens, q.device))
        mod.mask = masks[0] if masks else None
        try:
            return mod(q, k, v, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1])  # type: ignore[no-any-return]
        finally:
            mod.mask = None

    return fn


def varlen_fn(lens: list[int], device: torch.device) -> Attn:
    from torch.nn.attention.varlen import varlen_attn

    cu, max_len = varlen_metadata(lens, device)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, t, d = q.shape
        out = varlen_attn(
            q.transpose(1, 2).flatten(0, 1),
            k.transpose(1, 2).flatten(0, 1),
            v.transpose(1, 2).flatten(0, 1),
            cu,
            cu,
            max_len,
            max_len,
            **_varlen_causal_kwargs(h != k.shape[1]),
        )
        return out.view(b, t, h, d).transpose(1, 2)

    return fn


_FLEX: dict[bool, Any] = {}


def flex_fn(lens: list[int], device: torch.device, autotune: bool) -> tuple[Attn, float]:
    from torch.nn.attention.flex_attention import flex_attention

    if autotune not in _FLEX:
        opts = {"max_autotune": True, "coordinate_descent_tuning": True, "triton.cudagraphs": False}
        _FLEX[autotune] = (
            torch.compile(flex_attention, options=opts) if autotune else torch.compile(flex_attention)
        )
    compiled = _FLEX[autotune]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    block_mask = flex_block_mask(lens, device)  # the trainer's (causal within each document)
    torch.cuda.synchronize()
    mask_s = time.perf_counter() - t0

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])  # type: ignore[no-any-return]

    return fn, mask_s


def backends(lens: list[int], device: torch.device, autotune: bool) -> dict[str, Callable[[], Attn]]:
    """name -> a builder (lazy: flex compiles and masks cost time and memory only when run)."""
    out: dict[str, Callable[[], Attn]] = {"sdpa/trainer": lambda: trainer_fn(lens)}
    modes = ["causal"] if len(lens) == 1 else ["mask", "doc_loop"]
    for mode in modes:
        for name, b in SDPA.items():
            for gqa in (True, False):
                key = f"sdpa/{name}/{'gqa' if gqa else 'expand'}" + ("" if mode == "causal" else f"/{mode}")
                out[key] = lambda b=b, gqa=gqa, mode=mode: sdpa_fn(b, gqa, lens, mode)
    out["varlen"] = lambda: varlen_fn(lens, device)
    out["flex"] = lambda: flex_fn(lens, device, autotune)[0]
    return out


# ------------------------------------------------------------------ measuring


def causal_flops(h: int, d: int, lens: list[int]) -> float:
    """Forward FLOPs of causal attention, as bench/trainer/step.py's MFU counts them."""
    return 2.0 * h * d * sum(x * x for x in lens)


def inputs(
    h: int, kv: int, d: int, t: int, dtype: torch.dtype, device: torch.device, seed: int
) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, h, t, d, generator=g, device=device, dtype=dtype)
    k = torch.randn(1, kv, t, d, generator=g, device=device, dtype=dtype)
    v = torch.randn(1, kv, t, d, generator=g, device=device, dtype=dtype)
    return [x.requires_grad_(True) for x in (q, k, v)]


def cuda_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def kernels_of(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """CUDA kernels one call launched (name, count, total us, profile_step's category), longest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    agg: dict[str, list[Any]] = {}
    for k in profile_step.kernels_from_trace(profile_step.trace_events(prof), cuda=True):
        a = agg.setdefault(k.name, [0, 0.0, profile_step.classify(k.name, k.stack)])
        a[0] += 1
        a[1] += k.dur
    rows = [
        {"kernel": k[:200], "calls": c, "us": round(us, 1), "category": cat}
        for k, (c, us, cat) in agg.items()
    ]
    return sorted(rows, key=lambda r: -r["us"])[:8]


def measure(fn: Attn, qkv: list[torch.Tensor], flops_fwd: float, warmup: int, iters: int) -> dict[str, Any]:
    q, k, v = qkv
    dout = torch.randn_like(q)

    def fwd() -> None:
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd() -> None:
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    torch.cuda.reset_peak_memory_stats()
    fwd_ms = cuda_ms(fwd, warmup, iters)
    fb_ms = cuda_ms(fwd_bwd, warmup, iters)
    total = 3.0 * flops_fwd
    return {
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": fb_ms,
        "bwd_ms": fb_ms - fwd_ms,
        "fwd_tflops": flops_fwd / fwd_ms / 1e9,
        "fwd_bwd_tflops": total / fb_ms / 1e9,
        "fwd_bwd_frac_of_peak": total / (fb_ms * 1e-3) / PEAK,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "kernels": kernels_of(fwd_bwd),
    }


def reference(qkv: list[torch.Tensor], lens: list[int], dout: torch.Tensor) -> list[torch.Tensor]:
    """float32 math attention with the dense block-causal mask and expanded kv: out, dq, dk, dv."""
    q, k, v = (x.detach().float().requires_grad_(True) for x in qkv)
    ke, ve = _expand(k, v, q.shape[1])
    mask = block_causal_mask(lens, q.device)
    s = (q @ ke.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    out = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ ve
    return [out, *torch.autograd.grad(out, (q, k, v), dout.float())]


def correctness(device: torch.device, autotune: bool) -> dict[str, Any]:
    """T = 512 in 3 documents (and as one document), 0.6B heads: every backend vs float32."""
    res: dict[str, Any] = {}
    for case, lens in {"one_doc": [512], "packed": [200, 57, 255]}.items():
        qkv = inputs(16, 8, 128, sum(lens), torch.bfloat16, device, seed=1)
        dout = torch.randn_like(qkv[0])
        ref = reference(qkv, lens, dout)
        for name, build in backends(lens, device, autotune).items():
            try:
                out = build()(*qkv)
                got = [out, *torch.autograd.grad(out, qkv, dout)]
                errs = {
                    n: float((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-6))
                    for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True)
                }
                res[f"{case}/{name}"] = {"max_rel_err": errs, "agrees": max(errs.values()) < 2e-2}
            except Exception as e:  # a backend that refuses this case
                res[f"{case}/{name}"] = {"error": repr(e)[:500]}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "attn.json"))
    p.add_argument("--shapes", default="0.6b,4b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--docs", type=int, default=8, help="documents of the packed case (equal lengths)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--flex-autotune", action="store_true", help="compile flex as the trainer does (slow)")
    p.add_argument("--only", default="", help="comma list of backend names (default: all)")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip what is left once this is spent")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attn.py measures CUDA kernels: run it on the GPU machine")
    device = torch.device("cuda")
    t0 = time.monotonic()
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": step.machine(),
        "peak_tflops": PEAK / 1e12,
        "method": (
            "median CUDA-event time of --iters calls after --warmup; TFLOP/s: causal forward "
            "2*H*D*sum(len^2), forward+backward 3x that (step.py's MFU convention)"
        ),
        "baseline": {
            "one_doc": "sdpa/trainer (DocumentAttention, trainer.attention='sdpa', sdpa_backend='auto': "
            "torchtitan's priority cuDNN, flash, math; enable_gqa=True)",
            "packed": "sdpa/trainer (the dense [T, T] block-causal mask through the same module, "
            "torch's default SDPA priority)",
        },
        "torch_backend_flags": {
            "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
            "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn_version": torch.backends.cudnn.version(),
        },
        "results": {},
    }

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, report)

    try:
        report["correctness"] = correctness(device, args.flex_autotune)
    except Exception as e:
        report["correctness"] = {"error": repr(e), "trace": traceback.format_exc()[-2000:]}
    save()
    only = {x for x in args.only.split(",") if x}
    cases = {"one_doc": [args.tokens], "packed": [args.tokens // args.docs] * args.docs}
    for shape in [s for s in args.shapes.split(",") if s]:
        h, kv, d = SHAPES[shape]
        for case, lens in cases.items():
            qkv = inputs(h, kv, d, sum(lens), torch.bfloat16, device, seed=0)
            flops = causal_flops(h, d, lens)
            for name, build in backends(lens, device, args.flex_autotune).items():
                if only and name not in only:
                    continue
                key = f"{shape}/{case}/{name}"
                if time.monotonic() - t0 > args.budget_s:
                    report["results"][key] = {"skipped": f"time budget {args.budget_s}s spent"}
                    continue
                t = time.monotonic()
                try:
                    r = measure(build(), qkv, flops, args.warmup, args.iters)
                    if name == "flex":
                        r["block_mask_build_s"] = flex_fn(lens, device, args.flex_autotune)[1]
                except Exception as e:  # refused (no GQA, a mask it cannot take, OOM...)
                    r = {"error": repr(e)[:800]}
                r["wall_s"] = time.monotonic() - t
                report["results"][key] = r
                torch.cuda.empty_cache()
                brief = {k: round(r[k], 3) for k in ("fwd_ms", "fwd_bwd_ms", "fwd_bwd_tflops") if k in r}
                top = r.get("kernels", [{}])[0].get("kernel", r.get("error", ""))[:90]
                print(f"[{time.monotonic() - t0:5.0f}s] {key}: {brief} {top}", flush=True)
                save()
            del qkv
    # The best forward+backward per shape and case, next to what the trainer runs today.
    best: dict[str, Any] = {}
    for key, r in report["results"].items():
        shape, case, name = key.split("/", 2)
        if "fwd_bwd_ms" not in r:
            continue
        cur = best.get(f"{shape}/{case}")
        if cur is None or r["fwd_bwd_ms"] < cur["fwd_bwd_ms"]:
            best[f"{shape}/{case}"] = {
                "backend": name,
                "fwd_bwd_ms": r["fwd_bwd_ms"],
                "tflops": r["fwd_bwd_tflops"],
            }
    for sc, b in best.items():
        base = report["results"].get(f"{sc}/sdpa/trainer", {})
        b["trainer_today_ms"] = base.get("fwd_bwd_ms")
        b["trainer_today_kernel"] = (base.get("kernels") or [{}])[0].get("kernel")
    report["best"] = best
    report["total_s"] = time.monotonic() - t0
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
