"""FP8 block-scaled quantisation and GEMMs, the DeepSeek-V3 recipe, CPU reference path.

Recipe: E4M3 (`torch.float8_e4m3fn`, max 448) values with float32 *decoding* scales, so that
``x ~= x_fp8.float() * scale``:

- activations: one scale per 1x128 block (each row split into 128-wide blocks along K),
  ``a_scale`` has shape ``(M, ceil(K/128))``;
- weights ``(N, K)`` (nn.Linear layout): one scale per 128x128 tile,
  ``w_scale`` has shape ``(ceil(N/128), ceil(K/128))``;
- ``scale = amax(block) / 448`` or, with ``pow2=True``, that value rounded *up* to a power of two
  (dequantisation and re-scaling are then exact in binary floating point).

Shapes that are not multiples of 128 are handled by *ragged trailing blocks*, never rejected:
the fp8 tensor keeps its original shape, and the last block along K (or the last tile along N)
simply covers fewer than 128 elements, with its own scale computed from those elements only.
This is the same as zero-padding to a multiple of 128 (zeros change neither the block max nor
the dot products), and the GPU path does exactly that padding before calling cuBLAS.

GEMMs: ``fp8_gemm`` computes ``out = dequant(a) @ dequant(w).T`` by accumulating, in float32,
one 128-wide K block at a time with both scales applied per block (what the Hopper kernels do);
``grouped_fp8_gemm`` does the same for MoE experts, one weight per contiguous group of rows.
With ``backend="auto"`` a CUDA input goes to ``torch.nn.functional.scaled_mm`` with
``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` (CI covers only the CPU reference path).
The engine and trainer reach these through ops/fp8/dispatch.py, which adds relay's Triton kernels
(ops/fp8/triton_gemm.py) and the CUDA one (ops/fp8/cuda/). See docs/fp8.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = 128
# A block of all zeros gets scale AMAX_EPS / 448 (any positive scale works: its values are all 0).
AMAX_EPS = 1e-12


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """Zero-pad dimension `dim` of x up to a multiple of `multiple` (no copy if already one)."""
    size = x.shape[dim]
    extra = _cdiv(size, multiple) * multiple - size
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def _scale_from_amax(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    # Divide by a 448 *tensor*: CUDA torch turns division by a Python scalar into a multiply by
    # its float32 reciprocal, which differs from the IEEE quotient in ~half the blocks (measured on
    # the H200: 1471 of 2664 scales), so the GPU reference disagreed with the CPU one and with the
    # Triton quantiser (div_rn). Tensor / tensor is the IEEE quotient on both devices.
    amax = amax.float().clamp(min=AMAX_EPS)
    scale = amax / torch.full_like(amax, FP8_MAX)
    if pow2:
        # Round up so |x / scale| <= 448 still holds; then the largest value lands in [224, 448].
        # Exactly, through the float's exponent: exp2(ceil(log2(s))) misses by one power for s a
        # hair above a power of two (float32 log2 rounds 2^k * (1 + 2^-23) to k). The Triton
        # quantiser does the same bit-exact rounding.
        mant, exp = torch.frexp(scale)  # scale = mant * 2^exp, mant in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), torch.where(mant == 0.5, exp - 1, exp))
    return scale


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    # Clamp first: float32 rounding of x / scale can land a hair above 448.
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_act(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-1x128 quantisation of x (..., K): returns (x_fp8 of x's shape, scale (..., ceil(K/128)))."""
    k = x.shape[-1]
    xp = _pad_to(x.float(), -1, BLOCK)
    blocks = xp.unflatten(-1, (-1, BLOCK))  # (..., KB, 128)
    scale = _scale_from_amax(blocks.abs().amax(dim=-1), pow2)
    q = _to_fp8(blocks / scale.unsqueeze(-1)).flatten(-2)[..., :k]
    return q.contiguous(), scale


