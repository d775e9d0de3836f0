"""Triton kernels for the DeepSeek-V3 FP8 recipe: block-scaled GEMM, grouped (MoE) GEMM,
and 1x128 activation quantisation, plus the measured dispatch table they are launched from.

Why our own kernels: torch's block-wise `scaled_mm` (cuBLAS) is ~1.5x bf16 at M >= 4096 but only
0.6-1.3x at decode-sized M (H200): with 128x128 output tiles,
M = 128 and N = 2048 gives 16 CTAs for 132 SMs. At small M the GEMM is weight-bandwidth bound and
fp8 weights are half the bytes of bf16 ones, so a kernel that keeps every SM streaming weights
can approach 2x bf16.

Kernels:
- tiled (`_fp8_gemm_kernel`): one program per BLOCK_M x BLOCK_N tile and K split; BLOCK_M
  16/32 (mma.sync) or 64+ (wgmma), BLOCK_N up to 256, deep pipelines (num_stages up to 6) and
  split-K for decode M. Split-K partials are float32; they are summed either by a second small
  kernel or, with `fused_reduce`, by the last split to finish each tile (a per-tile arrival
  counter; one launch; the sum runs in a fixed order, so the bits do not depend on timing).
- fused linear (`_fp8_linear_fused_kernel`): the tiled kernel with the 1x128 activation
  quantisation in its prologue, so a decode-M linear is one launch instead of two.
All apply the scales DeepGEMM's way: per 128-wide K block, in float32 registers,
acc += dot(a_kb, w_kb^T) * a_s[:, None] * w_s[None, :].

Operand conventions are those of ops/fp8/recipe.py: a (M, K) fp8 with a_scale (M, KB) (any
strides), w (N, K) fp8 with w_scale (NB, KB), decoding scales, KB = ceil(K/128), NB = ceil(N/128).
Ragged M/N/K are masked (zero fill), which is exactly the reference's ragged-trailing-block rule
(the tuning candidates that no table entry selects, a persistent TMA kernel and a lagged scaling
loop, are bench/kernels/triton_gemm_variants.py).

Dispatch table: fp8_configs.json next to this file (or $RELAY_FP8_CONFIGS), measured from
CUDA-graph timings on the H200 and H100 (docs/fp8.md, "The table"): per (M bucket, N, K) the fastest verified
option among our Triton configs, cuBLAS block-wise ("torch") and, on Hopper at large M, our
warp-specialised CUDA kernel ("cuda": ops/fp8/cuda/fp8_wgmma.cu), and whether the whole linear is faster
with the fused quantiser; per grouped (rows per expert, N, K) the grouped kernel's tiles.
`tuned_choice` / `tuned_linear_fused` / `tuned_grouped` read it; `pick_config` is the heuristic
for shapes it does not list (ops/fp8/dispatch.py's "auto").

CPU: runs under TRITON_INTERPRET=1 (tests/test_fp8_linear.py, tests/test_fp8_tuning.py). Known
interpreter defect (triton 3.9): its fp32 -> float8e4nv conversion sometimes loses a round-up
(e.g. -125.48 -> -64 instead of -128), in ~3% of elements, so the quantiser's bits are checked
exactly only on the GPU; its scales match exactly on CPU. The
interpreter's fp32 -> bf16 conversion truncates (the GPU rounds to nearest), so CPU tests compare
float32 outputs.

Accuracy on the GPU (H200): BLOCK_M >= 64 lowers tl.dot to Hopper wgmma, whose fp8
accumulation keeps ~14 bits within an instruction chain, so each 128-wide block product errs by
~2^-13 relative (1.27e-4 Frobenius vs the exact fp32 reference); BLOCK_M 16/32 (mma.sync)
accumulate in full fp32 (1e-7). Promoting to fp32 every 128 K, as here, is what bounds it
(DeepSeek-V3's recipe); the GPU self-checks and the table's tuning assert those bounds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

try:  # triton is a hard dependency (torchtitan imports it), but keep CPU-only installs importable.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
AMAX_EPS = 1e-12  # same as ops/fp8/recipe.py: an all-zero block gets scale 1e-12 / 448
NUM_SMS_DEFAULT = 132  # H200; the real count is read from the device when there is one


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration. BLOCK_K is fixed at 128 = the scale block (one scale per K step).
    Field order is positional: (block_m, block_n, split_k, group_m,
    num_warps, num_stages)."""

    block_m: int = 64
    block_n: int = 128
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    # split-K partials summed by the last split of each tile (one launch) instead of a 2nd kernel
    fused_reduce: bool = False

    def __post_init__(self) -> None:
        for f in ("block_m", "block_n"):
            v = getattr(self, f)
            if v < 16 or v > 256 or v & (v - 1):
                raise ValueError(f"GemmConfig.{f} must be a power of two in [16, 256], got {v}")
        if (
            self.split_k < 1
            or self.group_m < 1
            or self.num_stages < 1
            or self.num_warps not in (1, 2, 4, 8, 16)
        ):
            raise ValueError(f"GemmConfig: bad split_k/group_m/num_stages/num_warps in {self}")

    def name(self) -> str:
        tail = "_fr" if self.fused_reduce else ""
        return (
            f"m{self.block_m}n{self.block_n}k128_s{self.split_k}_g{self.group_m}"
            f"_w{self.num_warps}_st{self.num_stages}" + tail
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def device_index(device: torch.device) -> int:
    """A CUDA device's ordinal ("cuda" without one: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device_index(device))
    return NUM_SMS_DEFAULT


@functools.cache
def _cuda_sms(index: int) -> int:
    # Cached: get_device_properties costs host time on every decode-step GEMM otherwise.
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_config(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT) -> GemmConfig:
    """Heuristic for shapes outside the tuned table, shaped by H200 measurements:
    at M <= 256 one 64-row wgmma warpgroup (the GEMM streams the weight once, so idle rows cost
    nothing), 4 warps; BLOCK_N 128 when that still gives >= a quarter of the SMs tiles, else 64;
    split-K 2 only when even that leaves most SMs idle over a long K, summed in-kernel
    (fused_reduce: no second launch). Large M: 128x128
    tiles, 8 warps; fp8_linear's "auto" sends unseen large M to cuBLAS anyway (TRITON_MAX_M)."""
    kb = _cdiv(k, BLOCK)
    if m > 256:
        return GemmConfig(block_m=128, block_n=128, split_k=1, group_m=8, num_warps=8, num_stages=3)
    tiles_m = _cdiv(m, 64)
    block_n = 128 if tiles_m * _cdiv(n, 128) >= num_sms // 4 else 64
    tiles = tiles_m * _cdiv(n, block_n)
    # Split 4 at 64 x 2048 x 7168 (two-kernel reduction, eager) lost to unsplit, so only a long K
    # over very few tiles splits; the table decides for measured shapes.
    split = 2 if tiles < num_sms // 4 and kb >= 16 else 1
    return GemmConfig(
        block_m=64,
        block_n=block_n,
        split_k=split,
        group_m=1,
        num_warps=4,
        num_stages=4,
        fused_reduce=split > 1,
    )


def candidate_configs(m: int, n: int, k: int, num_sms: int = NUM_SMS_DEFAULT) -> list[GemmConfig]:
    """A small sweep around the heuristic (for sweeping a shape the table does not list; the table
    itself comes from a full grid)."""
    base = pick_config(m, n, k, num_sms)
    out = [base]
    kb = _cdiv(k, BLOCK)
    if m > 256:
        out += [
            GemmConfig(128, 128, 1, 8, 8, 3),
            GemmConfig(128, 128, 1, 8, 8, 4),
            GemmConfig(128, 256, 1, 8, 8, 3),
            GemmConfig(256, 128, 1, 8, 8, 3),
        ]
    else:
        for bm in (16, 32, 64):
            for bn in (64, 128, 256):
                for split in (1, 2, 4, 8):
                    if kb // split >= 2:
                        out.append(GemmConfig(bm, bn, split, 1, 4, 4, fused_reduce=split > 1))
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------ the tuned table (JSON)

TORCH = "torch"
CUDA = "cuda"  # ops/fp8/cuda/fp8_wgmma.py's dense GEMM (sm_90, nvcc-built at first use)
TABLE_PATH = Path(__file__).with_name("fp8_configs.json")
TABLE_ENV = "RELAY_FP8_CONFIGS"  # another table file (tune.py's fresh output, tests)


class TableConfig(BaseModel):
    """A GemmConfig as stored in the table file (same defaults as GemmConfig)."""

    model_config = ConfigDict(extra="forbid")
    block_m: int
    block_n: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    fused_reduce: bool = False

    def gemm(self) -> GemmConfig:
        return GemmConfig(**self.model_dump())

    @classmethod
    def of(cls, cfg: GemmConfig) -> TableConfig:
        return cls(**dataclasses.asdict(cfg))


class DenseEntry(BaseModel):
    """The measured winner for (M bucket, N, K). `choice` "torch" = cuBLAS block-wise; "cuda" = our
    CUDA kernel (ops/fp8/cuda/fp8_wgmma.py); "triton" = `config`. `linear` "fused": the whole linear (quantise + GEMM) was faster as one fused launch
    with `fused_config` than as the quantiser + `choice` (tune.py times both)."""

    model_config = ConfigDict(extra="forbid")
    m: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    choice: Literal["triton", "torch", "cuda"]
    config: TableConfig | None = None
    linear: Literal["separate", "fused"] = "separate"
    fused_config: TableConfig | None = None
    us: dict[str, float] = {}  # GPU microseconds of the contenders (graph replays), informational
    source: str = ""  # which run measured it


class GroupedEntry(BaseModel):
    """Grouped MoE GEMM tiles for (rows per expert, N, K); E and T are what was timed."""

    model_config = ConfigDict(extra="forbid")
    rows_per_expert: float = Field(gt=0)
    e: int = Field(gt=0)
    t: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    block_m: int
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 4
    us: dict[str, float] = {}
    source: str = ""


class Fp8Table(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Literal[1] = 1
    m_buckets: list[int]
    dense: list[DenseEntry] = []
    grouped: list[GroupedEntry] = []
    notes: str = ""


def table_path() -> Path:
    return Path(os.environ.get(TABLE_ENV) or TABLE_PATH)


def load_table(path: Path | str | None = None) -> Fp8Table:
    """The table file, validated (a bad file is an error naming the field, not a silent
    fallback); a missing file is an empty table (every shape then takes the heuristic)."""
    p = Path(path) if path is not None else table_path()
    if not p.exists():
        return Fp8Table(m_buckets=[])
    table = Fp8Table.model_validate(json.loads(p.read_text()))
    for e in table.dense:
        if e.m not in table.m_buckets:
            raise ValueError(f"{p}: dense entry m={e.m} is not in m_buckets {table.m_buckets}")
        if e.choice == "triton" and e.config is None:
            raise ValueError(f"{p}: dense entry {(e.m, e.n, e.k)} chooses triton without a config")
        if e.linear == "fused" and e.fused_config is None:
            raise ValueError(f"{p}: dense entry {(e.m, e.n, e.k)} has linear=fused without fused_config")
    return table


def _dense_dicts(
    table: Fp8Table,
) -> tuple[
    tuple[int, ...], dict[tuple[int, int, int], GemmConfig | str], dict[tuple[int, int, int], GemmConfig]
]:
    choices: dict[tuple[int, int, int], GemmConfig | str] = {}
    fused: dict[tuple[int, int, int], GemmConfig] = {}
    for e in table.dense:
        key = (e.m, e.n, e.k)
        choices[key] = e.config.gemm() if e.choice == "triton" else e.choice  # type: ignore[union-attr]
        if e.linear == "fused" and e.fused_config is not None:
            fused[key] = e.fused_config.gemm()
    return tuple(sorted(set(table.m_buckets))), choices, fused


# Module state, (re)loaded by reload_table(): M_BUCKETS, TUNED_CONFIGS ((M bucket, N, K) ->
# GemmConfig | TORCH | CUDA), TUNED_FUSED ((M bucket, N, K) -> fused-linear config), TUNED_GROUPED.
M_BUCKETS: tuple[int, ...] = ()
TUNED_CONFIGS: dict[tuple[int, int, int], GemmConfig | str] = {}
TUNED_FUSED: dict[tuple[int, int, int], GemmConfig] = {}
TUNED_GROUPED: list[GroupedEntry] = []


def reload_table(path: Path | str | None = None) -> Fp8Table:
    """Load the table file into the module's lookup dicts (in place, so importers that bound the
    dicts see the new contents)."""
    global M_BUCKETS
    table = load_table(path)
    buckets, choices, fused = _dense_dicts(table)
    M_BUCKETS = buckets
    TUNED_CONFIGS.clear()
    TUNED_CONFIGS.update(choices)
    TUNED_FUSED.clear()
    TUNED_FUSED.update(fused)
    TUNED_GROUPED[:] = table.grouped
    return table


def m_bucket(m: int) -> int | None:
    """The smallest M_BUCKETS entry >= m; above the largest, the largest (a large-M winner keeps
    winning as M grows: more tiles of the same shape). None only for an empty table."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1] if M_BUCKETS else None


def tuned_choice(m: int, n: int, k: int) -> GemmConfig | str | None:
    """The table's GEMM entry for this shape: a GemmConfig, TORCH, CUDA, or None (not measured)."""
    b = m_bucket(m)
    return None if b is None else TUNED_CONFIGS.get((b, n, k))


def tuned_linear_fused(m: int, n: int, k: int) -> GemmConfig | None:
    """The fused quantise+GEMM config when the table measured it faster for the whole linear."""
    b = m_bucket(m)
    return None if b is None else TUNED_FUSED.get((b, n, k))


def tuned_grouped(t: int, e: int, n: int, k: int) -> GroupedEntry | None:
    """The grouped entry for this (N, K) whose rows per expert are nearest (log scale) to T/E,
    if within 4x; None otherwise (pick_grouped_block_m decides)."""
    per = max(t, 1) / max(e, 1)
    best: tuple[float, GroupedEntry] | None = None
    for g in TUNED_GROUPED:
        if (g.n, g.k) != (n, k):
            continue
        d = abs(math.log(per / g.rows_per_expert))
        if d <= math.log(4.0) and (best is None or d < best[0]):
            best = (d, g)
    return None if best is None else best[1]


reload_table()


if HAS_TRITON:
    # jit functions may read only constexpr globals.
    _C_FP8_MAX = tl.constexpr(FP8_MAX)
    _C_AMAX_EPS = tl.constexpr(AMAX_EPS)

    @triton.jit
    def _scale_of(amax, POW2: tl.constexpr):
        """The decoding scale of ops/fp8/recipe._scale_from_amax: IEEE amax / 448 (div_rn), or
        its power-of-two ceiling taken on the bits (exact; log2 on the GPU is approximate: keep the
        exponent, bump it when any mantissa bit is set; amax >= 1e-12 keeps the scale normal)."""
        s = tl.math.div_rn(tl.maximum(amax, _C_AMAX_EPS), _C_FP8_MAX)
        if POW2:
            bits = s.to(tl.int32, bitcast=True)
            up = tl.where((bits & 0x007FFFFF) != 0, (bits & 0x7F800000) + 0x00800000, bits & 0x7F800000)
            s = up.to(tl.float32, bitcast=True)
        return s

    @triton.jit
    def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped (swizzled) tile order: GROUP_M row tiles share each weight column tile while
        it is in L2."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (pid % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m
        return pid_m, pid_n

    @triton.jit
    def _store_or_reduce(
        acc,
        rm,
        rn,
        M,
        N,
        c_ptr,
        stride_cs,
        stride_cm,
        stride_cn,
        out_ptr,
        cnt_ptr,
        tile,
        pid_k,
        SPLIT_K: tl.constexpr,
        FUSED_REDUCE: tl.constexpr,
    ):
        """Epilogue. Without FUSED_REDUCE: c[pid_k] = acc (SPLIT_K > 1: float32 partials for
        _splitk_reduce_kernel). With it: store this split's partial, then bump the tile's arrival
        counter; the split that arrives last sums all SPLIT_K partials in split order (the same
        bits whichever split is last, and the same as the two-kernel path), writes `out`, and
        resets the counter to 0 for the next launch. No program ever waits on another, so any
        launch order is safe."""
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        c_ptrs = c_ptr + pid_k * stride_cs + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        if FUSED_REDUCE:
            tl.store(c_ptrs, acc, mask=mask)
            # Every thread's partial is issued before the counter's release (acq_rel atomic).
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros_like(acc)
                p_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
                for s in range(SPLIT_K):
                    # .cg: read at L2, never a stale L1 line of another SM's partial
                    total += tl.load(p_ptrs + s * stride_cs, mask=mask, other=0.0, cache_modifier=".cg")
                o_ptrs = out_ptr + rm[:, None] * N + rn[None, :]
                tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile, 0)
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["stride_wsn", "stride_cs"])
    def _fp8_gemm_kernel(
        a_ptr,
        as_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        out_ptr,
        cnt_ptr,
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
        FUSED_REDUCE: tl.constexpr,
    ):
        """C[pid_k] (M, N) = sum over this split's K blocks of scaled fp8 block products
        (SPLIT_K > 1: float32 partials, reduced in-kernel with FUSED_REDUCE or by
        _splitk_reduce_kernel; deterministic either way, unlike atomic accumulation)."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

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

        _store_or_reduce(
            acc, rm, rn, M, N, c_ptr, stride_cs, stride_cm, stride_cn, out_ptr, cnt_ptr, pid, pid_k,
            SPLIT_K, FUSED_REDUCE,
        )  # fmt: skip

    @triton.jit
    def _div_exact(x, s):
        """The correctly rounded x / s (what div_rn gives), s a scale per row, column or tile in a
        shape that broadcasts against x: one div_rn per scale (y = 1 / s), then Markstein's
        correction (see _quant_block), three multiply-adds instead of a division per element,
        which made the quantisers compute-bound (measured: the one-pass x/x^T quantiser ran
        1.7x slower than the two passes with a div_rn per element)."""
        y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        q0 = x * y
        return tl.fma(tl.fma(-q0, s, x), y, q0)

    @triton.jit
    def _quant_block(x, POW2: tl.constexpr):
        """(R, 128) float32 -> (fp8-range float32 values, (R,) decoding scales), the bits of
        _quant_act_kernel / ops.fp8.recipe.quantize_act: scale = amax / 448 (IEEE quotient,
        or its power-of-two ceiling), q = RN(x / scale) clamped to +-448. The per-element
        division is done as Markstein's correction of a reciprocal multiply: with y = RN(1/s)
        (one div_rn per row) and q0 = RN(x*y), r = fma(-q0, s, x) is exact and RN(q0 + r*y) is
        the correctly rounded x/s (Handbook of Floating-Point Arithmetic, Markstein's theorem; no
        overflow here, |x/s| <= 448, and quotients in fp32's subnormal range round to fp8 zero
        either way). Run 2: one div_rn per element made the fused kernel 4-9x slower than the
        two-kernel linear (linear_fp8_fused_graph 0.11-0.28x bf16)."""
        s = _scale_of(tl.max(tl.abs(x), axis=1), POW2)
        return tl.clamp(_div_exact(x, s[:, None]), -_C_FP8_MAX, _C_FP8_MAX), s

    @triton.jit(do_not_specialize=["stride_wsn", "stride_cs"])
    def _fp8_linear_fused_kernel(
        x_ptr,
        w_ptr,
        ws_ptr,
        c_ptr,
        out_ptr,
        cnt_ptr,
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
        FUSED_REDUCE: tl.constexpr,
    ):
        """_fp8_gemm_kernel with the 1x128 activation quantisation fused in: each K step loads the
        high-precision (BLOCK_M, 128) activation block, quantises it in registers with the
        quantiser's exact arithmetic (_quant_block: same bits), and feeds the fp8 dot. Saves the
        quantiser's launch and its HBM round trip at decode-sized M, at the price of every N tile
        re-quantising its rows (from L2)."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m, pid_n = _tile_ids(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

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
            q, a_s = _quant_block(x, POW2)
            a = q.to(w_ptr.dtype.element_ty)
            w = tl.load(w_ptrs, mask=rk[:, None] < k_left, other=0.0)
            w_s = tl.load(ws_ptrs)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            ws_ptrs += stride_wsk

        _store_or_reduce(
            acc, rm, rn, M, N, c_ptr, stride_cs, stride_cm, stride_cn, out_ptr, cnt_ptr, pid, pid_k,
            SPLIT_K, FUSED_REDUCE,
        )  # fmt: skip

    @triton.jit
    def _splitk_reduce_kernel(p_ptr, c_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """c (M*N, out dtype) = sum over the SPLIT_K float32 partials, in a fixed order."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["stride_wse", "stride_wsn", "E"])
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
        power-of-two ceiling), q = x / scale, correctly rounded (_div_exact) so the bits equal
        ops/fp8/recipe.quantize_act. A (ROWS, 128) tile per program, not one row: with
        one 128-element program per (row, block) the quantiser cost more than the GEMM
        (e.g. M = 4096, K = 2048: whole linear 0.39x bf16 against 1.34x for the GEMM alone)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        kb = tl.program_id(1)
        cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols[None, :] < K)
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        scale = _scale_of(tl.max(tl.abs(x), axis=1), POW2)
        q = tl.clamp(_div_exact(x, scale[:, None]), -_C_FP8_MAX, _C_FP8_MAX)
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


# Split-K arrival counters (fused_reduce), one zeroed int32 buffer per (device, stream): every
# launch leaves its counters at 0 again, so the buffer is reused without a memset per call (and a
# CUDA graph can replay it). Per stream because two GEMMs in flight on different streams must not
# share counters. Allocate outside graph capture: the first call of a shape is a warm-up anyway.
_COUNTERS: dict[tuple[str, int | None, int], torch.Tensor] = {}


def _tile_counters(device: torch.device, n_tiles: int) -> torch.Tensor:
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n_tiles:
        buf = torch.zeros(max(n_tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def _split_outputs(
    m: int, n: int, split: int, fused_reduce: bool, out: torch.Tensor, n_tiles: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c3, out, counters): where the kernel writes. One split writes `out` directly; more write
    float32 partials (split, M, N) that the fused epilogue or _splitk_reduce_kernel sums."""
    if split == 1:
        return out.unsqueeze(0), out, out  # counters unused
    c = torch.empty(split, m, n, dtype=torch.float32, device=out.device)
    cnt = _tile_counters(out.device, n_tiles) if fused_reduce else c
    return c, out, cnt


def _finish_split(c3: torch.Tensor, out: torch.Tensor, m: int, n: int, split: int, fused: bool) -> None:
    if split > 1 and not fused:
        rblock = 1024
        _splitk_reduce_kernel[(_cdiv(m * n, rblock),)](c3, out, m * n, SPLIT_K=split, BLOCK=rblock)


def triton_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """out (M, N) = dequant(a) @ dequant(w).T, float32 accumulation per 128-wide K block, with the
    kernel `config` names (module docstring); None: pick_config."""
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
    fused = cfg.fused_reduce and split > 1
    n_tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    c3, out, cnt = _split_outputs(m, n, split, fused, out, n_tiles)
    _fp8_gemm_kernel[(n_tiles, split)](
        a,
        a_scale,
        w,
        w_scale,
        c3,
        out,
        cnt,
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
        FUSED_REDUCE=fused,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _finish_split(c3, out, m, n, split, fused)
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
    GEMM (one launch; two with split-K without fused_reduce). Same bits as triton_quantize_act +
    triton_fp8_gemm with the same config."""
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
    fused = cfg.fused_reduce and split > 1
    n_tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    c3, out, cnt = _split_outputs(m, n, split, fused, out, n_tiles)
    _fp8_linear_fused_kernel[(n_tiles, split)](
        x,
        w,
        w_scale,
        c3,
        out,
        cnt,
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
        FUSED_REDUCE=fused,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _finish_split(c3, out, m, n, split, fused)
    return out


def pick_grouped_block_m(t: int, e: int) -> int:
    """Rows per tile for the grouped kernel when the table has no entry: about the mean rows per
    expert, 16..64."""
    per = max(1, t // max(1, e))
    # On the H200 16 was best at decode (8 rows per expert); at prefill (512 per expert) 64 beat
    # 128 by 15-17% (1.78 vs 2.09 ms, 0.96 vs 1.12 ms), so 64 is the ceiling.
    return 16 if per <= 16 else 32 if per <= 32 else 64


def grouped_launch(
    t: int,
    e: int,
    n: int,
    k: int,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for a grouped GEMM: explicit arguments, else the
    tuned table's nearest entry (tuned_grouped), else the heuristic."""
    hit = tuned_grouped(t, e, n, k) if block_m is None else None
    bm = block_m or (hit.block_m if hit else pick_grouped_block_m(t, e))
    bn = block_n or (hit.block_n if hit else 128)
    warps = num_warps or (hit.num_warps if hit else (8 if bm >= 128 else 4))
    stages = num_stages or (hit.num_stages if hit else 4)
    return bm, bn, warps, stages


def triton_grouped_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """MoE grouped GEMM, one launch: a (T, K) rows sorted by expert, w (E, N, K), w_scale
    (E, NB, KB), offs (E,) int32 cumulative end offsets on a's device. Returns (T, N). Tiles:
    grouped_launch. Offsets are not validated here (that would need a host sync);
    ops.fp8.recipe does."""
    _require_triton()
    _check(a, a_scale, w, w_scale)
    t, k = a.shape
    e, n, _ = w.shape
    out = torch.empty(t, n, dtype=out_dtype, device=a.device)
    if t == 0 or n == 0 or e == 0:
        return out
    bm, bn, warps, stages = grouped_launch(t, e, n, k, block_m, block_n, num_warps, num_stages)
    offs = offs.to(device=a.device, dtype=torch.int32).contiguous()
    a_scale, w_scale = a_scale.float(), w_scale.float()
    grid = (_cdiv(t, bm) + e, _cdiv(n, bn))
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
        BLOCK_N=bn,
        BLOCK_K=BLOCK,
        num_warps=warps,
        num_stages=stages,
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
