"""The Triton FP8 GEMM's tuning candidates that the dispatch table does not select: the persistent
"tma" kernel (one program per SM looping over tiles in grouped order for L2 reuse, operands through
TMA tensor descriptors, optional Triton warp specialisation of the tile loop) and the `lag` loop
(block kb-1's scaling issued after block kb's dot, so Hopper's async wgmma result is not consumed
in the iteration that issues it). bench/fp8/tune.py and bench/fp8/gemm.py time them against the
product's kernels (ops/fp8/triton_gemm.py); a plain config runs the product kernel itself.

    cfg = VariantConfig(128, 256, 1, 8, 8, 3, kernel="tma", warp_spec=True)
    out = variant_fp8_gemm(aq, a_scale, wq, w_scale, torch.bfloat16, cfg)
"""

from __future__ import annotations

import dataclasses

import torch

from ops.fp8 import triton_gemm as kern
from ops.fp8.triton_gemm import BLOCK, GemmConfig

try:  # host-side TMA descriptors (triton >= 3.3); without them the "tma" kernel is unavailable
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TMA = kern.HAS_TRITON
except ImportError:  # pragma: no cover
    HAS_TMA = False

KERNELS: tuple[str, ...] = ("tiled", "tma")


@dataclasses.dataclass(frozen=True)
class VariantConfig(GemmConfig):
    """A GemmConfig plus the candidate-only options; with none of them set it is the product's."""

    lag: bool = False
    kernel: str = "tiled"  # "tiled" | "tma"
    warp_spec: bool = False  # "tma" only: tl.range(warp_specialize=True) over the tile loop

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernel not in KERNELS:
            raise ValueError(f"VariantConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.kernel == "tma" and (self.split_k != 1 or self.fused_reduce):
            raise ValueError("VariantConfig: the persistent tma kernel has no split-K")
        if self.lag and self.kernel == "tiled" and (self.split_k != 1 or self.fused_reduce):
            raise ValueError("VariantConfig: the tiled lag loop has no split-K")

    def name(self) -> str:
        tail = ("_lag" if self.lag else "") + ("_tma" if self.kernel == "tma" else "")
        return super().name() + tail + ("_ws" if self.warp_spec else "")

    def product(self) -> GemmConfig | None:
        """The product GemmConfig this is, or None for a candidate-only variant."""
        if self.lag or self.kernel != "tiled" or self.warp_spec:
            return None
        return GemmConfig(*(getattr(self, f.name) for f in dataclasses.fields(GemmConfig)))


def as_variant(cfg: GemmConfig) -> VariantConfig:
    if isinstance(cfg, VariantConfig):
        return cfg
    return VariantConfig(**dataclasses.asdict(cfg))


def supports(cfg: GemmConfig, m: int, n: int, k: int) -> bool:
    """Whether `cfg` can run this shape: TMA descriptors need 16-byte aligned row strides (fp8:
    K % 16 == 0) and the kernel's availability; the tiled kernels run anything."""
    if isinstance(cfg, VariantConfig) and cfg.kernel == "tma":
        return HAS_TMA and k % 16 == 0 and n % 16 == 0
    return True


if kern.HAS_TRITON:
    import triton
    import triton.language as tl

    from ops.fp8.triton_gemm import _tile_ids

    @triton.jit(do_not_specialize=["stride_wsn"])
    def _fp8_gemm_lag_kernel(
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
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """The product's tiled kernel (no split-K) with the scaling of block kb-1 issued after
        block kb's dot and before its result is needed; same products, same order."""
        pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (rm % M)[:, None] * stride_am + rk[None, :] * stride_ak
        w_ptrs = w_ptr + (rn % N)[None, :] * stride_wn + rk[:, None] * stride_wk
        as_ptrs = as_ptr + (rm % M) * stride_asm
        ws_ptrs = ws_ptr + ((rn % N) // BLOCK_K) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        prev_as = tl.zeros((BLOCK_M,), dtype=tl.float32)
        prev_ws = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
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
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(
            c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=mask,
        )

    @triton.jit(do_not_specialize=["stride_wsn", "NUM_PROGS"])
    def _fp8_gemm_tma_kernel(
        a_desc,
        w_desc,
        as_ptr,
        ws_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_asm,
        stride_ask,
        stride_wsn,
        stride_wsk,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        NUM_PROGS,
        LAG: tl.constexpr,
        WARP_SPEC: tl.constexpr,
    ):
        """Persistent (grid = #SMs, each program loops over output tiles in grouped order, so
        consecutive tiles of one SM and neighbouring SMs share weight tiles in L2), A and W tiles
        through TMA descriptors (out-of-range rows/cols/K come back as zeros, which is the ragged
        rule), block scales in float32 registers per K block."""
        start_pid = tl.program_id(0)
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        # warp_specialize is passed only when asked for: a Triton without it still runs the rest.
        if WARP_SPEC:
            for tile in tl.range(start_pid, num_tiles, NUM_PROGS, warp_specialize=True):
                _tma_tile(
                    tile, a_desc, w_desc, as_ptr, ws_ptr, c_ptr, M, N, K, stride_asm, stride_ask,
                    stride_wsn, stride_wsk, stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, LAG,
                )  # fmt: skip
        else:
            for tile in range(start_pid, num_tiles, NUM_PROGS):
                _tma_tile(
                    tile, a_desc, w_desc, as_ptr, ws_ptr, c_ptr, M, N, K, stride_asm, stride_ask,
                    stride_wsn, stride_wsk, stride_cm, stride_cn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, LAG,
                )  # fmt: skip

    @triton.jit
    def _tma_tile(
        tile,
        a_desc,
        w_desc,
        as_ptr,
        ws_ptr,
        c_ptr,
        M,
        N,
        K,
        stride_asm,
        stride_ask,
        stride_wsn,
        stride_wsk,
        stride_cm,
        stride_cn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        LAG: tl.constexpr,
    ):
        """One output tile of _fp8_gemm_tma_kernel (inlined into its tile loop)."""
        k_tiles = tl.cdiv(K, BLOCK_K)
        pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        as_ptrs = as_ptr + tl.minimum(rm, M - 1) * stride_asm
        ws_ptrs = ws_ptr + (tl.minimum(rn, N - 1) // BLOCK_K) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LAG:
            prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            prev_as = tl.zeros((BLOCK_M,), dtype=tl.float32)
            prev_ws = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for kb in range(0, k_tiles):
                a = a_desc.load([off_m, kb * BLOCK_K])
                w = w_desc.load([off_n, kb * BLOCK_K])
                a_s = tl.load(as_ptrs + kb * stride_ask)
                w_s = tl.load(ws_ptrs + kb * stride_wsk)
                d = tl.dot(a, w.T)
                acc += prev * prev_as[:, None] * prev_ws[None, :]  # 0 * 0 on the first step
                prev, prev_as, prev_ws = d, a_s, w_s
            acc += prev * prev_as[:, None] * prev_ws[None, :]
        else:
            for kb in range(0, k_tiles):
                a = a_desc.load([off_m, kb * BLOCK_K])
                w = w_desc.load([off_n, kb * BLOCK_K])
                a_s = tl.load(as_ptrs + kb * stride_ask)
                w_s = tl.load(ws_ptrs + kb * stride_wsk)
                acc += tl.dot(a, w.T) * a_s[:, None] * w_s[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def variant_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """kern.triton_fp8_gemm's contract for any config: a product config runs the product kernel,
    a variant its candidate kernel."""
    cfg = as_variant(config) if config is not None else None
    plain = None if cfg is None else cfg.product()
    if cfg is None or plain is not None:
        return kern.triton_fp8_gemm(a, a_scale, w, w_scale, out_dtype, plain)
    kern._require_triton()
    kern._check(a, a_scale, w, w_scale)
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    a_scale = a_scale.float()
    w_scale = w_scale.float()
    if cfg.kernel == "tma":
        _launch_tma(a, a_scale, w, w_scale, out, cfg)
        return out
    tiles = kern._cdiv(m, cfg.block_m) * kern._cdiv(n, cfg.block_n)
    _fp8_gemm_lag_kernel[(tiles,)](
        a, a_scale, w, w_scale, out, m, n, k, a.stride(0), a.stride(1), a_scale.stride(0),
        a_scale.stride(1), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), out.stride(1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _launch_tma(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    cfg: VariantConfig,
) -> None:
    m, k = a.shape
    n = w.shape[0]
    if not supports(cfg, m, n, k):
        raise ValueError(f"tma config {cfg.name()} cannot run ({m}, {n}, {k}): needs K, N % 16 == 0")
    # Host descriptors (passed by value: CUDA-graph safe, no device scratch allocator needed).
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, BLOCK])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, BLOCK])
    progs = min(kern.num_sms(a.device), kern._cdiv(m, cfg.block_m) * kern._cdiv(n, cfg.block_n))
    _fp8_gemm_tma_kernel[(progs,)](
        a_desc, w_desc, a_scale, w_scale, out, m, n, k, a_scale.stride(0), a_scale.stride(1),
        w_scale.stride(0), w_scale.stride(1), out.stride(0), out.stride(1), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, GROUP_M=cfg.group_m, NUM_PROGS=progs, LAG=cfg.lag,
        WARP_SPEC=cfg.warp_spec, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