def quantize_weight(w: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-128x128 quantisation of w (N, K): returns (w_fp8 (N, K), scale (ceil(N/128), ceil(K/128)))."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight expects a 2-D (N, K) weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    wp = _pad_to(_pad_to(w.float(), 0, BLOCK), 1, BLOCK)
    tiles = wp.view(wp.shape[0] // BLOCK, BLOCK, wp.shape[1] // BLOCK, BLOCK)  # (NB, 128, KB, 128)
    scale = _scale_from_amax(tiles.abs().amax(dim=(1, 3)), pow2)  # (NB, KB)
    q = _to_fp8(tiles / scale[:, None, :, None]).view_as(wp)[:n, :k]
    return q.contiguous(), scale


def quantize_weights(w: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight of each (N, K) matrix of a stacked (E, N, K) weight (MoE experts): returns
    (fp8 (E, N, K), scales (E, ceil(N/128), ceil(K/128))). With N a multiple of 128 no tile spans two
    experts, so it is one call over the (E*N, K) matrix."""
    e, n, k = w.shape
    if n % BLOCK == 0:
        q, s = quantize_weight(w.reshape(e * n, k), pow2)
        return q.view(e, n, k), s.view(e, n // BLOCK, s.shape[-1])
    pairs = [quantize_weight(we, pow2) for we in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def quantize_act_t(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 quantisation of x^T for x (M, C): scales over 128 consecutive rows (tokens) of each
    column. Returns (q^T (C, M_pad) fp8, scale (C, M_pad / 128)), M_pad = M rounded up to 128 with
    zero columns: the operands of the FP8 weight-gradient GEMM, which contracts over tokens
    (fp8_gemm_tokens). DeepSeek-V3 quantises the backward's activations this way (128x1)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_act_t expects a 2-D (M, C) tensor, got shape {tuple(x.shape)}")
    return quantize_act(_pad_to(x.t().float(), 1, BLOCK), pow2)


def fp8_gemm_tokens_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """out (N, K) = sum over 128-token blocks t of a_scale[:, t] b_scale[:, t]^T * (a_t @ b_t^T), for
    a (N, T) and b (K, T) both quantised 1x128 along T (quantize_act_t): the weight gradient
    grad_out^T @ x with both operands in FP8. Float32 accumulation."""
    _check_token_gemm(a, a_scale, b, b_scale)
    af, bf = a.float(), b.float()
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)
    for t in range(a_scale.shape[1]):
        blk = slice(t * BLOCK, (t + 1) * BLOCK)
        out += (af[:, blk] @ bf[:, blk].T) * a_scale[:, t : t + 1].float() * b_scale[:, t].float()[None, :]
    return out.to(out_dtype)


def _check_token_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> None:
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise TypeError(f"fp8 GEMM wants {FP8_DTYPE} operands, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.shape[1] % BLOCK:
        raise ValueError(
            f"token GEMM wants a (N, T) and b (K, T) with T a multiple of {BLOCK}, "
            f"got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    tb = a.shape[1] // BLOCK
    if tuple(a_scale.shape) != (a.shape[0], tb) or tuple(b_scale.shape) != (b.shape[0], tb):
        raise ValueError(
            f"token GEMM scales want {(a.shape[0], tb)} and {(b.shape[0], tb)}, "
            f"got {tuple(a_scale.shape)} and {tuple(b_scale.shape)}"
        )


def fp8_gemm_tokens(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
) -> torch.Tensor:
    """fp8_gemm_tokens_reference's function; on CUDA torch's block-wise scaled_mm with 1x128 scales
    on both operands (cuBLAS: the left one's along its rows, the right one's "128x1" along its
    columns, both scale tensors (rows, T/128) and outer-dimension-major)."""
    _check_token_gemm(a, a_scale, b, b_scale)
    if not _use_gpu(backend, a):
        return fp8_gemm_tokens_reference(a, a_scale, b, b_scale, out_dtype)
    n, k = a.shape[0], b.shape[0]
    # cuBLAS reads the left operand's scales in groups of 4 rows: pad N to 4 (zero rows).
    a_p = _pad_to(a.view(torch.uint8), 0, 4).view(FP8_DTYPE)
    sa = a_scale.float()
    if n % 4:
        sa = _pad_to(sa, 0, 4)
    out = F.scaled_mm(
        a_p.contiguous(),
        b.contiguous().t(),
        _outer_major(sa),
        F.ScalingType.BlockWise1x128,
        _outer_major(b_scale.float()),  # (K, TB), as the left one's (H200: not its transpose)
        F.ScalingType.BlockWise1x128,
        output_dtype=out_dtype,
    )
    return out[:n, :k]


def dequantize_act(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_act, in float32."""
    k = q.shape[-1]
    return (q.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :k]).contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_weight, in float32; also for stacked (E, N, K) weights with (E, NB, KB)
    scales (MoE experts quantised per expert)."""
    n, k = q.shape[-2:]
    s = scale.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return q.float() * s


def _check_gemm_shapes(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> None:
    if a.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise TypeError(f"fp8 GEMM wants {FP8_DTYPE} operands, got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"fp8 GEMM wants a (M, K) and w (N, K), got {tuple(a.shape)} and {tuple(w.shape)}")
    m, k = a.shape
    n = w.shape[0]
    if tuple(a_scale.shape) != (m, _cdiv(k, BLOCK)):
        raise ValueError(f"a_scale shape {tuple(a_scale.shape)} != (M, ceil(K/128)) = {(m, _cdiv(k, BLOCK))}")
    want = (_cdiv(n, BLOCK), _cdiv(k, BLOCK))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} != (ceil(N/128), ceil(K/128)) = {want}")


def fp8_gemm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """out (M, N) = sum over K blocks kb of a_scale[:, kb] * w_scale[n // 128, kb] * (a_kb @ w_kb.T),
    float32 accumulation; equal to dequantize_act(a) @ dequantize_weight(w).T up to float32 rounding."""
    _check_gemm_shapes(a, a_scale, w, w_scale)
    m, k = a.shape
    n = w.shape[0]
    af, wf = a.float(), w.float()
    sw = w_scale.float().repeat_interleave(BLOCK, dim=0)[:n]  # (N, KB): each row's tile scales
    out = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb in range(_cdiv(k, BLOCK)):
        blk = slice(kb * BLOCK, min(k, (kb + 1) * BLOCK))
        # Products of two E4M3 values are exact in float32; the block sum is a plain fp32 matmul.
        partial = af[:, blk] @ wf[:, blk].T
        out += partial * a_scale[:, kb : kb + 1].float() * sw[:, kb][None, :]
    return out.to(out_dtype)


def _scaled_mm_blockwise(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """torch's block-wise cuBLAS path (torch >= 2.11, Hopper). Layouts (checked on the H200):
    scale_a (M, K/128) column-major (strides (1, M)); scale_b
    (KB4, N/128) with strides (1, KB4), i.e. the transpose of a contiguous (N/128, KB4) tensor,
    where KB4 = ceil(K/128) rounded up to a multiple of 4: cuBLAS wants the weight's K-block
    count padded to 4 (otherwise "scale_b must have shape 12 x 8 ... got [11, 8]" at K = 1300).
    K and N are zero-padded to multiples of 128 and M to a multiple of 4 (the activation scales
    are read in groups of 4 rows); every pad is skipped (no copy) on aligned shapes."""
    m = a.shape[0]
    n = w.shape[0]
    # float8 has no pad kernel everywhere: pad through a uint8 view (fp8 zero is all-zero bits).
    a_p = _pad_to(_pad_to(a.view(torch.uint8), 1, BLOCK), 0, 4).view(FP8_DTYPE)
    w_p = _pad_to(_pad_to(w.view(torch.uint8), 1, BLOCK), 0, BLOCK).view(FP8_DTYPE)
    sa = a_scale.float()
    if m % 4:
        sa = _pad_to(sa, 0, 4)  # padded rows are zero: any scale, 0 is as good as 1
    sb = _pad_to(w_scale.float(), 1, 4)  # the extra K blocks multiply nothing; layout only
    out = F.scaled_mm(
        a_p.contiguous(),
        w_p.contiguous().t(),
        _outer_major(sa),  # the torch reference's are row-major, Triton's already column-major
        F.ScalingType.BlockWise1x128,
        sb.contiguous().t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=out_dtype,
    )
    return out[:m, :n]


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """The same (rows, blocks) scales stored outer-dimension-major (stride(0) == 1), the layout
    cuBLAS's block-wise scaled_mm wants for 1x128 scales; no copy when they already are."""
    return scale if scale.stride(0) == 1 else scale.t().contiguous().t()


def _use_gpu(backend: str, a: torch.Tensor) -> bool:
    if backend == "reference":
        return False
    gpu_ok = a.is_cuda and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
    if backend == "torch":
        if not gpu_ok:
            raise RuntimeError("backend='torch' needs CUDA tensors and torch.nn.functional.scaled_mm")
        return True
    if backend != "auto":
        raise ValueError(f"unknown fp8 backend {backend!r}: 'auto', 'reference' or 'torch'")
    return gpu_ok


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Block-scaled FP8 GEMM: (a (M, K) fp8, a_scale 1x128) @ (w (N, K) fp8, w_scale 128x128)^T.

    backend: "reference" (float32 block accumulation, any device; what CI tests), "torch"
    (torch.nn.functional.scaled_mm block-wise, CUDA only; checked against the reference on the
    H200), or "auto" (torch
    on CUDA when available, else reference)."""
    _check_gemm_shapes(a, a_scale, w, w_scale)
    if _use_gpu(backend, a):
        return _scaled_mm_blockwise(a, a_scale, w, w_scale, out_dtype)
    return fp8_gemm_reference(a, a_scale, w, w_scale, out_dtype)


def group_offsets(group_sizes: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Group sizes -> cumulative *end* offsets (int32), the `offs` convention of torch's grouped mm."""
    sizes = torch.as_tensor(group_sizes, dtype=torch.int64)
    return torch.cumsum(sizes, 0).to(torch.int32)


def grouped_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor | Sequence[int],
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """MoE grouped GEMM: rows of a (T, K) are sorted by expert; expert e owns rows
    [offs[e-1], offs[e]) (offs: cumulative end offsets, len E, offs[-1] == T) and multiplies them
    by w[e] (w: (E, N, K) fp8, w_scale: (E, ceil(N/128), ceil(K/128))). Returns (T, N).
    Empty groups are allowed. The reference path is one fp8_gemm per expert (a Triton grouped
    kernel is the GPU path; "torch" here loops scaled_mm per expert: cuBLAS fails with
    CUBLAS_STATUS_NOT_SUPPORTED on groups of 1-42 rows, hence the M padding to 4 above)."""
    if w.dim() != 3 or w_scale.dim() != 3 or w.shape[0] != w_scale.shape[0]:
        raise ValueError(
            f"grouped weights want (E, N, K) + (E, NB, KB), got {tuple(w.shape)}, {tuple(w_scale.shape)}"
        )
    ends = [int(x) for x in torch.as_tensor(offs).tolist()]
    if len(ends) != w.shape[0]:
        raise ValueError(f"{len(ends)} offsets for {w.shape[0]} experts")
    if any(e1 < e0 for e0, e1 in zip([0] + ends, ends, strict=False)) or (ends and ends[-1] != a.shape[0]):
        raise ValueError(
            f"offs must be non-decreasing cumulative ends with offs[-1] == {a.shape[0]}, got {ends}"
        )
    out = torch.empty(a.shape[0], w.shape[1], dtype=out_dtype, device=a.device)
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = fp8_gemm(a[start:end], a_scale[start:end], w[e], w_scale[e], out_dtype, backend)
        start = end
    return out


class Fp8Linear(nn.Module):
    """nn.Linear whose weight is stored as E4M3 with 128x128 scales (quantised from a high-precision
    weight at construction / load_weight time); forward quantises activations per 1x128 and runs
    fp8_gemm. Inference only: the weight is a buffer, there is no backward."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        out_dtype: torch.dtype = torch.float32,
        pow2_scales: bool = False,
        backend: str = "auto",
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_dtype, self.pow2_scales, self.backend = out_dtype, pow2_scales, backend
        nb, kb = _cdiv(out_features, BLOCK), _cdiv(in_features, BLOCK)
        self.register_buffer(
            "weight_fp8", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device)
        )
        self.register_buffer("weight_scale", torch.ones(nb, kb, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=out_dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, pow2_scales: bool = False, backend: str = "auto") -> Fp8Linear:
        w = linear.weight
        mod = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            out_dtype=w.dtype,
            pow2_scales=pow2_scales,
            backend=backend,
            device=w.device,
        )
        mod.load_weight(w, linear.bias)
        return mod

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """(Re)quantise from a high-precision (N, K) weight, in place (a weight update)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        q, s = self.quantize(weight.to(self.weight_fp8.device))
        self.weight_fp8.copy_(q)
        self.weight_scale.copy_(s)
        if bias is not None:
            if self.bias is None:
                raise ValueError("this Fp8Linear has no bias")
            self.bias.copy_(bias)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """128x128 quantisation of a weight for this layer (subclasses may run it faster)."""
        return quantize_weight(weight, self.pow2_scales)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_weight(self.weight_fp8, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, xs = quantize_act(x.reshape(-1, self.in_features), self.pow2_scales)
        out = fp8_gemm(xq, xs, self.weight_fp8, self.weight_scale, self.out_dtype, self.backend)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)  # GPU path: N-sliced, not contiguous

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"pow2_scales={self.pow2_scales}, backend={self.backend!r}"
        )


# Module-name components kept in high precision: output head, MoE router ("gate" in DeepSeek/GLM,
# "router" elsewhere). Embeddings and norms are not nn.Linear, so they are never converted anyway.
DEFAULT_SKIP = ("lm_head", "gate", "router", "embed_tokens", "norm")


def default_skip(name: str) -> bool:
    parts = name.split(".")
    return any(p in DEFAULT_SKIP for p in parts) or "embed" in name or "norm" in parts[-1]


def convert_to_fp8(
    model: nn.Module,
    skip: Callable[[str], bool] = default_skip,
    pow2_scales: bool = False,
    backend: str = "auto",
    linear_cls: type[Fp8Linear] = Fp8Linear,
    empty: bool = False,
) -> list[str]:
    """Replace, in place, every nn.Linear of `model` whose qualified name `skip` does not match by
    an Fp8Linear quantised from its current weight. Returns the converted names. By default
    lm_head, routers (`...gate`, `...router`), embeddings and norms stay in high precision;
    `gate_proj` (an MLP projection) is converted. `linear_cls`: the Fp8Linear (sub)class to build
    (the engine's services.engine.layers.fp8.Fp8Linear adds the GPU kernel dispatch). `empty`:
    build the Fp8Linears without quantising anything (their buffers hold no weight yet)."""
    targets = [
        (name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and not skip(name)
    ]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if empty:  # the layout only (e.g. on the meta device): weights are loaded into it later
            w = mod.weight
            new = linear_cls(
                mod.in_features,
                mod.out_features,
                mod.bias is not None,
                w.dtype,
                pow2_scales,
                backend,
                w.device,
            )
        else:
            new = linear_cls.from_linear(mod, pow2_scales=pow2_scales, backend=backend)
        setattr(parent, child, new)
    return [name for name, _ in targets]
