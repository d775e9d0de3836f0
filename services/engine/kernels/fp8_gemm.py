"""Triton kernels for the DeepSeek-V3 FP8 recipe (issue 8): block-scaled GEMM, grouped (MoE) GEMM,
and 1x128 activation quantisation.

Why our own kernels: torch's block-wise `scaled_mm` (cuBLAS) is ~1.5x bf16 at M >= 4096 but only
0.70-1.20x at decode-sized M (shared/notes/infra-facts.md "FP8"): with 128x128 output tiles,
M = 128 and N = 2048 gives 16 CTAs for 132 SMs. The dense kernel here uses small BLOCK_M (16-64)
and split-K so that even M = 64 fills the GPU; at small M the GEMM is weight-bandwidth bound, and
fp8 weights are half the bytes of bf16 ones. The grouped kernel runs all MoE experts in one launch
without a host sync (each program finds its expert by scanning the offsets).

Operand conventions are those of services/common/fp8.py: a (M, K) fp8 with a_scale (M, KB) (any
strides), w (N, K) fp8 with w_scale (NB, KB), decoding scales, KB = ceil(K/128), NB = ceil(N/128).
Ragged M/N/K are masked (zero fill), which is exactly the reference's ragged-trailing-block rule.
The K loop steps one 128-wide scale block at a time: acc += dot(a_kb, w_kb^T) * a_s[:, None] * w_s.

CPU: runs under TRITON_INTERPRET=1 (tests/test_fp8_linear.py). Known interpreter defect (triton
3.9): its fp32 -> float8e4nv conversion sometimes loses a round-up (e.g. -125.48 -> -64 instead of
-128; subnormal 2.85 ulp -> 2 ulp), in ~3% of elements, so the quantisation kernel's bits are
checked exactly only on the GPU (bench/fp8/gemm.py self-check); its scales match exactly on CPU.
The interpreter's fp32 -> bf16 conversion truncates (the GPU rounds to nearest), so CPU tests
compare float32 outputs.

Accuracy on the GPU (H200 run 1): BLOCK_M >= 64 lowers tl.dot to Hopper wgmma, whose fp8
accumulation keeps ~14 bits within an instruction chain, so each 128-wide block product errs by
~2^-13 relative (1.27e-4 Frobenius vs the exact fp32 reference, for every such config and shape);
BLOCK_M 16/32 (mma.sync) accumulate in full fp32 (1e-7). Promoting to fp32 every 128 K, as here,
is what bounds it (DeepSeek-V3's recipe); bench/fp8/gemm.py's self-check asserts those bounds.

Dispatch: TUNED_CONFIGS below is the measured (M bucket, N, K) -> config/cuBLAS table that
services/engine/fp8_linear.py's "auto" follows; pick_config is the fallback for other shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

try:  # triton is a hard dependency (torchtitan imports it), but keep CPU-only installs importable.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
AMAX_EPS = 1e-12  # same as services/common/fp8.py: an all-zero block gets scale 1e-12 / 448
NUM_SMS_DEFAULT = 132  # H200; the real count is read from the device when there is one


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration. BLOCK_K is fixed at 128 = the scale block (one scale per K step)."""

    block_m: int = 64
    block_n: int = 128
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    # Experimental (sweep only, large M): scale block kb-1's product while block kb's dot runs, so
    # the dot's result is not consumed in the iteration that issues it (see _fp8_gemm_kernel).
    lag: bool = False

    def name(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}k128_s{self.split_k}_g{self.group_m}"
            f"_w{self.num_warps}_st{self.num_stages}" + ("_lag" if self.lag else "")
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return NUM_SMS_DEFAULT


