"""Tune the FP8 block-scaled GEMM dispatch table on one Hopper GPU: for every shape, time
every candidate kernel config as CUDA-graph replays, check it against the dequantised reference,
and write the fastest verified option per (M bucket, N, K) -- one of our Triton configs, cuBLAS
block-wise, or (M > 256, Hopper) our CUDA kernel -- to ops/fp8/fp8_configs.json,
which the engine's "auto" dispatch reads.

    PYTHONPATH=. python3 bench/fp8/tune.py --out $OUT/fp8_tune.json     (~5 minutes on an H200)
    python3 bench/fp8/tune.py --dry-run                                  (CPU: the grid sizes)
    PYTHONPATH=. python3 bench/fp8/tune.py --m 512,1024,2048,4096,8192 --skip-triton --skip-grouped
        (large M only: cuBLAS against the CUDA kernel, no Triton compiles; ~1 minute)

Phases (each bounded by --budget-s, so the run ends in time with whatever it measured):
1. Compile every candidate in parallel worker processes (Triton's on-disk cache then serves the
   main process). A config that fails to compile or launch (e.g. out of shared memory), spills
   registers, or does not finish by the compile deadline (the pool is then terminated) is pruned
   here, before any timing.
2. Dense shapes, M in --m (default 64, 128, 256, 4096, 8192) x (N, K) in bench/fp8/gemm.py's
   DENSE_NK, decode M first: bf16 cuBLAS, cuBLAS block-wise and the activation quantiser as
   baselines; every surviving config screened with a few replays, the fastest few re-timed with
   more; each contender checked against ops/fp8/recipe.py's reference (gemm.py's bounds) on a
   row sample. At M <= 256 the choice is by the whole linear as the engine runs it (quantiser +
   GEMM, or the fused quantise+GEMM kernel of the same config, whose bits must equal the two-kernel
   path: the trainer runs that); at large M by the GEMM (the quantiser is the same for every
   option there), where our CUDA kernel (ops/fp8/cuda/fp8_wgmma.py, default
   variant) is a contender too, checked like the others.
3. Grouped MoE shapes (gemm.py's GROUPED): the grouped kernel's tiles, per rows-per-expert.
4. The table: this run's entries replace the same keys of the existing file, others are kept
   (their `source` says which run measured them); written to --table and to $OUT.

Timing: each replay follows a 256 MB L2 flush (as triton.testing.do_bench does), so weights come
from HBM as in a real decode step; median of the replays; CUDA events around the replay only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F

from bench.kernels import triton_gemm_variants as variants
from bench.results import write_result
from ops.fp8 import recipe as ref
from ops.fp8 import triton_gemm as kern
from ops.fp8.cuda import fp8_wgmma

GemmConfig = variants.VariantConfig  # the product configs and the candidate-only ones
TUNE_M = (64, 128, 256, 4096, 8192)
SMALL_M_MAX = 256  # decode sizes: choose by the whole linear, try the fused quantiser
SMEM_BYTES = 227 * 1024  # Hopper: max dynamic shared memory per block
SCREEN_REPS, FINAL_REPS, TOP = 3, 25, 6
# The compile workers' device: "cuda"; "cpu" only for --smoke (the Triton interpreter, tiny shapes).
DEVICE = os.environ.get("RELAY_TUNE_DEVICE", "cuda")


# ------------------------------------------------------------------ the candidate grid


def smem_estimate(cfg: GemmConfig) -> int:
    """Shared memory of the operand pipeline: num_stages x (A tile + W tile), fp8, BLOCK_K 128."""
    return cfg.num_stages * (cfg.block_m + cfg.block_n) * kern.BLOCK


def dense_grid(m: int, n: int, k: int, sms: int = kern.NUM_SMS_DEFAULT) -> list[GemmConfig]:
    """Candidate configs for one dense shape. Decode M: small BLOCK_M (16/32 mma.sync, 64 wgmma),
    BLOCK_N 64-256, deep pipelines, split-K up to filling ~3 waves of SMs (reduced in-kernel; the
    two-kernel reduction too for one tile shape, to measure which is faster). Large M: the
    persistent TMA kernel with 128x128 .. 256x128 tiles, grouped order, optional warp
    specialisation, and the tiled kernel's large tiles."""
    kb = kern._cdiv(k, kern.BLOCK)
    out: list[GemmConfig] = []
    if m <= SMALL_M_MAX:
        for bm in (16, 32, 64):
            if bm == 16 and m > 128:
                continue  # 16+ row tiles each re-reading the weight from L2
            for bn in (64, 128, 256):
                tiles = kern._cdiv(m, bm) * kern._cdiv(n, bn)
                splits = [1] + [
                    s for s in (2, 4, 8, 16) if kb // s >= 2 and tiles * s <= 3 * sms and tiles < sms
                ]
                for split in splits:
                    reduces = [False] if split == 1 else [True, False] if (bm, bn) == (64, 128) else [True]
                    for fr in reduces:
                        for warps in (4, 8) if bn == 256 else (4,):
                            for st in (4, 5, 6, 3):  # most plausible first (compile order)
                                out.append(GemmConfig(bm, bn, split, 1, warps, st, fused_reduce=fr))
    else:
        for bm, bn in ((128, 128), (128, 256), (256, 128), (64, 256)):
            for st in (4, 3, 5):
                for gm in (8, 16):
                    for ws in (False, True):
                        out.append(GemmConfig(bm, bn, 1, gm, 8, st, kernel="tma", warp_spec=ws))
        out += [
            GemmConfig(128, 128, 1, 8, 4, 4, kernel="tma"),
            GemmConfig(128, 128, 1, 8, 8, 3, kernel="tma", lag=True),
            GemmConfig(128, 128, 1, 8, 8, 4, kernel="tma", lag=True),
            GemmConfig(128, 256, 1, 8, 8, 3, kernel="tma", lag=True),  # may spill: pruned then
            GemmConfig(256, 128, 1, 8, 8, 3, kernel="tma", lag=True),
            GemmConfig(128, 128, 1, 8, 8, 3),
            GemmConfig(128, 128, 1, 8, 8, 4),
            GemmConfig(128, 256, 1, 8, 8, 3),
            GemmConfig(256, 128, 1, 8, 8, 3),
            GemmConfig(64, 256, 1, 8, 8, 4),
            GemmConfig(128, 128, 1, 8, 8, 3, lag=True),
        ]
    out = [c for c in out if smem_estimate(c) <= SMEM_BYTES and variants.supports(c, m, n, k)]
    return list(dict.fromkeys(out))


