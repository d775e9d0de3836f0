"""Triton quantisers the FP8 trainer needs besides the 1x128 activation one (triton_gemm.py):

- `triton_quantize_weight`: 128x128 tiles of a (N, K) weight in one pass (the torch reference
  in ops/fp8/recipe.quantize_weight makes ~6 passes over a float32 copy), optionally also
  writing the transposed fp8 weight (K, N) that the FP8 dgrad GEMM reads, so the backward needs no
  transpose copy. The trainer re-quantises its master weights every step, and the engine on every
  weight update.
- `triton_quantize_act_t`: the 1x128 quantisation of x^T for x (M, C): scales over 128 consecutive
  *rows* (tokens) per column, written transposed as (C, M_pad) fp8 with M_pad = M rounded up to
  128 (zero columns). The FP8 weight-gradient GEMM contracts over tokens, so both of its operands
  (grad_out^T and x^T) are quantised this way (DeepSeek-V3's 128x1 backward quantisation).

- `triton_quantize_act_both`: both of the above activation quantisations of one x (M, C) in one
  pass: x 1x128 along C (what triton_gemm.triton_quantize_act writes) and x^T 1x128 along M (what
  `triton_quantize_act_t` writes). The FP8 trainer needs both of its input (forward GEMM, weight
  gradient) and of grad_out (dgrad, weight gradient); one pass reads x once and is one launch.

All round like the references (IEEE division `div_rn` for the scale; every element's quotient
correctly rounded too, by Markstein's exact correction of a reciprocal, fp8_gemm._div_exact;
round-to-nearest-even fp8), so their bits equal ops/fp8/recipe.py's on the GPU. The CPU
interpreter's fp8 conversion is faulty (triton_gemm.py's docstring), so CPU callers use the torch
references (ops/fp8/dispatch.py dispatches).
"""

from __future__ import annotations

import torch

from ops.fp8.recipe import BLOCK, FP8_DTYPE, _cdiv

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU-only installs
    HAS_TRITON = False