@functools.cache
def _cuda_sms(index: int) -> int:
    # Cached: get_device_properties costs host time on every decode-step GEMM otherwise.
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT) -> GemmConfig:
    """Heuristic for shapes outside TUNED_CONFIGS, shaped by H200 run 1 (bench/fp8/results/
    gemm_h200_1.json). At M <= 256 every sweep winner had BLOCK_M = 64 (one wgmma warpgroup, even
    for M = 64: the GEMM streams the weight once, so idle rows cost nothing), 4 warps, mostly no
    split-K (split 4 at 64 x 2048 x 7168 ran at 0.33x bf16 against 0.56x unsplit): BLOCK_N 128
    when that still gives >= a quarter of the SMs tiles, else 64, and split 2 only when even
    that leaves most SMs idle over a long K. Large M: 128x128 tiles, 8 warps (two warpgroups);
    "auto" sends large M to cuBLAS anyway (fp8_linear.TRITON_MAX_M)."""
    kb = _cdiv(k, BLOCK)
    if m > 256:
        return GemmConfig(block_m=128, block_n=128, split_k=1, group_m=8, num_warps=8, num_stages=3)
    tiles_m = _cdiv(m, 64)
    block_n = 128 if tiles_m * _cdiv(n, 128) >= num_sms // 4 else 64
    tiles = tiles_m * _cdiv(n, block_n)
    split = 2 if tiles < num_sms // 4 and kb >= 16 else 1
    return GemmConfig(block_m=64, block_n=block_n, split_k=split, group_m=1, num_warps=4, num_stages=4)


# Measured dispatch table: (M bucket, N, K) -> the fastest of {Triton config, cuBLAS block-wise
# ("torch")} in H200 run 1 (bench/fp8/results/gemm_h200_1.json; x bf16 in the comments). An M
# is served by the smallest bucket >= M; M above the largest bucket, or an (N, K) not listed,
# falls back to pick_config / fp8_linear.TRITON_MAX_M. Regenerate from a new run's
# "tuned_table_suggestion" (bench/fp8/gemm.py prints it in this format).
TORCH = "torch"
M_BUCKETS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
_W4 = functools.partial(GemmConfig, group_m=1, num_warps=4)
_W8 = functools.partial(GemmConfig, group_m=8, num_warps=8)
TUNED_CONFIGS: dict[tuple[int, int, int], GemmConfig | str] = {
    (64, 7168, 2048): _W4(64, 128, 1, num_stages=4),  # 1.13
    (128, 7168, 2048): _W4(64, 64, 1, num_stages=3),  # 0.96
    (256, 7168, 2048): _W4(64, 128, 1, num_stages=4),  # 0.34 (torch 0.19)
    (512, 7168, 2048): TORCH,  # 0.37 (triton 0.30)
    (1024, 7168, 2048): _W8(128, 128, 1, num_stages=3),  # 0.72 (torch 0.70)
    (2048, 7168, 2048): TORCH,  # 0.86
    (64, 4096, 7168): TORCH,  # 0.84 (best triton 0.78)
    (128, 4096, 7168): _W4(64, 128, 4, num_stages=4),  # 1.00
    (256, 4096, 7168): _W4(64, 64, 1, num_stages=4),  # 0.37 (torch 0.33)
    (512, 4096, 7168): _W8(128, 128, 1, num_stages=3),  # 0.68 (torch 0.43)
    (1024, 4096, 7168): TORCH,  # 1.39
    (2048, 4096, 7168): TORCH,  # 1.47
    (64, 2048, 7168): _W4(64, 64, 1, num_stages=4),  # 0.56 (torch 0.21)
    (128, 2048, 7168): _W4(64, 128, 2, num_stages=4),  # 0.75 (torch 0.58)
    (256, 2048, 7168): _W4(64, 64, 1, num_stages=4),  # 0.73 (torch 0.65)
    (512, 2048, 7168): TORCH,  # 0.83
    (1024, 2048, 7168): TORCH,  # 1.37
    (2048, 2048, 7168): TORCH,  # 1.44
    (64, 18432, 7168): _W4(64, 128, 1, num_stages=4),  # 1.38
    (128, 18432, 7168): _W4(64, 128, 1, num_stages=4),  # 0.84 (torch 0.50)
    (256, 18432, 7168): _W4(64, 128, 1, num_stages=4),  # 0.71 (torch 0.62)
    (512, 18432, 7168): TORCH,  # 1.12
    (1024, 18432, 7168): TORCH,  # 1.42
    (2048, 18432, 7168): TORCH,  # 1.55
}