def fused_ok(cfg: GemmConfig) -> bool:
    """Configs the fused quantise+GEMM kernel is tried with: tiled, one launch (no 2nd kernel)."""
    return cfg.kernel == "tiled" and (cfg.split_k == 1 or cfg.fused_reduce) and not cfg.lag


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def name(self) -> str:
        return f"m{self.block_m}n{self.block_n}_w{self.num_warps}_st{self.num_stages}"


def grouped_grid(t: int, e: int) -> list[GroupedConfig]:
    per = t / max(e, 1)
    bms = (16, 32, 64) if per <= 64 else (32, 64, 128)
    out = []
    for bm in bms:
        for bn in (64, 128, 256):
            for warps in (4, 8) if bm >= 64 or bn == 256 else (4,):
                for st in (4, 3, 5):
                    if st * (bm + bn) * kern.BLOCK <= SMEM_BYTES:
                        out.append(GroupedConfig(bm, bn, warps, st))
    return out


# ------------------------------------------------------------------ phase 1: parallel compile

Task = tuple[str, Any, int, int, int]  # (kind: dense | fused | grouped, config, M or T, N, K) [+E]


def _compiled_kernels(jit_fn: Any) -> dict[Any, Any]:
    """This process's compiled kernels of `jit_fn` by cache key (Triton 3.x keeps them in
    JITFunction.device_caches); {} where that internal layout differs."""
    try:
        return {key: ck for cache in jit_fn.device_caches.values() for key, ck in cache[0].items()}
    except Exception:  # noqa: BLE001 - informational; pruning by spills is then skipped
        return {}


def _compiled_stats(kernels: list[Any]) -> list[dict[str, int]]:
    stats = []
    for ck in kernels:
        try:
            ck._init_handles()
            stats.append({"n_regs": int(ck.n_regs), "n_spills": int(ck.n_spills)})
        except Exception:  # noqa: BLE001 - as above
            continue
    return stats


def _worker_init() -> None:
    if DEVICE == "cuda":
        torch.cuda.init()