if HAS_TRITON:
    from ops.fp8.triton_gemm import _C_FP8_MAX, _div_exact, _scale_of

    @triton.jit
    def _quant_weight_kernel(
        w_ptr,
        q_ptr,
        qt_ptr,
        s_ptr,
        N,
        K,
        stride_wn,
        stride_sn,
        stride_we,
        stride_se,
        POW2: tl.constexpr,
        TRANSPOSED: tl.constexpr,
    ):
        """One 128x128 tile per program (axis 2: the expert of a stacked (E, N, K) weight): scale =
        amax / 448 over the tile, q = w / scale."""
        nb, kb, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        w_ptr += e * stride_we
        q_ptr += e * N * K
        qt_ptr += e * N * K
        s_ptr += e * stride_se
        rows = nb * 128 + tl.arange(0, 128)
        cols = kb * 128 + tl.arange(0, 128)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        rows64 = rows.to(tl.int64)
        w = tl.load(w_ptr + rows64[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = _scale_of(tl.max(tl.max(tl.abs(w), axis=1), axis=0), POW2)
        q = tl.clamp(_div_exact(w, s), -_C_FP8_MAX, _C_FP8_MAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q, mask=mask)
        if TRANSPOSED:
            # Stored as the transposed tile, so consecutive threads write consecutive bytes of a
            # row of W^T (Triton moves the tile through shared memory to get there).
            cols64 = cols.to(tl.int64)
            tl.store(qt_ptr + cols64[:, None] * N + rows[None, :], tl.trans(q), mask=tl.trans(mask))
        tl.store(s_ptr + nb * stride_sn + kb, s)

    @triton.jit
    def _quant_act_t_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        M,
        C,
        M_PAD,
        stride_xm,
        stride_sc,
        stride_sb,
        POW2: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        """128 rows x BLOCK_C columns of x per program: per column, scale = amax over the 128 rows
        / 448; q^T[c, m] = x[m, c] / scale, stored transposed (rows past M are zeros)."""
        mb, cb = tl.program_id(0), tl.program_id(1)
        rows = mb * 128 + tl.arange(0, 128)
        cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        mask = (rows[:, None] < M) & col_ok[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        s = _scale_of(tl.max(tl.abs(x), axis=0), POW2)
        q = tl.clamp(_div_exact(x, s[None, :]), -_C_FP8_MAX, _C_FP8_MAX)
        q = q.to(q_ptr.dtype.element_ty)
        # The padded rows (M <= m < M_PAD) are written too: zeros, as the reference's padding. The
        # transposed tile is stored so that consecutive threads write consecutive tokens.
        tl.store(
            q_ptr + cols.to(tl.int64)[:, None] * M_PAD + rows[None, :], tl.trans(q), mask=col_ok[:, None]
        )
        tl.store(s_ptr + cols * stride_sc + mb * stride_sb, s, mask=col_ok)

    @triton.jit
    def _quant_act_both_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        qt_ptr,
        st_ptr,
        M,
        C,
        M_PAD,
        stride_xm,
        stride_sm,
        stride_sk,
        stride_stc,
        stride_stb,
        POW2: tl.constexpr,
    ):
        """One 128 x 128 tile of x per program: quantised along its rows (scale per row over the
        128 columns, _quant_act_kernel's bits) and along its columns (scale per column over the
        128 rows, stored transposed: _quant_act_t_kernel's bits)."""
        mb, cb = tl.program_id(0), tl.program_id(1)
        rows = mb * 128 + tl.arange(0, 128)
        cols = cb * 128 + tl.arange(0, 128)
        row_ok = rows < M
        col_ok = cols < C
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        # Each quotient by _div_exact (one div_rn per row or column): with two div_rn per element
        # this pass was compute-bound, 1.7x slower than the two it replaces.
        ax = tl.abs(x)
        s = _scale_of(tl.max(ax, axis=1), POW2)
        q = _div_exact(x, s[:, None])
        q = tl.clamp(q, -_C_FP8_MAX, _C_FP8_MAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows64[:, None] * C + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * stride_sm + cb * stride_sk, s, mask=row_ok)
        st = _scale_of(tl.max(ax, axis=0), POW2)
        qt = _div_exact(x, st[None, :])
        qt = tl.clamp(qt, -_C_FP8_MAX, _C_FP8_MAX).to(qt_ptr.dtype.element_ty)
        # Rows M <= m < M_PAD are written too (zeros), as in _quant_act_t_kernel.
        tl.store(
            qt_ptr + cols.to(tl.int64)[:, None] * M_PAD + rows[None, :], tl.trans(qt), mask=col_ok[:, None]
        )
        tl.store(st_ptr + cols * stride_stc + mb * stride_stb, st, mask=col_ok)


def triton_quantize_weight(
    w: torch.Tensor, pow2: bool = False, transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(N, K) weight -> (fp8 (N, K), scales (NB, KB), fp8 (K, N) contiguous or None): the bits of
    ops/fp8/recipe.quantize_weight, and that weight transposed when asked for. A stacked
    (E, N, K) weight (MoE experts) is quantised per expert in the same launch: (E, N, K) fp8,
    (E, NB, KB) scales and, when asked for, each expert's transpose (E, K, N)."""
    if w.dim() not in (2, 3):
        raise ValueError(f"triton_quantize_weight wants (N, K) or (E, N, K); got {tuple(w.shape)}")
    w = w if w.stride(-1) == 1 and w.stride(-2) == w.shape[-1] else w.contiguous()
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    q = torch.empty(*lead, n, k, dtype=FP8_DTYPE, device=w.device)
    qt = torch.empty(*lead, k, n, dtype=FP8_DTYPE, device=w.device) if transposed else None
    s = torch.empty(*lead, _cdiv(n, BLOCK), _cdiv(k, BLOCK), dtype=torch.float32, device=w.device)
    experts = w.shape[0] if w.dim() == 3 else 1
    if n and k and experts:
        _quant_weight_kernel[(s.shape[-2], s.shape[-1], experts)](
            w, q, q if qt is None else qt, s, n, k, w.stride(-2), s.stride(-2),
            w.stride(0) if w.dim() == 3 else 0, s.stride(0) if w.dim() == 3 else 0,
            POW2=pow2, TRANSPOSED=transposed, num_warps=8,
        )  # fmt: skip
    return q, s, qt


def padded_tokens(m: int) -> int:
    """Rows of x rounded up to whole 128-token scale blocks (the transposed operands' width)."""
    return _cdiv(m, BLOCK) * BLOCK


def triton_quantize_act_t(
    x: torch.Tensor, pow2: bool = False, scale_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, C) -> (q^T (C, M_pad) fp8, scales (C, M_pad / 128)): ops/fp8/recipe.py's
    quantize_act_t. `scale_layout` "row": scales stored row-major (C, MB); "col": a (C, MB) view
    of a column-major buffer (strides (1, C)), the layout cuBLAS wants for the left operand."""
    if x.dim() != 2:
        raise ValueError(f"triton_quantize_act_t wants (M, C), got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, c = x.shape
    m_pad = padded_tokens(m)
    mb = m_pad // BLOCK
    q = torch.empty(c, m_pad, dtype=FP8_DTYPE, device=x.device)
    if scale_layout == "row":
        s = torch.empty(c, mb, dtype=torch.float32, device=x.device)
    elif scale_layout == "col":
        s = torch.empty(mb, c, dtype=torch.float32, device=x.device).t()
    else:
        raise ValueError(f"scale_layout {scale_layout!r}: 'row' or 'col'")
    if m and c:
        block_c = 64
        _quant_act_t_kernel[(mb, _cdiv(c, block_c))](
            x, q, s, m, c, m_pad, x.stride(0), s.stride(0), s.stride(1),
            POW2=pow2, BLOCK_C=block_c, num_warps=8,
        )  # fmt: skip
    return q, s


def triton_quantize_act_both(
    x: torch.Tensor, pow2: bool = False, num_warps: int = 4
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """x (M, C) -> ((q (M, C), scales (M, CB)), (q^T (C, M_pad), scales (C, M_pad / 128))) in one
    launch: triton_gemm.triton_quantize_act's outputs and `triton_quantize_act_t`'s, with the same bits.
    Both scale tensors are views of column-major buffers (stride(0) == 1): the layout cuBLAS's
    block-wise scaled_mm reads (the token GEMM's operands), so they reach it without a copy.
    num_warps 4: 1.27-1.29x the two passes on the H100; 8 and 16 were slower than the two passes."""
    if x.dim() != 2:
        raise ValueError(f"triton_quantize_act_both wants (M, C), got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, c = x.shape
    m_pad = padded_tokens(m)
    cb = _cdiv(c, BLOCK)
    q = torch.empty(m, c, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(cb, m, dtype=torch.float32, device=x.device).t()
    qt = torch.empty(c, m_pad, dtype=FP8_DTYPE, device=x.device)
    st = torch.empty(m_pad // BLOCK, c, dtype=torch.float32, device=x.device).t()
    if m and c:
        _quant_act_both_kernel[(m_pad // BLOCK, cb)](
            x, q, s, qt, st, m, c, m_pad, x.stride(0), s.stride(0), s.stride(1), st.stride(0), st.stride(1),
            POW2=pow2, num_warps=num_warps,
        )  # fmt: skip
    return (q, s), (qt, st)
