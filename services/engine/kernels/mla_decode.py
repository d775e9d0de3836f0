"""Paged Multi-head Latent Attention decode in Triton (DeepSeek-V3, Kimi-K2, GLM-5 with DSA).

MLA caches one latent "head" per token and layer: [c | k_pe] (kv_lora_rank + qk_rope_head_dim
values) in the KVCache's K pool (kv_cache.py). A decode query in the absorbed form
(layers/mla.py) is per head a kv_lora_rank vector (q_nope W_UK) and the roped part; keys are the
latent rows [c | k_pe], values the latents c, shared by every head (MQA). These kernels read the
latents straight from the page pool through the block tables; the torch path gathers every
sequence's context into a dense copy per layer and step, which at a large batch doubles the bytes
a memory-bound decode moves.

- `mla_decode`: one program per (block of MLA_BLOCK_H heads, work item). Items are the decode
  work list of the GQA kernel (batch.DecodeWork, flash-decoding): a long row is cut into
  partitions whose partial outputs paged_attention's merge kernel combines by log-sum-exp. The
  latent tile is loaded once per key block and serves as both key and value. Output per head in
  latent space [T, H, kv_lora_rank]; W_UV is applied after (layers/mla.py).
- sparse (GLM-5's DSA): the same kernel with `indices` [B, K]: row b attends only the positions
  indices[b, :min(ctx, K)] (the indexer's top-k, best first), each read through the page table.
  The work list then partitions those entries (batch.decode_layout caps a row at index_topk).
- `index_scores`: the DSA indexer's score of every visible key for each decode query,
  sum_h w_h relu(q_h . k / sqrt(D)), over the paged indexer keys without gathering the context;
  `select_topk` keeps the index_topk best (ties to the earlier key, ops/topk.py) in score order.
- `store_rows`: writes this step's latent (or indexer key) rows at their slots, skipping
  negative slots (a CUDA graph's padding rows), which torch indexing would wrap to the last row.

Softmax in float32 with exp2 (scale pre-multiplied by log2(e)), P cast to the cache dtype for the
P @ V product, as paged_attention.py. kv_lora_rank must be a power of two >= 16 (the merge kernel's
tile); the rope and indexer widths are padded and masked. Under TRITON_INTERPRET=1 the kernels run
on CPU (tests/test_mla_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ops import pdl
from ops.topk import order_key
from services.engine.batch import MLA_BLOCK_H, DecodeMeta
from services.engine.kernels.paged_attention import (
    INTERPRET,
    LOG2E,
    MERGE_CHUNK,
    _decode_item,
    _dot,
    _merge_kernel,
    _prec,
)

# Launch settings: first choices, not tuned on a GPU (the latent tile is [block_n, kv_lora_rank]).
MLA_DECODE_TUNING: dict[str, int] = {"block_n": 32, "num_warps": 4, "num_stages": 2}
INDEX_BLOCK_N = 64  # keys per program of the indexer's scoring kernel


def supported(kv_lora_rank: int) -> bool:
    """Whether the kernels take this latent width (the merge kernel's tile is a power of two)."""
    return kv_lora_rank >= 16 and kv_lora_rank & (kv_lora_rank - 1) == 0


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _store_rows_kernel(
    x_ptr,
    pool_ptr,
    slot_ptr,
    stride_xt,
    stride_pt,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # step metadata: before the PDL wait (ops/pdl.py)
    offs = tl.arange(0, D_PAD)
    mask = offs < tl.where(slot >= 0, D, 0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + t * stride_xt + offs, mask=mask)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(pool_ptr + slot * stride_pt + offs, x.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_bt", "stride_it", "n_idx"])
def _mla_decode_kernel(
    q_ptr,
    kc_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    q_loc_ptr,
    bt_ptr,
    ctx_ptr,
    idx_ptr,
    item_row_ptr,
    item_qloc_ptr,
    item_start_ptr,
    item_end_ptr,
    item_merge_ptr,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_it,
    n_idx,
    scale,
    H: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
    SPARSE: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # SINGLE: program (b, head block) attends row b over all its keys. Else program (w, head
    # block) takes item w of the work list (one partition of one row): a row of one item writes
    # its output, the others write partials at index w for paged_attention's merge kernel. Keys
    # are positions 0..ctx-1, or with SPARSE the entries indices[b, 0..min(ctx, n_idx)-1].
    # Head blocks vary fastest in launch order: the programs reading one item's latents run
    # together, so all but the first find its tiles in L2.
    hb = tl.program_id(0)
    w = tl.program_id(1)
    # Step metadata before the PDL wait (the work list, contexts, query rows, block tables);
    # the indices, q and the pool after it (earlier kernels write them).
    b, row, start, end, merge = _decode_item(
        w,
        q_loc_ptr,
        ctx_ptr,
        item_row_ptr,
        item_qloc_ptr,
        item_start_ptr,
        item_end_ptr,
        item_merge_ptr,
        SINGLE,
    )
    direct = merge == 0
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    if SPARSE and SINGLE:
        end = tl.minimum(end, n_idx)  # (a work list's items are planned over capped keys)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, P_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    has_q = (row >= 0) & (start < end)
    hmask = offs_h < tl.where(has_q, H, 0)
    pmask = offs_p < P
    q_row = q_ptr + row * stride_qt + offs_h[:, None] * stride_qh
    q_c = tl.load(q_row + offs_r[None, :], mask=hmask[:, None], other=0.0)
    q_p = tl.load(q_row + R + offs_p[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        e = n0 + offs_n
        nmask = e < end
        if SPARSE:
            pos = tl.load(idx_ptr + b.to(tl.int64) * stride_it + e, mask=nmask, other=0).to(tl.int32)
            nmask = nmask & (pos >= 0) & (pos < ctx)  # the selection only holds visible keys
            pos = tl.where(nmask, pos, 0)
        else:
            pos = e
        page = tl.load(bt_row + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        rows = (page * PAGE + pos % PAGE) * stride_ct
        c = tl.load(kc_ptr + rows[:, None] + offs_r[None, :], mask=nmask[:, None], other=0.0)
        pe = tl.load(
            kc_ptr + rows[:, None] + R + offs_p[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0
        )
        s = _dot(q_c, tl.trans(c), PREC, UPCAST) + _dot(q_p, tl.trans(pe), PREC, UPCAST)
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A block without a key (a sparse row's masked entries) keeps m = -inf: no -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, PREC, UPCAST)
        m_i = m_new
    # l_i == 0: a padding row (ctx 0); it contributes nothing.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    omask = offs_h < tl.where(has_q & direct, H, 0)
    tl.store(
        out_ptr + row * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=omask[:, None],
    )
    if not SINGLE:
        idx = w.to(tl.int64) * H + offs_h
        part = offs_h < tl.where(has_q & (merge != 0), H, 0)
        tl.store(part_o_ptr + idx[:, None] * R + offs_r[None, :], o, mask=part[:, None])
        tl.store(part_lse_ptr + idx, m_i + tl.log2(safe_l), mask=part)


@triton.jit(do_not_specialize=["stride_bt", "stride_st", "width"])
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    ik_ptr,
    out_ptr,
    q_loc_ptr,
    bt_ptr,
    ctx_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kt,
    stride_st,
    stride_bt,
    width,
    scale,
    HI: tl.constexpr,
    HI_PAD: tl.constexpr,
    DI: tl.constexpr,
    DI_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # Program (b, key block): scores of row b's keys [n0, n0 + BLOCK_N); -inf past its context.
    b = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    row = tl.load(q_loc_ptr + b).to(tl.int64)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    offs_h = tl.arange(0, HI_PAD)
    offs_d = tl.arange(0, DI_PAD)
    pos = n0 + tl.arange(0, BLOCK_N)
    nmask = pos < ctx
    hmask = offs_h < tl.where(ctx > n0, HI, 0)
    dmask = offs_d < DI
    q = tl.load(
        q_ptr + row * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    wh = tl.load(w_ptr + row * stride_wt + offs_h, mask=hmask, other=0.0).to(tl.float32)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + pos // PAGE, mask=nmask, other=0).to(tl.int64)
    rows = page * PAGE + pos % PAGE
    k = tl.load(
        ik_ptr + rows[:, None] * stride_kt + offs_d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0
    )
    s = _dot(q, tl.trans(k), PREC, UPCAST) * scale  # [HI_PAD, BLOCK_N]
    score = tl.sum(tl.maximum(s, 0.0) * wh[:, None], 0)
    score = tl.where(nmask, score, float("-inf"))
    tl.store(out_ptr + b.to(tl.int64) * stride_st + pos, score, mask=pos < width)


# ----------------------------------------------------------------------------- launchers


def store_rows(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """x [T, D] -> rows slots [T] of pool [rows, D] (row-contiguous); a slot < 0 is skipped."""
    t, d = x.shape
    if t == 0:
        return
    x = x.contiguous()
    gdc = pdl.launch(x)
    _store_rows_kernel[(t,)](
        x,
        pool,
        slots,
        x.stride(0),
        pool.stride(0),
        D=d,
        D_PAD=triton.next_power_of_2(d),
        USE_GDC=gdc,
        launch_pdl=gdc,
    )


def mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    meta: DecodeMeta,
    scale: float,
    page_size: int,
    rank: int,
    indices: torch.Tensor | None = None,
    padded: bool = False,
    tuning: dict[str, int] | None = None,
) -> torch.Tensor:
    """Absorbed MLA over the latent pool: q [T, H, rank + rope] (rows meta.q_loc are read),
    k_cache [rows, rank + rope] -> [T, H, rank] (rows meta.q_loc written; the others zero if
    `padded`, else undefined). indices [B, K] int64: each row's selected positions, best first
    (select_topk), entries past min(ctx, K) unused; None: every key (dense)."""
    cfg = {**MLA_DECODE_TUNING, **(tuning or {})}
    t, h, width = q.shape
    rope = width - rank
    if not supported(rank) or k_cache.shape[-1] != width:
        raise ValueError(
            f"mla_decode: latent width {rank} (+ rope {rope}) against a pool row of {k_cache.shape[-1]}"
        )
    q = q.contiguous()
    out = (torch.zeros if padded else torch.empty)((t, h, rank), dtype=q.dtype, device=q.device)
    b = meta.q_loc.shape[0]
    work = meta.work
    if work is not None:
        w = work.item_row.shape[0]
        part_o = torch.empty((w, h, rank), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((w, h), dtype=torch.float32, device=q.device)
        items = (work.item_row, work.item_qloc, work.item_start, work.item_end, work.item_merge)
    else:
        w = b
        part_o = part_lse = out  # unused
        items = (meta.ctx_lens,) * 5  # unused
    idx = indices if indices is not None else meta.ctx_lens  # (unused when dense)
    n_idx = indices.shape[1] if indices is not None else 0
    stride_it = indices.stride(0) if indices is not None else 0
    gdc = pdl.launch(q)
    _mla_decode_kernel[(triton.cdiv(h, MLA_BLOCK_H), w)](
        q, k_cache, out, part_o, part_lse, meta.q_loc, meta.block_tables, meta.ctx_lens, idx, *items,
        q.stride(0), q.stride(1), k_cache.stride(0), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), stride_it, n_idx, scale * LOG2E,
        H=h, R=rank, P=rope, P_PAD=max(16, triton.next_power_of_2(rope)), BLOCK_H=MLA_BLOCK_H,
        PAGE=page_size, BLOCK_N=cfg["block_n"], SINGLE=work is None, SPARSE=indices is not None,
        PREC=_prec(k_cache.dtype), UPCAST=INTERPRET, USE_GDC=gdc,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=gdc,
    )  # fmt: skip
    if work is not None:
        _merge_kernel[(b, h)](
            out, part_o, part_lse, meta.q_loc, work.row_first, work.row_items,
            out.stride(0), out.stride(1), H=h, D=rank, CHUNK=MERGE_CHUNK, USE_GDC=gdc, launch_pdl=gdc,
        )  # fmt: skip
    return out


def index_scores(
    q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, meta: DecodeMeta, scale: float, page_size: int
) -> torch.Tensor:
    """DSA indexer scores of each decode row's keys: q [T, Hi, Di] and head weights w [T, Hi]
    (rows meta.q_loc read), index_k [rows, Di] -> float32 [B, table width * page_size], -inf
    past each row's context."""
    b, p = meta.block_tables.shape
    _, hi, di = q.shape
    width = p * page_size
    out = torch.empty((b, width), dtype=torch.float32, device=q.device)
    if b == 0 or width == 0:
        return out
    gdc = pdl.launch(q)
    _index_scores_kernel[(b, triton.cdiv(width, INDEX_BLOCK_N))](
        q, w, index_k, out, meta.q_loc, meta.block_tables, meta.ctx_lens,
        q.stride(0), q.stride(1), w.stride(0), index_k.stride(0), out.stride(0), meta.block_tables.stride(0),
        width, scale,
        HI=hi, HI_PAD=max(16, triton.next_power_of_2(hi)), DI=di, DI_PAD=max(16, triton.next_power_of_2(di)),
        PAGE=page_size, BLOCK_N=INDEX_BLOCK_N, PREC=_prec(index_k.dtype), UPCAST=INTERPRET, USE_GDC=gdc,
        launch_pdl=gdc,
    )  # fmt: skip
    return out


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B, n] float32 scores -> [B, min(k, n)] positions of each row's k best, best first, a tie
    going to the earlier key: ops/topk.topk_first's set, sorted, so a row's visible keys (finite
    scores) come before the -inf ones and mla_decode reads the first min(ctx, k) entries."""
    k = min(k, scores.shape[-1])
    return order_key(scores).topk(k, dim=-1, sorted=True).indices


# ----------------------------------------------------------------------------- reference


def reference_mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    q_loc: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    scale: float,
    page_size: int,
    rank: int,
    keep: list[list[int]] | None = None,
) -> torch.Tensor:
    """Plain torch, one row at a time (float32): what mla_decode computes, [len(q_loc), H, rank].
    keep: each row's attended positions (sparse), else all of 0..ctx-1. For tests."""
    out = torch.zeros(len(q_loc), q.shape[1], rank)
    for i, (row, ctx, table) in enumerate(zip(q_loc, ctx_lens, tables, strict=True)):
        pos = keep[i] if keep is not None else list(range(ctx))
        if not pos:
            continue
        rows = torch.tensor([table[p // page_size] * page_size + p % page_size for p in pos])
        kv = k_cache[rows].float().cpu()  # [n, rank + rope]
        scores = q[row].float().cpu() @ kv.T * scale  # [H, n]
        out[i] = scores.softmax(-1) @ kv[:, :rank]
    return out


__all__ = [
    "MLA_DECODE_TUNING",
    "index_scores",
    "mla_decode",
    "reference_mla_decode",
    "select_topk",
    "store_rows",
    "supported",
]