def compile_task(task: tuple[str, dict[str, Any], int, int, int, int]) -> dict[str, Any]:
    """In a worker process: build inputs of the task's shape, launch once (compiles, or loads the
    on-disk cache), report success, registers and spills."""
    kind, cfg_d, m, n, k, e = task
    dev = torch.device(DEVICE)
    res: dict[str, Any] = {"ok": False}
    jits = {
        "grouped": kern._grouped_fp8_gemm_kernel,
        "fused": kern._fp8_linear_fused_kernel,
        "dense": (
            variants._fp8_gemm_tma_kernel
            if cfg_d.get("kernel") == "tma"
            else variants._fp8_gemm_lag_kernel
            if cfg_d.get("lag")
            else kern._fp8_gemm_kernel
        ),
    }
    before = set(_compiled_kernels(jits[kind]))  # a worker runs many tasks: only this one's count
    try:
        g = torch.Generator(device=dev).manual_seed(0)
        if kind == "grouped":
            cfg = GroupedConfig(**cfg_d)
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            aq, as_ = kern.triton_quantize_act(x)
            w = torch.randn(e, n, k, device=dev, generator=g).to(torch.bfloat16)
            wq = torch.empty(e, n, k, device=dev, dtype=kern.FP8_DTYPE)
            ws = torch.ones(e, kern._cdiv(n, 128), kern._cdiv(k, 128), device=dev)
            wq.copy_(w.clamp(-448, 448).to(kern.FP8_DTYPE))
            offs = torch.linspace(m // e, m, e, device=dev).to(torch.int32)
            kern.triton_grouped_fp8_gemm(aq, as_, wq, ws, offs, torch.bfloat16, *dataclasses.astuple(cfg))
        else:
            cfg = GemmConfig(**cfg_d)
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            wq, ws = ref.quantize_weight(torch.randn(n, k, device=dev, generator=g) * 0.02)
            if kind == "fused":
                kern.triton_fp8_linear_fused(x, wq, ws, torch.bfloat16, cfg)
            else:
                aq, as_ = kern.triton_quantize_act(x)
                variants.variant_fp8_gemm(aq, as_, wq, ws, torch.bfloat16, cfg)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        new = [ck for key, ck in _compiled_kernels(jits[kind]).items() if key not in before]
        stats = _compiled_stats(new)
        res = {"ok": True, "n_spills": max((s["n_spills"] for s in stats), default=None)}
        res["n_regs"] = max((s["n_regs"] for s in stats), default=None)
    except Exception as ex:  # noqa: BLE001 - the failure is the result
        res["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
    return res


def precompile(
    tasks: list[tuple[str, Any, int, int, int, int]], workers: int, deadline: float
) -> dict[tuple[str, Any], dict[str, Any]]:
    """Run compile_task for every distinct (kind, config) in `workers` spawned processes until
    `deadline`; tasks not done by then (not reached, or a kernel that hangs or kills its worker)
    are reported as skipped and never timed. The pool is terminated at the end, so a hung kernel
    cannot outlive this phase or stall the run."""
    results: dict[tuple[str, Any], dict[str, Any]] = {}
    pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init)
    try:
        pending = {}
        for kind, cfg, m, n, k, e in tasks:
            payload = (kind, dataclasses.asdict(cfg), m, n, k, e)
            pending[(kind, cfg)] = pool.apply_async(compile_task, (payload,))
        while pending and time.perf_counter() < deadline:
            for key in [key for key, r in pending.items() if r.ready()]:
                r = pending.pop(key)
                results[key] = r.get() if r.successful() else {"ok": False, "error": "worker failed"}
            time.sleep(0.05)
        for key in pending:
            results[key] = {"ok": False, "error": "skipped: compile budget"}
    finally:
        pool.terminate()
        pool.join()
    return results


def usable(compiled: dict[tuple[str, Any], dict[str, Any]] | None, key: tuple[str, Any]) -> bool:
    """Compiled without spills. compiled None: the parallel phase failed as a whole, so every
    candidate is tried (compiled on first use, within the time budget)."""
    if compiled is None:
        return True
    res = compiled.get(key)
    return bool(res and res.get("ok") and not res.get("n_spills"))


def smoke(workers: int) -> dict[str, Any]:
    """The compile phase end to end on tiny shapes (spawned workers, pickled tasks, spill stats),
    for CPU tests under the Triton interpreter (RELAY_TUNE_DEVICE=cpu TRITON_INTERPRET=1)."""
    tasks = [
        ("dense", GemmConfig(16, 64, 2, 1, 4, 2, fused_reduce=True), 16, 128, 256, 0),
        ("fused", GemmConfig(16, 64, 1, 1, 4, 2), 16, 128, 256, 0),
        ("dense", GemmConfig(64, 64, 1, 1, 4, 2, kernel="tma"), 16, 128, 256, 0),
        ("grouped", GroupedConfig(16, 64, 4, 2), 32, 128, 256, 4),
        ("dense", GemmConfig(16, 64, 1, 1, 4, 2, kernel="tma"), 16, 128, 200, 0),  # K % 16: refused
    ]
    res = precompile(tasks, workers, time.perf_counter() + 600)
    return {f"{kd} {c.name()}": r for (kd, c), r in res.items()}


# ------------------------------------------------------------------ timing


class Timer:
    """CUDA-graph replays, each after an L2 flush, median of CUDA-event times (microseconds)."""

    def __init__(self, dev: torch.device):
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)

    def replays(self, replay: Callable[[], None], reps: int) -> float:
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
        ]
        for a, b in ev:
            self.flush.zero_()
            a.record()
            replay()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3

    def time(self, fn: Callable[[], Any], reps: int) -> float:
        import gemm as bench  # bench/fp8/gemm.py: the same capture its table is timed with

        return self.replays(bench.graphed(fn), reps)


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - every candidate is isolated; the error is the result
        return None, f"{type(e).__name__}: {str(e)[:200]}"


# ------------------------------------------------------------------ dense shapes


def sample_rows(m: int) -> torch.Tensor:
    """Rows the reference is computed for: all at decode M; the first and last 128 (edge tiles)
    at large M, where the float32 reference of the whole product would take longer than the run."""
    if m <= 256:
        return torch.arange(m)
    return torch.cat([torch.arange(128), torch.arange(m - 128, m)])