def m_bucket(m: int) -> int | None:
    """The smallest M_BUCKETS entry >= m (None above the largest)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return None


def tuned_choice(m: int, n: int, k: int) -> GemmConfig | str | None:
    """TUNED_CONFIGS' entry for this shape: a GemmConfig, TORCH, or None (not measured)."""
    b = m_bucket(m)
    return None if b is None else TUNED_CONFIGS.get((b, n, k))


def candidate_configs(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT) -> list[GemmConfig]:
    """The heuristic's choice plus neighbours, for bench/fp8/gemm.py's sweep (which reports the best
    per shape and a suggested TUNED_CONFIGS entry)."""
    base = pick_config(m, n, k, num_sms)
    out = [base]
    kb = _cdiv(k, BLOCK)
    if m > 256:
        # Registers bound the tile: the scaled dot needs a temporary as large as the accumulator,
        # so 128x128 wants 8 warps (64 + 64 fp32 per thread). 128x256 / 256x128 with 8 warps and
        # deeper pipelines are the large-M exploration (run 1 swept only up to 128x128: best
        # Triton was 0.86-0.98x bf16 against cuBLAS block-wise's 1.40-1.64x).
        out += [
            GemmConfig(128, 128, 1, 8, 8, 3),
            GemmConfig(128, 128, 1, 8, 8, 4),
            GemmConfig(64, 128, 1, 8, 4, 3),
            GemmConfig(64, 256, 1, 8, 8, 3),
            GemmConfig(128, 256, 1, 8, 8, 3),
            GemmConfig(256, 128, 1, 8, 8, 3),
            GemmConfig(128, 64, 1, 8, 4, 4),
            GemmConfig(128, 128, 1, 8, 8, 3, lag=True),
            GemmConfig(128, 128, 1, 8, 8, 4, lag=True),
            GemmConfig(64, 128, 1, 8, 4, 3, lag=True),
        ]
    else:
        # BLOCK_M 64 compiles to Hopper wgmma; 16/32 to mma.sync (run 1 swept only 64 here).
        for bm in (16, 32, 64):
            for bn in (64, 128):
                for split in (1, 2, 4):
                    if kb // split >= 2:
                        out.append(GemmConfig(bm, bn, split, 1, 4, 4 if bm == 64 else 3))
        out.append(dataclasses.replace(base, num_stages=3))
        out.append(dataclasses.replace(base, num_stages=5))
    seen: set[GemmConfig] = set()
    return [c for c in out if not (c in seen or seen.add(c))]


