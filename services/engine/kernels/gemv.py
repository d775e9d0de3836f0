"""Decode-sized GEMMs (M <= 8 rows) as a Triton GEMV, where it beats cuBLAS.

At batch 1 the decode step is a chain of small GEMMs whose weights are read once each. cuBLAS
picks poor kernels for some of these shapes on the H200 (Qwen3-0.6B's o_proj, N=1024 x K=2048, runs in 12.4 us as 16 CTAs of 8x64 tiles, 12.6x the time
to read its 4 MB; the fused qkv / gate_up GEMMs take 2-4x their read time). This kernel tiles the
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

from ops import pdl

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


@triton.jit
def _gemv_tile(acc, w, x_ptr, stride_xm, kk, k_ok, M, offs_k, offs_m, M_PAD: tl.constexpr):
    """acc[m, :] += w @ x[m, kk] for every row m < M (w: one float32 weight tile [BLOCK_N, BLOCK_K])."""
    for m in tl.static_range(M_PAD):
        row_ok = (offs_k * 0 + m) < M  # a vector mask: the interpreter rejects a scalar & vector one
        xm = tl.load(x_ptr + m * stride_xm + kk, mask=k_ok & row_ok, other=0.0).to(tl.float32)
        part = tl.sum(w * xm[None, :], axis=1)
        acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    # ops/pdl.py): no kernel of the forward writes weights, so with USE_GDC this read overlaps
    # the previous kernel's tail; it is most of this program's bytes (K <= BLOCK_K: all of them).
    k_ok = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output; y may be memory it still reads
    acc = _gemv_tile(acc, w, x_ptr, stride_xm, offs_k, k_ok, M, offs_k, offs_m, M_PAD)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in range(BLOCK_K, K, BLOCK_K):  # the same sum order as one loop from 0: acc starts at 0
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc = _gemv_tile(acc, w, x_ptr, stride_xm, kk, k_ok, M, offs_k, offs_m, M_PAD)
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


def m_bucket(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8


def gemv(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int]) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T for M <= MAX_M (float32 accumulation, output in x's dtype). Launched
    with PDL where ops/pdl.py says so (the engine's forward scope on a Hopper GPU)."""
    m, k = x.shape
    n = w.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config
    gdc = pdl.launch(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        M_PAD=m_bucket(m), BLOCK_N=block_n, BLOCK_K=block_k, USE_GDC=gdc, num_warps=warps, launch_pdl=gdc,
    )  # fmt: skip
    return y


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
    """What each decode GEMM shape runs: "N x K, M<=b" -> the GEMV config or "F.linear"."""
    return {f"{n}x{k},M<={b}": str(cfg or "F.linear") for (n, k, b, _dt), cfg in _CHOICE.items()}


def pin(n: int, k: int, bucket: int, dtype: torch.dtype, config: tuple[int, int, int] | None) -> None:
    """Fix the choice for (N, K, M bucket, dtype) instead of timing it at warm-up: for a benchmark
    that already knows it (~30 Triton configurations fewer to compile and time in a short GPU
    call). None: F.linear."""
    _CHOICE[(n, k, bucket, dtype)] = config


def decode_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b), through the GEMV where it was measured faster for this shape."""
    m = x.shape[0]
    if (
        x.dim() != 2
        or m > MAX_M
        or m == 0
        or not x.is_cuda
        or x.dtype not in (torch.bfloat16, torch.float16)
        or w.dtype != x.dtype
    ):
        return F.linear(x, w, b)
    key = (w.shape[0], w.shape[1], m_bucket(m), x.dtype)
    if key not in _CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return F.linear(x, w, b)  # never time inside a capture; the warm-up decides
        _CHOICE[key] = _choose(x.contiguous(), w)
    cfg = _CHOICE[key]
    if cfg is None:
        return F.linear(x, w, b)
    y = gemv(x, w, cfg)
    return y if b is None else y + b


__all__ = ["MAX_M", "choices", "decode_linear", "gemv", "graph_time_us", "pin", "replay_us"]