def dense_inputs(m: int, n: int, k: int, dev: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """As the engine runs: bf16 activations quantised by the Triton quantiser (column-major
    scales), the weight quantised 128x128 once."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    aq, as_ = kern.triton_quantize_act(x)
    wq, ws = ref.quantize_weight(w)
    return {"x": x, "w": w, "aq": aq, "as": as_, "wq": wq, "ws": ws}


def fp32_output(fn: Callable[[], Any], dev: torch.device) -> tuple[Any, str | None]:
    """The float32-output run for verify, off the GPU only: there the bf16 check cannot run
    (interpreter truncation); on the GPU the bf16 output is checked per element, and a float32
    variant would be one more compile per config in this process."""
    return (None, None) if dev.type == "cuda" else attempt(fn)


def verify(
    out32: torch.Tensor | None,
    out16: torch.Tensor | None,
    rows: Any,
    want: torch.Tensor,
    absref: torch.Tensor,
    kind: str,
) -> dict[str, Any]:
    """gemm.py's self-check bounds on the sampled rows: the float32 output's Frobenius error (the
    kernel's arithmetic) and the bf16 output per element (what the engine gets). The bf16 check
    is skipped off the GPU: the Triton interpreter converts fp32 -> bf16 by truncation."""
    import gemm as bench  # bench/fp8/gemm.py: the self-check's bounds

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t[rows] if isinstance(rows, slice) else t[rows.to(t.device)]

    if out16 is not None and not out16.is_cuda:
        out16 = None
    return bench.accuracy(pick(out32), pick(out16), want, absref, kind)


def tune_dense(
    m: int,
    n: int,
    k: int,
    dev: torch.device,
    timer: Timer,
    compiled: dict[tuple[str, Any], dict[str, Any]] | None,
    deadline: float,
    triton: bool = True,
) -> dict[str, Any]:
    import gemm as bench

    sms = kern.num_sms(dev)
    d = dense_inputs(m, n, k, dev)
    ops = (d["aq"], d["as"], d["wq"], d["ws"])
    row: dict[str, Any] = {"M": m, "N": n, "K": k, "us": {}, "errors": {}, "screen_us": {}}
    base = {
        "bf16": partial(torch.matmul, d["x"], d["w"].t()),
        "torch": partial(ref.fp8_gemm, *ops, torch.bfloat16, "torch"),
        "quant_act": partial(kern.triton_quantize_act, d["x"]),
        "linear_bf16": partial(F.linear, d["x"], d["w"]),
    }
    for name, fn in base.items():
        us, err = attempt(partial(timer.time, fn, FINAL_REPS))
        row["us"][name] = us
        if err:
            row["errors"][name] = err
    # Reference on a row sample (gemm.py's bounds: fp8 wgmma accumulation vs exact float32).
    rows = sample_rows(m)
    ridx = rows.to(dev)
    sub = (d["aq"][ridx], d["as"][ridx], d["wq"], d["ws"])
    want = ref.fp8_gemm_reference(*sub)
    absref = ref.fp8_gemm_reference(bench.fp8_abs(sub[0]), sub[1], bench.fp8_abs(d["wq"]), d["ws"])

    cands = [c for c in dense_grid(m, n, k, sms) if triton and usable(compiled, ("dense", c))]
    row["candidates"] = len(cands)
    screen: list[tuple[float, GemmConfig]] = []
    for cfg in cands:
        if time.perf_counter() > deadline:
            row["errors"]["screen"] = "stopped: time budget"
            break
        us, err = attempt(
            partial(timer.time, partial(variants.variant_fp8_gemm, *ops, torch.bfloat16, cfg), SCREEN_REPS)
        )
        if err:
            row["errors"][cfg.name()] = err
        else:
            row["screen_us"][cfg.name()] = round(us, 2)
            screen.append((us, cfg))
    screen.sort(key=lambda t: t[0])
    # Re-time the fastest few and check them against the reference; fastest verified wins.
    final: list[tuple[float, GemmConfig]] = []
    row["checked"] = {}
    for _, cfg in screen[:TOP]:
        fn = partial(variants.variant_fp8_gemm, *ops, torch.bfloat16, cfg)
        us, err = attempt(partial(timer.time, fn, FINAL_REPS))
        out, err2 = attempt(fn)
        out32, err3 = fp32_output(partial(variants.variant_fp8_gemm, *ops, torch.float32, cfg), dev)
        if err or err2 or err3:
            row["errors"][cfg.name()] = err or err2 or err3
            continue
        acc = verify(out32, out, rows, want, absref, bench.mma_kind(cfg.block_m))
        row["checked"][cfg.name()] = {
            "us": round(us, 2),
            "ok": acc["ok"],
            "rel_err_fp32": acc.get("rel_err_fp32"),
            "rel_err_bf16": acc.get("rel_err_bf16"),
        }
        if acc["ok"]:
            final.append((us, cfg))
    out_t, err = attempt(base["torch"])
    # cuBLAS may refuse a float32 output for block-wise scaling: its bf16 output decides.
    torch_ok = err is None and verify(None, out_t, rows, want, absref, "wgmma")["ok"]
    row["torch_ok"] = torch_ok
    final.sort(key=lambda t: t[0])
    if final:
        row["us"]["best_triton"] = final[0][0]
        row["best_triton"] = final[0][1].name()
    options: list[tuple[float, str, GemmConfig | None, str]] = []  # (us, what, config, linear)
    if m <= SMALL_M_MAX:
        options = linear_options(row, d, final, torch_ok, timer, deadline, compiled)
    else:
        if torch_ok and row["us"].get("torch") is not None:
            options.append((row["us"]["torch"], "torch", None, "separate"))
        cuda_us = cuda_option(row, ops, rows, want, absref, timer)
        if cuda_us is not None:
            options.append((cuda_us, "cuda", None, "separate"))
        # The table holds product configs only: a candidate-only variant is timed, not chosen.
        options += [(us, "triton", cfg, "separate") for us, cfg in final if cfg.product() is not None]
    if not options:
        row["errors"]["choice"] = "no verified option"
        return row
    us, what, cfg, linear = min(options, key=lambda t: t[0])
    row["choice"] = {
        "choice": what,
        "config": None if cfg is None else dataclasses.asdict(cfg.product()),  # type: ignore[arg-type]
        "linear": linear,
    }
    gemm_us = row["us"][what] if what in ("torch", "cuda") else dict((c, u) for u, c in final)[cfg]  # type: ignore[index]
    row["us"]["chosen_gemm"] = gemm_us
    row["us"]["chosen_linear" if m <= SMALL_M_MAX else "chosen"] = us
    bf = row["us"].get("bf16")
    row["speedup_gemm_vs_bf16"] = None if not bf or not gemm_us else bf / gemm_us
    if m <= SMALL_M_MAX and row["us"].get("linear_bf16"):
        row["speedup_linear_vs_bf16"] = row["us"]["linear_bf16"] / us
    return row


def cuda_option(
    row: dict[str, Any],
    ops: tuple[torch.Tensor, ...],
    rows: Any,
    want: torch.Tensor,
    absref: torch.Tensor,
    timer: Timer,
) -> float | None:
    """Our CUDA kernel's time for this shape, when it runs here and its bf16 output passes the same
    check as cuBLAS's; else None, with the reason in row["errors"]["cuda"]."""
    reason = fp8_wgmma.unsupported_reason(ops[0], ops[2])
    if reason is not None:
        row["errors"]["cuda"] = reason
        return None
    fn = partial(fp8_wgmma.fp8_gemm, *ops)
    out, err = attempt(fn)  # the first call builds the library (nvcc, cached)
    us, err2 = (None, None) if err else attempt(partial(timer.time, fn, FINAL_REPS))
    if err or err2:
        row["errors"]["cuda"] = err or err2
        return None
    row["us"]["cuda"] = us
    row["cuda_ok"] = verify(None, out, rows, want, absref, "wgmma")["ok"]
    return us if row["cuda_ok"] else None


def linear_options(
    row: dict[str, Any],
    d: dict[str, torch.Tensor],
    final: list[tuple[float, GemmConfig]],
    torch_ok: bool,
    timer: Timer,
    deadline: float,
    compiled: dict[tuple[str, Any], dict[str, Any]] | None = None,
) -> list[tuple[float, str, GemmConfig | None, str]]:
    """Decode M: the whole linear as the engine runs it, for cuBLAS and each verified config:
    quantiser + GEMM, and (tiled, one-launch configs) the fused kernel -- used only if its bits
    equal the two-kernel path's (the trainer computes that)."""
    x, wq, ws = d["x"], d["wq"], d["ws"]

    def separate(cfg: GemmConfig | None) -> torch.Tensor:
        q, s = kern.triton_quantize_act(x)
        if cfg is None:
            return ref.fp8_gemm(q, s, wq, ws, torch.bfloat16, "torch")
        return variants.variant_fp8_gemm(q, s, wq, ws, torch.bfloat16, cfg)

    opts: list[tuple[float, str, GemmConfig | None, str]] = []
    lin: dict[str, Any] = {}
    row["linear_us"] = lin
    if torch_ok:
        us, err = attempt(partial(timer.time, partial(separate, None), FINAL_REPS))
        if us is not None:
            opts.append((us, "torch", None, "separate"))
            lin["torch"] = round(us, 2)
    for _, cfg in final:
        if time.perf_counter() > deadline:
            break
        us, err = attempt(partial(timer.time, partial(separate, cfg), FINAL_REPS))
        if us is not None:
            opts.append((us, "triton", cfg, "separate"))
            lin[cfg.name()] = round(us, 2)
        if not fused_ok(cfg) or not usable(compiled, ("fused", cfg)):
            continue  # (a fused kernel that failed or spilled in the compile phase: not retried)
        fused = partial(kern.triton_fp8_linear_fused, x, wq, ws, torch.bfloat16, cfg)
        us_f, err = attempt(partial(timer.time, fused, FINAL_REPS))
        got, err2 = attempt(fused)
        two, err3 = attempt(partial(separate, cfg))
        equal = got is not None and two is not None and bool(torch.equal(got, two))
        lin[f"fused {cfg.name()}"] = {"us": None if us_f is None else round(us_f, 2), "bits_equal": equal}
        if err or err2 or err3:
            row["errors"][f"fused {cfg.name()}"] = err or err2 or err3
        if us_f is not None and equal:
            opts.append((us_f, "triton", cfg, "fused"))
    return opts


# ------------------------------------------------------------------ grouped


def tune_grouped(
    case: tuple[str, int, int, int, int],
    dev: torch.device,
    timer: Timer,
    compiled: dict[tuple[str, Any], dict[str, Any]] | None,
    deadline: float,
) -> dict[str, Any]:
    import gemm as bench

    name, e, t, n, k = case
    gi = bench.grouped_inputs(e, t, n, k, dev)
    a, a_s = kern.triton_quantize_act(gi["x"])
    ops = (a, a_s, gi["wq"], gi["ws"], gi["offs"], torch.bfloat16)
    row: dict[str, Any] = {
        "case": name,
        "E": e,
        "T": t,
        "N": n,
        "K": k,
        "us": {},
        "errors": {},
        "screen_us": {},
    }
    if hasattr(torch, "_grouped_mm"):
        fn = partial(torch._grouped_mm, gi["x"], gi["w"].transpose(-2, -1), offs=gi["offs"])
        row["us"]["bf16_grouped_mm"], err = attempt(partial(timer.time, fn, FINAL_REPS))
        if err:
            row["errors"]["bf16_grouped_mm"] = err
    # Reference for two experts' rows (the largest and the last non-empty): cheap at any T.
    sizes = gi["sizes"]
    bounds = [0, *torch.as_tensor(sizes).cumsum(0).tolist()]
    nonempty = [i for i, s in enumerate(sizes) if s > 0]
    experts = sorted({max(nonempty, key=lambda i: sizes[i]), nonempty[-1]})
    checks = []
    for ex in experts:
        r0, r1 = bounds[ex], bounds[ex + 1]
        sub = (a[r0:r1], a_s[r0:r1], gi["wq"][ex], gi["ws"][ex])
        want = ref.fp8_gemm_reference(*sub)
        absref = ref.fp8_gemm_reference(bench.fp8_abs(sub[0]), sub[1], bench.fp8_abs(sub[2]), sub[3])
        checks.append((r0, r1, want, absref))
    screen = []
    for cfg in grouped_grid(t, e):
        if not usable(compiled, ("grouped", cfg)):
            continue
        if time.perf_counter() > deadline:
            row["errors"]["screen"] = "stopped: time budget"
            break
        fn = partial(kern.triton_grouped_fp8_gemm, *ops, *dataclasses.astuple(cfg))
        us, err = attempt(partial(timer.time, fn, SCREEN_REPS))
        if err:
            row["errors"][cfg.name()] = err
            continue
        row["screen_us"][cfg.name()] = round(us, 2)
        screen.append((us, cfg))
    screen.sort(key=lambda x: x[0])
    final = []
    for _, cfg in screen[:TOP]:
        fn = partial(kern.triton_grouped_fp8_gemm, *ops, *dataclasses.astuple(cfg))
        us, err = attempt(partial(timer.time, fn, FINAL_REPS))
        out, err2 = attempt(fn)
        ops32 = (*ops[:-1], torch.float32)
        out32, err3 = fp32_output(
            partial(kern.triton_grouped_fp8_gemm, *ops32, *dataclasses.astuple(cfg)), dev
        )
        if us is None or out is None or err3:
            row["errors"][cfg.name()] = err or err2 or err3
            continue
        kind = bench.mma_kind(cfg.block_m)
        ok = all(
            verify(out32, out, slice(r0, r1), want, absref, kind)["ok"] for r0, r1, want, absref in checks
        )
        if ok:
            final.append((us, cfg))
    if final:
        us, cfg = min(final, key=lambda x: x[0])
        row["choice"] = dataclasses.asdict(cfg)
        row["us"]["chosen"] = us
        bf = row["us"].get("bf16_grouped_mm")
        row["speedup_vs_bf16_grouped_mm"] = None if not bf else bf / us
    else:
        row["errors"]["choice"] = "no verified config"
    return row


# ------------------------------------------------------------------ the table


def merge_table(
    old: kern.Fp8Table, dense: list[dict[str, Any]], grouped: list[dict[str, Any]], source: str
) -> kern.Fp8Table:
    """This run's winners replace the same (M bucket, N, K) / (rows per expert, N, K) keys of
    `old`; the rest of `old` is kept."""
    entries = {(e.m, e.n, e.k): e for e in old.dense}
    for r in dense:
        c = r.get("choice")
        if not c:
            continue
        cfg = None if c["config"] is None else kern.TableConfig(**c["config"])
        us = {key: round(v, 2) for key, v in r["us"].items() if v is not None}
        entries[(r["M"], r["N"], r["K"])] = kern.DenseEntry(
            m=r["M"],
            n=r["N"],
            k=r["K"],
            choice=c["choice"],
            config=cfg,
            linear=c["linear"],
            fused_config=cfg if c["linear"] == "fused" else None,
            us=us,
            source=source,
        )
    groups = {(round(g.rows_per_expert, 3), g.n, g.k): g for g in old.grouped}
    for r in grouped:
        c = r.get("choice")
        if not c:
            continue
        per = r["T"] / r["E"]
        us = {key: round(v, 2) for key, v in r["us"].items() if v is not None}
        groups[(round(per, 3), r["N"], r["K"])] = kern.GroupedEntry(
            rows_per_expert=per, e=r["E"], t=r["T"], n=r["N"], k=r["K"], **c, us=us, source=source
        )
    dense_sorted = sorted(entries.values(), key=lambda e: (e.n, e.k, e.m))
    buckets = sorted({e.m for e in dense_sorted})
    return kern.Fp8Table(
        m_buckets=buckets,
        dense=dense_sorted,
        grouped=sorted(groups.values(), key=lambda g: (g.n, g.k, g.rows_per_expert)),
        notes=old.notes or "Written by bench/fp8/tune.py; see docs/fp8.md.",
    )


def keep_triton_entries(
    old: kern.Fp8Table, dense: list[dict[str, Any]], errors: list[str]
) -> list[dict[str, Any]]:
    """--skip-triton timed no Triton config, so it cannot say one lost: rows whose key the table
    gives to Triton are left out of the merge (and named in `errors`)."""
    triton_keys = {(e.m, e.n, e.k) for e in old.dense if e.choice == "triton"}
    errors += [
        f"dense {r['M']}x{r['N']}x{r['K']}: the table's Triton entry kept (--skip-triton)"
        for r in dense
        if (r["M"], r["N"], r["K"]) in triton_keys
    ]
    return [r for r in dense if (r["M"], r["N"], r["K"]) not in triton_keys]


def write_table(table: kern.Fp8Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.model_dump(), indent=1) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------ main


def build_tasks(
    ms: list[int], grouped: bool, nks: list[tuple[int, int]] | None = None
) -> list[tuple[str, Any, int, int, int, int]]:
    """One compile task per distinct (kind, config), at the first shape that uses it. The kernels
    do not specialise on the K-block count (do_not_specialize), and every tuned M, N, K is a
    multiple of 16, so one compile serves every shape. The kinds (decode GEMM, fused linear,
    large-M GEMM, grouped) are interleaved, each in its grid's order (most plausible first), so a
    compile budget that runs out trims every kind a little rather than dropping the last one."""
    import gemm as bench

    seen: set[tuple[str, Any]] = set()
    queues: dict[str, list[tuple[str, Any, int, int, int, int]]] = {
        "small": [],
        "fused": [],
        "large": [],
        "grouped": [],
    }
    for m in sorted(ms):
        for n, k in nks or bench.DENSE_NK:
            for cfg in dense_grid(m, n, k):
                for kind in ("dense", "fused") if m <= SMALL_M_MAX and fused_ok(cfg) else ("dense",):
                    if (kind, cfg) not in seen:
                        seen.add((kind, cfg))
                        queue = "fused" if kind == "fused" else "small" if m <= SMALL_M_MAX else "large"
                        queues[queue].append((kind, cfg, m, n, k, 0))
    if grouped:
        for _, e, t, n, k in bench.GROUPED:
            for gcfg in grouped_grid(t, e):
                if ("grouped", gcfg) not in seen:
                    seen.add(("grouped", gcfg))
                    queues["grouped"].append(("grouped", gcfg, min(t, 1024), n, k, e))
    # Round robin weighted by queue length: each kind's i-th task lands at the same fraction.
    keyed = [((i + 0.5) / len(q), name, task) for name, q in queues.items() for i, task in enumerate(q)]
    return [task for _, _, task in sorted(keyed, key=lambda t: (t[0], t[1]))]


def parse_nk(text: str) -> list[tuple[int, int]] | None:
    """Parse "4096x1024,1024x2048" into [(4096, 1024), (1024, 2048)]; "" gives None (gemm.py's shapes)."""
    out = []
    for item in filter(None, text.split(",")):
        n, sep, k = item.partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise SystemExit(f"--nk: {item!r} is not NxK")
        out.append((int(n), int(k)))
    return out or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fp8_tune.json", help="full results (every timing)")
    ap.add_argument("--table", default=str(kern.TABLE_PATH), help="table file to update")
    ap.add_argument("--copy-table", default=None, help="also write the table here (default: beside --out)")
    ap.add_argument("--budget-s", type=float, default=285.0, help="whole run, seconds")
    ap.add_argument("--compile-share", type=float, default=0.4, help="share of the budget for compiling")
    ap.add_argument("--m", default=",".join(map(str, TUNE_M)), help="M values to tune (comma list)")
    ap.add_argument(
        "--nk",
        default="",
        help="(N, K) shapes to tune as NxK comma list (default gemm.py's DeepSeek-V3 shapes); e.g. "
        "Qwen3-0.6B's fused decode linears: 4096x1024,1024x2048,6144x1024,1024x3072",
    )
    ap.add_argument("--workers", type=int, default=0, help="compile processes (0: CPU count - 1)")
    ap.add_argument("--skip-grouped", action="store_true")
    ap.add_argument(
        "--skip-triton",
        action="store_true",
        help="large M only: time cuBLAS and the CUDA kernel, compile no Triton config (keeps the "
        "table's Triton entries: a key whose entry chose Triton is not replaced)",
    )
    ap.add_argument("--keep-affinity", action="store_true", help="do not widen the CPU affinity")
    ap.add_argument("--dry-run", action="store_true", help="print the grid sizes and exit (CPU)")
    ap.add_argument("--smoke", action="store_true", help="compile phase on tiny shapes (tests)")
    args = ap.parse_args()
    if args.smoke:
        print(json.dumps(smoke(args.workers or 2)))
        return
    ms = [int(v) for v in args.m.split(",") if v]
    if args.skip_triton and min(ms) <= SMALL_M_MAX:
        ap.error(f"--skip-triton is for M > {SMALL_M_MAX} (decode M picks among Triton configs)")
    nks = parse_nk(args.nk)
    tasks = [] if args.skip_triton else build_tasks(ms, not args.skip_grouped, nks)
    if args.dry_run:
        import gemm as bench

        per_shape = {f"{m}x{n}x{k}": len(dense_grid(m, n, k)) for m in ms for n, k in nks or bench.DENSE_NK}
        kinds = {kd: sum(1 for t in tasks if t[0] == kd) for kd in ("dense", "fused", "grouped")}
        print(
            json.dumps(
                {"compile_tasks": len(tasks), "by_kind": kinds, "dense_per_shape": per_shape}, indent=1
            )
        )
        return
    if not torch.cuda.is_available():
        sys.exit("bench/fp8/tune.py needs a CUDA GPU (Hopper); --dry-run works on CPU")
    import gemm as bench

    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    if not args.keep_affinity and hasattr(os, "sched_setaffinity"):
        # device_call.sh pins benchmarks to 2 cores; compiling ~600 kernels wants all of them.
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference needs exact float32 products
    workers = args.workers or max(1, min(len(os.sched_getaffinity(0)) - 1, 31))
    result: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(),
        "machine": bench.machine(),
        "budget_s": args.budget_s,
        "workers": workers,
        "errors": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        write_result(out, result, default=str)

    compile_deadline = t0 + args.budget_s * args.compile_share
    compiled: dict[tuple[str, Any], dict[str, Any]] | None = {}
    try:
        if tasks:
            compiled = precompile(tasks, workers, compile_deadline)
    except Exception:  # noqa: BLE001 - then compile lazily in this process, within the budget
        result["errors"].append(f"precompile: {traceback.format_exc()[-1500:]}")
        compiled = None
    result["compile"] = (
        {}
        if compiled is None
        else {
            "tasks": len(tasks),
            "ok": sum(1 for r in compiled.values() if r.get("ok")),
            "spilled": sum(1 for r in compiled.values() if r.get("ok") and r.get("n_spills")),
            "failed": {
                f"{kd} {c.name()}": r.get("error") for (kd, c), r in compiled.items() if not r.get("ok")
            },
            "spills": {
                f"{kd} {c.name()}": r.get("n_spills") for (kd, c), r in compiled.items() if r.get("n_spills")
            },
            "seconds": round(time.perf_counter() - t0, 1),
        }
    )
    print(
        f"compile phase: {json.dumps({k: v for k, v in result['compile'].items() if k in ('ok', 'seconds')})}"
        f" of {len(tasks)} tasks",
        flush=True,
    )
    save()
    timer = Timer(dev)
    dense_rows: list[dict[str, Any]] = []
    result["dense"] = dense_rows
    grouped_reserve = 0.0 if args.skip_grouped else 0.1 * args.budget_s
    for m in sorted(ms):
        for n, k in nks or bench.DENSE_NK:
            if time.perf_counter() > deadline - grouped_reserve:
                result["errors"].append(f"dense {m}x{n}x{k}: skipped, time budget")
                continue
            try:
                row = tune_dense(
                    m, n, k, dev, timer, compiled, deadline - grouped_reserve, not args.skip_triton
                )
            except Exception:  # noqa: BLE001 - keep the other shapes
                result["errors"].append(f"dense {m}x{n}x{k}: {traceback.format_exc()[-1500:]}")
                continue
            dense_rows.append(row)
            c = row.get("choice") or {}
            what = c.get("choice")
            if what == "triton":
                what = GemmConfig(**c["config"]).name() + (" +fused quant" if c["linear"] == "fused" else "")
            print(
                f"M={m:5d} N={n:5d} K={k:5d} | {len(row.get('screen_us', {}))} timed | choice {what} | "
                f"gemm x bf16 {row.get('speedup_gemm_vs_bf16') or 0:.2f}"
                + (
                    f", linear x bf16 {row['speedup_linear_vs_bf16']:.2f}"
                    if "speedup_linear_vs_bf16" in row
                    else ""
                ),
                flush=True,
            )
            save()
    grouped_rows: list[dict[str, Any]] = []
    result["grouped"] = grouped_rows
    if not args.skip_grouped:
        for case in bench.GROUPED:
            if time.perf_counter() > deadline:
                result["errors"].append(f"grouped {case[0]}: skipped, time budget")
                continue
            try:
                grow = tune_grouped(case, dev, timer, compiled, deadline)
            except Exception:  # noqa: BLE001
                result["errors"].append(f"grouped {case[0]}: {traceback.format_exc()[-1500:]}")
                continue
            grouped_rows.append(grow)
            print(
                f"grouped {case[0]:16s} | choice {grow.get('choice')} | x bf16 grouped_mm "
                f"{grow.get('speedup_vs_bf16_grouped_mm') or 0:.2f}",
                flush=True,
            )
            save()
    source = f"bench/fp8/tune.py {result['date'][:16]} on {result['machine'].get('gpu')}"
    old = kern.load_table(args.table)
    if args.skip_triton:
        dense_rows = keep_triton_entries(old, dense_rows, result["errors"])
    table = merge_table(old, dense_rows, grouped_rows, source)
    write_table(table, Path(args.table))
    copy = Path(args.copy_table) if args.copy_table else out.with_name("fp8_configs.json")
    if copy.resolve() != Path(args.table).resolve():
        write_table(table, copy)
    result["table"] = {"path": args.table, "copy": str(copy), "dense_entries": len(table.dense)}
    save()
    print(f"wrote {out} and the table {args.table} (+ {copy}) in {result['elapsed_s']} s", flush=True)


if __name__ == "__main__":
    main()
