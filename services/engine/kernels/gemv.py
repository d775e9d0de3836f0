"""Decode-sized GEMMs (M <= 8 rows) as a Triton GEMV, where it beats cuBLAS.

At batch 1 the decode step is a chain of small GEMMs whose weights are read once each. cuBLAS
picks poor kernels for some of these shapes on the H200 (bench/engine/results/profile_batch1_h200.json:
Qwen3-0.6B's o_proj, N=1024 x K=2048, runs in 12.4 us as 16 CTAs of 8x64 tiles, 12.6x the time to
read its 4 MB; the fused qkv / gate_up GEMMs take 2-4x their read time). This kernel tiles the
weight over N only (each program owns BLOCK_N output columns for all M rows and walks the whole
K), so even N = 1024 fills the GPU with 128-256 programs, and every weight byte is read once, in
the order it lies in memory (K contiguous). No split-K: the result does not depend on the launch
and needs no second pass.

`decode_linear` chooses per (N, K, M bucket) on its first call outside CUDA-graph capture (the
decode graphs' warm-up forward): it times the best of a few GEMV configurations against F.linear
with CUDA events and keeps the faster, so it can only make a shape faster. During capture, or on
CPU, or for bigger M, it is F.linear.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.engine.kernels import pdl
from services.engine.kernels.fused_norm import PendingNorm, add_rms_norm, silu_mul

log = logging.getLogger(__name__)

MAX_M = 8  # rows up to which the GEMV is considered (decode batches; beyond, cuBLAS tiles well)
# (BLOCK_N, BLOCK_K, num_warps), each timed per shape at warm-up (a few ms each).
# Wide BLOCK_K: a program issues all its loads at once (K <= BLOCK_K: one iteration), which is what
# a latency-bound GEMV needs; narrow BLOCK_N: enough programs for N = 1024.
CONFIGS = (
    (4, 512, 4),
    (8, 512, 4),
    (16, 256, 4),
    (16, 512, 8),
    (2, 1024, 4),
    (4, 1024, 4),
    (8, 1024, 8),
    (2, 2048, 8),
    (4, 2048, 8),
)


# What the GEMV reads as its input x (PROLOGUE): the decode step's elementwise kernels folded in,
# so a batch-1 layer runs fewer kernels (each costs a few microseconds of launch and ramp-up in
# the graph while its work is a few hundred nanoseconds; docs/engine.md "GEMV prologues").
PLAIN = 0  # x as it is
SILU_MUL = 1  # x = silu(gate) * up of a gate_up GEMM's output [M, 2K]: silu_mul folded in
ADD_NORM = 2  # x = rms_norm(residual + delta) * weight: fused_norm.add_rms_norm folded in


@triton.jit
def _load_x(x_ptr, d_ptr, nw_ptr, stride_xm, stride_dm, m, kk, mask, rstd_m, PROLOGUE: tl.constexpr, HALF):
    """Row m of the GEMV input at columns kk, in float32, rounded where the unfused kernels round:
    silu_mul writes x's dtype; add_rms_norm rounds the residual sum to the residual's dtype and the
    normalised row to delta's (the model dtype)."""
    if PROLOGUE == 1:
        g = tl.load(x_ptr + m * stride_xm + kk, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + m * stride_xm + HALF + kk, mask=mask, other=0.0).to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
    elif PROLOGUE == 2:
        h = tl.load(x_ptr + m * stride_xm + kk, mask=mask, other=0.0).to(tl.float32)
        h += tl.load(d_ptr + m * stride_dm + kk, mask=mask, other=0.0).to(tl.float32)
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
        nw = tl.load(nw_ptr + kk, mask=mask, other=0.0).to(tl.float32)
        return (h * rstd_m * nw).to(d_ptr.dtype.element_ty).to(tl.float32)
    else:
        return tl.load(x_ptr + m * stride_xm + kk, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gemv_tile(
    acc, w, x_ptr, d_ptr, nw_ptr, stride_xm, stride_dm, kk, k_ok, M, offs_k, offs_m, rstd,
    M_PAD: tl.constexpr, PROLOGUE: tl.constexpr, HALF,
):  # fmt: skip
    """acc[m, :] += w @ x[m, kk] for every row m < M (w: one float32 weight tile [BLOCK_N, BLOCK_K])."""
    for m in tl.static_range(M_PAD):
        row_ok = (offs_k * 0 + m) < M  # a vector mask: the interpreter rejects a scalar & vector one
        rstd_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
        xm = _load_x(x_ptr, d_ptr, nw_ptr, stride_xm, stride_dm, m, kk, k_ok & row_ok, rstd_m, PROLOGUE, HALF)
        part = tl.sum(w * xm[None, :], axis=1)
        acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _row_rstd(
    x_ptr, d_ptr, h_ptr, M, K, eps, stride_xm, stride_dm, offs_k, offs_m, store_h,
    M_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """ADD_NORM's first pass: 1/rms of each row of h = residual + delta (rounded to the residual's
    dtype), [M_PAD]; the program with store_h writes h (the residual stream after this add)."""
    ss = tl.zeros((M_PAD,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        for m in tl.static_range(M_PAD):
            ok = (kk < K) & ((offs_k * 0 + m) < M)
            h = tl.load(x_ptr + m * stride_xm + kk, mask=ok, other=0.0).to(tl.float32)
            h += tl.load(d_ptr + m * stride_dm + kk, mask=ok, other=0.0).to(tl.float32)
            h = h.to(x_ptr.dtype.element_ty)
            tl.store(h_ptr + m * K + kk, h, mask=ok & ((offs_k * 0 + store_h) != 0))
            hf = h.to(tl.float32)
            ss = tl.where(offs_m == m, ss + tl.sum(hf * hf, axis=0), ss)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    d_ptr,
    nw_ptr,
    h_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_dm,
    eps,
    HALF,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    # The first K tile of the weight is loaded before waiting for the previous kernel (PDL,
    # kernels/pdl.py): no kernel of the forward writes weights, so with USE_GDC this read overlaps
    # the previous kernel's tail; it is most of this program's bytes (K <= BLOCK_K: all of them).
    k_ok = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output; y may be memory it still reads
    rstd = tl.zeros((M_PAD,), dtype=tl.float32)
    if PROLOGUE == 2:  # every program normalises the rows itself; program 0 writes the residual
        rstd = _row_rstd(
            x_ptr, d_ptr, h_ptr, M, K, eps, stride_xm, stride_dm, offs_k, offs_m, pid == 0, M_PAD, BLOCK_K
        )
    acc = _gemv_tile(
        acc, w, x_ptr, d_ptr, nw_ptr, stride_xm, stride_dm, offs_k, k_ok, M, offs_k, offs_m, rstd, M_PAD,
        PROLOGUE, HALF,
    )  # fmt: skip
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in range(BLOCK_K, K, BLOCK_K):  # the same sum order as one loop from 0: acc starts at 0
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc = _gemv_tile(
            acc, w, x_ptr, d_ptr, nw_ptr, stride_xm, stride_dm, kk, k_ok, M, offs_k, offs_m, rstd, M_PAD,
            PROLOGUE, HALF,
        )  # fmt: skip
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


def m_bucket(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    config: tuple[int, int, int],
    out_dtype: torch.dtype,
    k: int,
    prologue: int = PLAIN,
    delta: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, n = x.shape[0], w.shape[0]
    if x.stride(-1) != 1 or (delta is not None and delta.stride(-1) != 1):
        raise ValueError("gemv: the input rows must be contiguous")
    if w.stride(-1) != 1 or w.shape[1] != k:
        raise ValueError(f"gemv: the weight must be [N, {k}] with contiguous rows, got {tuple(w.shape)}")
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    h = torch.empty(m, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else None
    block_n, block_k, warps = config
    gdc = pdl.launch(x)
    d = x if delta is None else delta
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, d, w if norm_weight is None else norm_weight, y if h is None else h,
        m, n, k, x.stride(0), w.stride(0), y.stride(0), d.stride(0), eps, k,
        M_PAD=m_bucket(m), BLOCK_N=block_n, BLOCK_K=block_k, PROLOGUE=prologue, USE_GDC=gdc,
        num_warps=warps, launch_pdl=gdc,
    )  # fmt: skip
    return y, h


def gemv(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int]) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T for M <= MAX_M (float32 accumulation, output in x's dtype). Launched
    with PDL where kernels/pdl.py says so (the engine's forward scope on a Hopper GPU)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    return _launch(x, w, config, x.dtype, x.shape[1])[0]


def gemv_silu_mul(gate_up: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int]) -> torch.Tensor:
    """(silu(gate) * up) @ w^T for gate_up = [gate | up], [M, 2K]: fused_norm.silu_mul and the
    GEMV in one kernel, the product rounded to gate_up's dtype as silu_mul rounds it."""
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    return _launch(gate_up, w, config, gate_up.dtype, gate_up.shape[1] // 2, SILU_MUL)[0]


def gemv_add_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    config: tuple[int, int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_norm.add_rms_norm and the GEMV of its output in one kernel: returns
    (rms_norm(residual + delta) * norm_weight @ w^T in delta's dtype, residual + delta in the
    residual's dtype). Each program normalises the rows itself (K is the model dim: a few KB)."""
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    delta = delta if delta.stride(-1) == 1 else delta.contiguous()
    y, h = _launch(residual, w, config, delta.dtype, residual.shape[1], ADD_NORM, delta, norm_weight, eps)
    assert h is not None
    return y, h


# (N, K, M bucket, dtype) -> the GEMV config to use, or None for F.linear
_CHOICE: dict[tuple[int, int, int, torch.dtype], tuple[int, int, int] | None] = {}


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    """Microseconds per replay of a captured graph (after one untimed replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def graph_time_us(fn: Callable[[], object], reps: int = 20) -> float:
    """GPU time of one call, replayed from a CUDA graph: eager timing would measure the launch
    (a Triton launch from Python costs more CPU than these kernels take on the GPU), while in the
    engine the decode step is a graph replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return replay_us(graph) / reps


def _choose(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int] | None:
    """Time F.linear and each GEMV config on this shape (outputs checked against F.linear)."""
    ref = F.linear(x, w)
    best: tuple[float, tuple[int, int, int] | None] = (graph_time_us(lambda: F.linear(x, w)), None)
    base_us = best[0]
    tol = 2e-2 * float(ref.float().abs().max()) + 1e-3
    for cfg in CONFIGS:
        try:
            out = gemv(x, w, cfg)
            if not torch.allclose(out.float(), ref.float(), atol=tol, rtol=2e-2):
                log.warning("gemv %s disagrees with F.linear on %s: not used", cfg, tuple(w.shape))
                continue
            us = graph_time_us(lambda cfg=cfg: gemv(x, w, cfg))
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is just not a candidate
            log.warning("gemv %s failed on %s: %s", cfg, tuple(w.shape), e)
            continue
        if us < best[0]:
            best = (us, cfg)
    log.info(
        "decode GEMM N=%d K=%d M<=%d: %s (%.1f us; F.linear %.1f us)",
        w.shape[0], w.shape[1], m_bucket(x.shape[0]), best[1] or "F.linear", best[0], base_us,
    )  # fmt: skip
    return best[1]


def choices() -> dict[str, str]:
    """What each decode GEMM shape runs: "N x K, M<=b" -> the GEMV config or "F.linear", and
    "+ silu_mul" / "+ add_norm" where it takes that prologue."""
    names = {SILU_MUL: "silu_mul", ADD_NORM: "add_norm"}
    out = {}
    for (n, k, b, dt), cfg in _CHOICE.items():
        taken = [names[mode] for mode in names if _PROLOGUE.get((n, k, b, dt, mode))]
        out[f"{n}x{k},M<={b}"] = " + ".join([str(cfg or "F.linear"), *taken])
    return out


def pin(
    n: int,
    k: int,
    m_bucket_: int,
    dtype: torch.dtype,
    config: tuple[int, int, int] | None,
    prologues: bool | None = None,
) -> None:
    """Fix the choice for a shape instead of timing it at warm-up (benchmarks that already know
    it; tests under the interpreter, where nothing can be timed). `prologues` fixes whether the
    GEMV takes them (SILU_MUL, ADD_NORM) too; None leaves that to the check and timing."""
    _CHOICE[(n, k, m_bucket_, dtype)] = config
    if prologues is not None:
        for mode in (SILU_MUL, ADD_NORM):
            _PROLOGUE[(n, k, m_bucket_, dtype, mode)] = prologues and config is not None


def _config(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int] | None:
    """The GEMV config for x @ w^T, or None for F.linear (chosen at the first call outside a
    capture; on CPU only under the interpreter, and only for pinned shapes)."""
    m = x.shape[0]
    if x.dim() != 2 or m > MAX_M or m == 0 or w.dtype != x.dtype:
        return None
    if x.is_cuda:
        if x.dtype not in (torch.bfloat16, torch.float16):
            return None
    elif not pdl.interpreting():
        return None
    key = (w.shape[0], w.shape[1], m_bucket(m), x.dtype)
    if key not in _CHOICE:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return None  # never time inside a capture; the warm-up decides
        _CHOICE[key] = _choose(x.contiguous(), w)
    return _CHOICE[key]


# (N, K, M bucket, dtype, prologue) -> whether the GEMV reads its input through that prologue:
# decided once per shape, outside a capture, by checking and timing it against the separate
# kernel + the plain GEMV (so, like the GEMV itself, it can only make a step faster).
_PROLOGUE: dict[tuple[int, int, int, torch.dtype, int], bool] = {}


def _prologue_pays(
    key: tuple[int, int, int, torch.dtype, int],
    fused: Callable[[], torch.Tensor],
    unfused: Callable[[], torch.Tensor],
) -> bool:
    if key not in _PROLOGUE:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            ref, out = unfused().float(), fused().float()
            tol = 2e-2 * float(ref.abs().max()) + 1e-3
            ok = bool(torch.allclose(out, ref, atol=tol, rtol=2e-2))
            if not ok:
                log.warning(
                    "gemv prologue %d disagrees with its unfused kernels on %s: not used", key[4], key
                )
            us, base_us = graph_time_us(fused), graph_time_us(unfused)
        except Exception as e:  # noqa: BLE001 - a prologue that fails to compile is just not used
            log.warning("gemv prologue %d failed on %s: %s", key[4], key, e)
            ok, us, base_us = False, 0.0, 0.0
        _PROLOGUE[key] = ok and us < base_us
        log.info(
            "decode GEMM N=%d K=%d M<=%d prologue %d: %s (%.1f us; unfused %.1f us)",
            key[0], key[1], key[2], key[4], "fused" if _PROLOGUE[key] else "unfused", us, base_us,
        )  # fmt: skip
    return _PROLOGUE[key]


def decode_linear(
    x: torch.Tensor | PendingNorm, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, w, b), through the GEMV where it was measured faster for this shape. x may be a
    PendingNorm (the residual add + RMSNorm before this GEMM), folded into the GEMV where that
    was measured faster too."""
    if isinstance(x, PendingNorm):
        return _add_norm_linear(x, w, b)
    cfg = _config(x, w)
    if cfg is None:
        return F.linear(x, w, b)
    y = gemv(x, w, cfg)
    return y if b is None else y + b


def _chosen(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int] | None:
    """The GEMV config already chosen (or pinned) for a GEMM whose input is computed from x, or
    None: then the caller computes its input with the separate kernel and calls decode_linear,
    which chooses at the first call."""
    m = x.shape[0]
    if x.dim() != 2 or m > MAX_M or m == 0 or w.dtype != x.dtype or not (x.is_cuda or pdl.interpreting()):
        return None
    return _CHOICE.get((w.shape[0], w.shape[1], m_bucket(m), x.dtype))


def _add_norm_linear(x: PendingNorm, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    key = (w.shape[0], w.shape[1], m_bucket(x.shape[0]), x.delta.dtype)
    cfg = _chosen(x.delta, w)
    if cfg is None or x.residual.shape != x.delta.shape:
        return decode_linear(x.materialize(), w, b)
    res, delta, nw, eps = x.residual, x.delta, x.weight, x.eps

    def fused() -> torch.Tensor:
        return gemv_add_norm(res, delta, nw, eps, w, cfg)[0]

    def unfused() -> torch.Tensor:
        return gemv(add_rms_norm(res, delta, nw, eps)[1], w, cfg)

    if not _prologue_pays((*key, ADD_NORM), fused, unfused):
        return decode_linear(x.materialize(), w, b)
    y, x.residual_out = gemv_add_norm(res, delta, nw, eps, w, cfg)
    return y if b is None else y + b


def decode_linear_silu_mul(
    gate_up: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """decode_linear(silu(gate) * up, w, b) for gate_up = [gate | up], [M, 2K]: fused_norm.silu_mul
    folded into the GEMV where that was measured faster."""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    key = (w.shape[0], w.shape[1], m_bucket(gate_up.shape[0]), gate_up.dtype)
    cfg = _chosen(gate_up, w)
    if cfg is None or w.shape[1] != half:
        return decode_linear(silu_mul(gate, up), w, b)

    def fused() -> torch.Tensor:
        return gemv_silu_mul(gate_up, w, cfg)

    def unfused() -> torch.Tensor:
        return gemv(silu_mul(gate, up), w, cfg)

    if not _prologue_pays((*key, SILU_MUL), fused, unfused):
        return decode_linear(silu_mul(gate, up), w, b)
    y = gemv_silu_mul(gate_up, w, cfg)
    return y if b is None else y + b


__all__ = [
    "ADD_NORM",
    "MAX_M",
    "PLAIN",
    "SILU_MUL",
    "choices",
    "decode_linear",
    "decode_linear_silu_mul",
    "gemv",
    "gemv_add_norm",
    "gemv_silu_mul",
    "graph_time_us",
    "pin",
    "replay_us",
]