if HAS_TRITON:
    # jit functions may read only constexpr globals.
    _C_FP8_MAX = tl.constexpr(FP8_MAX)
    _C_AMAX_EPS = tl.constexpr(AMAX_EPS)

    @triton.jit
    def _fp8_gemm_kernel(
        a_ptr,
        as_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_asm,
        stride_ask,
        stride_wn,
        stride_wk,
        stride_wsn,
        stride_wsk,
        stride_cs,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        LAG: tl.constexpr,
    ):
        """C[pid_k] (M, N) = sum over this split's K blocks of scaled fp8 block products.
        SPLIT_K > 1 writes float32 partials (reduced by _splitk_reduce_kernel): deterministic,
        unlike atomics, so the same inputs always give the same bits.
        LAG: the plain loop consumes each dot's result right away (scale, add), so Hopper's async
        wgmma must finish before the scaling FMAs start and the tensor cores idle meanwhile (run
        1: best Triton 0.86-0.98x bf16 at large M against cuBLAS block-wise's 1.40-1.64x). With LAG
        the scaling of block kb-1 is issued after block kb's dot and before its result is needed,
        giving the compiler an overlap to exploit; same products, same summation order."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        # Grouped ordering: consecutive programs share weight tiles in L2.
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (pid % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Out-of-range rows/cols read a valid row (wrapped) and are never stored: no load masks on M/N.
        rm_l = rm % M
        rn_l = rn % N
        rk = tl.arange(0, BLOCK_K)

        kb_total = tl.cdiv(K, BLOCK_K)
        kb_per = tl.cdiv(kb_total, SPLIT_K)
        kb_start = pid_k * kb_per
        kb_end = tl.minimum(kb_start + kb_per, kb_total)

        a_ptrs = a_ptr + rm_l[:, None] * stride_am + (kb_start * BLOCK_K + rk)[None, :] * stride_ak
        w_ptrs = w_ptr + rn_l[None, :] * stride_wn + (kb_start * BLOCK_K + rk)[:, None] * stride_wk
        as_ptrs = as_ptr + rm_l * stride_asm + kb_start * stride_ask
        ws_ptrs = ws_ptr + (rn_l // BLOCK_K) * stride_wsn + kb_start * stride_wsk

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LAG:
            prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            prev_as = tl.zeros((BLOCK_M,), dtype=tl.float32)
            prev_ws = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for kb in range(kb_start, kb_end):
                k_left = K - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
                w = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
                a_s = tl.load(as_ptrs)
                w_s = tl.load(ws_ptrs)
                d = tl.dot(a, w)
                acc += prev * prev_as[:, None] * prev_ws[None, :]  # 0 * 0 on the first step
                prev, prev_as, prev_ws = d, a_s, w_s
                a_ptrs += BLOCK_K * stride_ak
                w_ptrs += BLOCK_K * stride_wk
                as_ptrs += stride_ask
                ws_ptrs += stride_wsk
            acc += prev * prev_as[:, None] * prev_ws[None, :]
        else:
            for kb in range(kb_start, kb_end):
                k_left = K - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
                w = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
                a_s = tl.load(as_ptrs)
                w_s = tl.load(ws_ptrs)
                acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
                a_ptrs += BLOCK_K * stride_ak
                w_ptrs += BLOCK_K * stride_wk
                as_ptrs += stride_ask
                ws_ptrs += stride_wsk

        c_ptrs = c_ptr + pid_k * stride_cs + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fp8_linear_fused_kernel(
        x_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_wsn,
        stride_wsk,
        stride_cs,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        POW2: tl.constexpr,
    ):
        """_fp8_gemm_kernel with the 1x128 activation quantisation fused in: each K step loads the
        high-precision (BLOCK_M, 128) activation block, quantises it in registers exactly as
        _quant_act_kernel does (same div_rn, clamp, cast: same bits), and feeds the fp8 dot. Saves
        the quantiser's launch and its HBM round trip at decode-sized M, at the price of every
        N tile re-quantising its rows (from L2). Benchmark variant; dispatch does not use it."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (pid % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm_l = rm % M
        rn_l = rn % N
        rk = tl.arange(0, BLOCK_K)

        kb_total = tl.cdiv(K, BLOCK_K)
        kb_per = tl.cdiv(kb_total, SPLIT_K)
        kb_start = pid_k * kb_per
        kb_end = tl.minimum(kb_start + kb_per, kb_total)

        x_ptrs = x_ptr + rm_l.to(tl.int64)[:, None] * stride_xm + (kb_start * BLOCK_K + rk)[None, :]
        w_ptrs = w_ptr + rn_l[None, :] * stride_wn + (kb_start * BLOCK_K + rk)[:, None]
        ws_ptrs = ws_ptr + (rn_l // BLOCK_K) * stride_wsn + kb_start * stride_wsk

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_start, kb_end):
            k_left = K - kb * BLOCK_K
            x = tl.load(x_ptrs, mask=rk[None, :] < k_left, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            a_s = tl.math.div_rn(tl.maximum(amax, _C_AMAX_EPS), _C_FP8_MAX)
            if POW2:
                bits = a_s.to(tl.int32, bitcast=True)
                up = tl.where((bits & 0x007FFFFF) != 0, (bits & 0x7F800000) + 0x00800000, bits & 0x7F800000)
                a_s = up.to(tl.float32, bitcast=True)
            a = tl.clamp(tl.math.div_rn(x, a_s[:, None]), -_C_FP8_MAX, _C_FP8_MAX).to(w_ptr.dtype.element_ty)
            w = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
            w_s = tl.load(ws_ptrs)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            ws_ptrs += stride_wsk

        c_ptrs = c_ptr + pid_k * stride_cs + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _splitk_reduce_kernel(p_ptr, c_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """c (M*N, out dtype) = sum over the SPLIT_K float32 partials, in a fixed order."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _grouped_fp8_gemm_kernel(
        a_ptr,
        as_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        offs_ptr,
        E,
        N,
        K,
        stride_am,
        stride_ak,
        stride_asm,
        stride_ask,
        stride_we,
        stride_wn,
        stride_wk,
        stride_wse,
        stride_wsn,
        stride_wsk,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """MoE: rows of a sorted by expert, expert e owns rows [offs[e-1], offs[e]). Program
        (pid_m, pid_n) takes the pid_m-th BLOCK_M row tile in the concatenation of every expert's
        tiles; the grid over-provisions (cdiv(T, BLOCK_M) + E tiles) and surplus programs exit, so
        the host never reads the offsets (no sync)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        # int32 scalars from the start: loop-carried values must keep one type.
        expert = tl.full((), -1, tl.int32)
        row_start = tl.full((), 0, tl.int32)
        row_end = tl.full((), 0, tl.int32)
        tiles_before = tl.full((), 0, tl.int32)
        prev_end = tl.full((), 0, tl.int32)
        for e in range(0, E):
            end = tl.load(offs_ptr + e)
            n_tiles = tl.cdiv(end - prev_end, BLOCK_M)
            hit = (pid_m >= tiles_before) & (pid_m < tiles_before + n_tiles)
            expert = tl.where(hit, e, expert)
            row_start = tl.where(hit, prev_end + (pid_m - tiles_before) * BLOCK_M, row_start)
            row_end = tl.where(hit, end, row_end)
            tiles_before += n_tiles
            prev_end = end
        if expert < 0:
            return

        rm = row_start + tl.arange(0, BLOCK_M)
        rm_ok = rm < row_end
        rm_l = tl.where(rm_ok, rm, row_start)  # a valid row of the same expert; never stored
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn_l = rn % N
        rk = tl.arange(0, BLOCK_K)

        a_ptrs = a_ptr + rm_l[:, None] * stride_am + rk[None, :] * stride_ak
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        w_ptrs = w_base + rn_l[None, :] * stride_wn + rk[:, None] * stride_wk
        as_ptrs = as_ptr + rm_l * stride_asm
        ws_ptrs = ws_ptr + expert.to(tl.int64) * stride_wse + (rn_l // BLOCK_K) * stride_wsn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
            a_s = tl.load(as_ptrs)
            w_s = tl.load(ws_ptrs)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
            as_ptrs += stride_ask
            ws_ptrs += stride_wsk

        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        mask = rm_ok[:, None] & (rn[None, :] < N)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quant_act_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        M,
        K,
        stride_xm,
        stride_qm,
        stride_sm,
        stride_sk,
        POW2: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """ROWS rows x one 128-wide block per program: scale = amax / 448 per row (or its
        power-of-two ceiling), q = x / scale. IEEE-rounded divisions (div_rn) so the bits equal
        services/common/fp8.quantize_act. A (ROWS, 128) tile per program, not one row: run 1 had
        one 128-element program per (row, block) and the quantiser cost more than the GEMM
        (e.g. M = 4096, K = 2048: whole linear 0.39x bf16 against 1.34x for the GEMM alone)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        kb = tl.program_id(1)
        cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols[None, :] < K)
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.math.div_rn(tl.maximum(amax, _C_AMAX_EPS), _C_FP8_MAX)
        if POW2:
            # Power-of-two ceiling on the bits (exact; log2 on the GPU is approximate): keep the
            # exponent, bump it when any mantissa bit is set. scale >= 1e-12 / 448 is normal.
            bits = scale.to(tl.int32, bitcast=True)
            up = tl.where((bits & 0x007FFFFF) != 0, (bits & 0x7F800000) + 0x00800000, bits & 0x7F800000)
            scale = up.to(tl.float32, bitcast=True)
        q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -_C_FP8_MAX, _C_FP8_MAX)
        q_ptrs = q_ptr + rows64[:, None] * stride_qm + cols[None, :]
        tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows * stride_sm + kb * stride_sk, scale, mask=row_ok)


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton fp8 kernels need CUDA (or TRITON_INTERPRET=1 on CPU)")


def _check(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> None:
    if a.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise TypeError(f"fp8 GEMM wants {FP8_DTYPE} operands, got {a.dtype} and {w.dtype}")
    m, k = a.shape
    if w.shape[-1] != k:
        raise ValueError(f"K mismatch: a {tuple(a.shape)}, w {tuple(w.shape)}")
    if tuple(a_scale.shape) != (m, _cdiv(k, BLOCK)):
        raise ValueError(f"a_scale shape {tuple(a_scale.shape)} != {(m, _cdiv(k, BLOCK))}")
    want = (*w.shape[:-2], _cdiv(w.shape[-2], BLOCK), _cdiv(k, BLOCK))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} != {want}")
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("fp8 operands must be contiguous along K")


def triton_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """out (M, N) = dequant(a) @ dequant(w).T, float32 accumulation per 128-wide K block."""
    _require_triton()
    _check(a, a_scale, w, w_scale)
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or pick_config(m, n, k, num_sms(a.device))
    a_scale = a_scale.float()
    w_scale = w_scale.float()
    split = max(1, min(cfg.split_k, _cdiv(k, BLOCK)))
    # Partials are float32 (exact sum of the splits); one split writes the output directly.
    c = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    c3 = c.unsqueeze(0) if split == 1 else c
    grid = (_cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n), split)
    _fp8_gemm_kernel[grid](
        a,
        a_scale,
        w,
        w_scale,
        c3,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        a_scale.stride(0),
        a_scale.stride(1),
        w.stride(0),
        w.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        c3.stride(0),
        c3.stride(1),
        c3.stride(2),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK,
        SPLIT_K=split,
        GROUP_M=cfg.group_m,
        LAG=cfg.lag,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        rblock = 1024
        _splitk_reduce_kernel[(_cdiv(m * n, rblock),)](c, out, m * n, SPLIT_K=split, BLOCK=rblock)
    return out


def triton_fp8_linear_fused(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
    pow2: bool = False,
) -> torch.Tensor:
    """x (M, K) high precision -> (M, N): the 1x128 quantisation of x fused into the block-scaled
    GEMM (one launch, two with split-K). Same bits as triton_quantize_act + triton_fp8_gemm with
    the same config. Benchmark variant (bench/fp8/gemm.py `linear_fp8_fused_graph`)."""
    _require_triton()
    if x.dim() != 2 or w.dtype != FP8_DTYPE or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"fused fp8 linear wants x (M, K) and fp8 w (N, K), got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    if w.stride(-1) != 1:
        raise ValueError("fp8 weight must be contiguous along K")
    m, k = x.shape
    n = w.shape[0]
    if tuple(w_scale.shape) != (_cdiv(n, BLOCK), _cdiv(k, BLOCK)):
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} != {(_cdiv(n, BLOCK), _cdiv(k, BLOCK))}")
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or pick_config(m, n, k, num_sms(x.device))
    w_scale = w_scale.float()
    split = max(1, min(cfg.split_k, _cdiv(k, BLOCK)))
    c = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    c3 = c.unsqueeze(0) if split == 1 else c
    grid = (_cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n), split)
    _fp8_linear_fused_kernel[grid](
        x,
        w,
        w_scale,
        c3,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        w_scale.stride(0),
        w_scale.stride(1),
        c3.stride(0),
        c3.stride(1),
        c3.stride(2),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK,
        SPLIT_K=split,
        GROUP_M=cfg.group_m,
        POW2=pow2,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        rblock = 1024
        _splitk_reduce_kernel[(_cdiv(m * n, rblock),)](c, out, m * n, SPLIT_K=split, BLOCK=rblock)
    return out


def pick_grouped_block_m(t: int, e: int) -> int:
    """Rows per tile for the grouped kernel: about the mean rows per expert, 16..128."""
    per = max(1, t // max(1, e))
    # H200 run 1: 16 was best at decode (8 rows per expert); at prefill (512 per expert) 64 beat
    # 128 by 15-17% (1.78 vs 2.09 ms, 0.96 vs 1.12 ms), so 64 is the ceiling.
    return 16 if per <= 16 else 32 if per <= 32 else 64


def triton_grouped_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int | None = None,
    block_n: int = 128,
    num_warps: int | None = None,
    num_stages: int = 4,
) -> torch.Tensor:
    """MoE grouped GEMM, one launch: a (T, K) rows sorted by expert, w (E, N, K), w_scale
    (E, NB, KB), offs (E,) int32 cumulative end offsets on a's device. Returns (T, N).
    Offsets are not validated here (that would need a host sync); services.common.fp8 does."""
    _require_triton()
    _check(a, a_scale, w, w_scale)
    t, k = a.shape
    e, n, _ = w.shape
    out = torch.empty(t, n, dtype=out_dtype, device=a.device)
    if t == 0 or n == 0 or e == 0:
        return out
    bm = block_m or pick_grouped_block_m(t, e)
    warps = num_warps or (8 if bm >= 128 else 4)
    offs = offs.to(device=a.device, dtype=torch.int32).contiguous()
    a_scale, w_scale = a_scale.float(), w_scale.float()
    grid = (_cdiv(t, bm) + e, _cdiv(n, block_n))
    _grouped_fp8_gemm_kernel[grid](
        a,
        a_scale,
        w,
        w_scale,
        out,
        offs,
        e,
        n,
        k,
        a.stride(0),
        a.stride(1),
        a_scale.stride(0),
        a_scale.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        w_scale.stride(0),
        w_scale.stride(1),
        w_scale.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK,
        num_warps=warps,
        num_stages=num_stages,
    )
    return out


def triton_quantize_act(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 quantisation of x (M, K) in one launch. The scale comes back as an (M, KB) view of
    a column-major buffer (strides (1, M)): the layout torch's block-wise scaled_mm wants, and
    the Triton GEMM reads any strides."""
    _require_triton()
    if x.dim() != 2:
        raise ValueError(f"triton_quantize_act wants (M, K), got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    kb = _cdiv(k, BLOCK)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(kb, m, dtype=torch.float32, device=x.device).t()
    if m and k:
        # Fewer rows per program at small M so a decode-sized input still spreads over the SMs.
        rows = 8 if m <= 512 else 32
        _quant_act_kernel[(_cdiv(m, rows), kb)](
            x,
            q,
            s,
            m,
            k,
            x.stride(0),
            q.stride(0),
            s.stride(0),
            s.stride(1),
            POW2=pow2,
            ROWS=rows,
            BLOCK_K=BLOCK,
            num_warps=4,
        )
    return q, s
