"""Paged attention in Triton: every kernel reads K/V straight from the page pool through block tables.

The torch path (layers/attention.py) gathers each sequence's pages into a dense [B, ctx, heads, D] copy per
layer and step and runs SDPA over it; at a batch of 256 that copy is as large as the KV itself, so
on a GPU it doubles the memory traffic of a memory-bound decode. These kernels never copy:

- `store_kv`: writes this step's K/V rows at their slots; a negative slot is skipped, which is how
  padding rows of a CUDA-graph batch write nothing (torch indexing would wrap -1 to the last row).
- decode (one query per sequence): one program per (sequence, KV head), or, when the batch alone
  would leave SMs idle or a row is long, per (item, KV head) of a ragged work list
  (batch.DecodeWork, flash-decoding): each item is one partition of one row's context, so only
  long rows are split. The G query heads sharing a KV head are one tile (padded to 16 rows for
  tl.dot), so each K/V row is read once per item; a second kernel merges a split row's partial
  results by their log-sum-exp.
- prefill / mixed steps (any number of queries per sequence): one program per (sequence, block of
  BLOCK_M queries, query head), causal over absolute positions, keys read page by page.

Layouts (kv_cache.py): a layer's cache is [num_blocks * block_size, n_kv_heads, D], a token at
position p of a sequence lives at row block_table[p // block_size] * block_size + p % block_size.
Softmax runs in float32 with exp2 (the scale is pre-multiplied by log2(e)); P is cast to the
cache dtype for the P @ V product, as in flash attention.

Under TRITON_INTERPRET=1 (set before this module is imported) the kernels run on CPU, which is
how CI checks them against the torch reference (tests/test_engine_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ops import pdl
from services.engine.batch import DECODE_BLOCK_N, DecodeMeta, PagedMeta, PrefillMeta

# Launch settings: reasonable first choices, not tuned on the H200 (keys: tile sizes, warps,
# software-pipelining stages).
DECODE_TUNING: dict[str, int] = {"block_n": DECODE_BLOCK_N, "num_warps": 4, "num_stages": 3}
PREFILL_TUNING: dict[str, int] = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}

LOG2E = 1.4426950408889634
MERGE_CHUNK = 32  # partials the merge kernel combines per iteration


# Triton's CPU interpreter computes tl.dot on bfloat16 operands wrongly (triton 3.9: garbage of
# order 1e9), so under the interpreter operands are widened to float32 first. On a GPU they are
# not: bf16 tensor-core MMAs with float32 accumulation are the point.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_ct,
    H_KV: tl.constexpr,
    D: tl.constexpr,
    HD_PAD: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # step metadata: before the PDL wait (ops/pdl.py)
    offs = tl.arange(0, HD_PAD)  # heads and dims flattened: rows are [n_kv * D] contiguous
    mask = offs < tl.where(slot >= 0, H_KV * D, 0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(kc_ptr + slot * stride_ct + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * stride_ct + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_item(
    w,
    q_loc_ptr,
    ctx_ptr,
    item_row_ptr,
    item_qloc_ptr,
    item_start_ptr,
    item_end_ptr,
    item_merge_ptr,
    SINGLE: tl.constexpr,
):
    """What decode program w attends: (sequence row b, its query row, first key, one past the
    last, merge flag: 0 when the program writes the output itself). SINGLE: row w, all its keys;
    else item w of the work list (batch.DecodeWork; row -1: a CUDA graph's unused slot, no keys,
    no query row). Positions are int32 (loop bounds); addresses int64 (a large pool overflows 2^31
    elements). Only step metadata is read: callers may run it before their PDL wait."""
    if SINGLE:
        b = w
        ctx = tl.load(ctx_ptr + b).to(tl.int32)
        row = tl.load(q_loc_ptr + b).to(tl.int64)
        start = ctx * 0
        end = ctx
        merge = ctx * 0  # every row writes its output (a tensor, so the masks keep one dtype)
    else:
        b_raw = tl.load(item_row_ptr + w)
        valid = b_raw >= 0
        b = tl.maximum(b_raw, 0)
        row = tl.where(valid, tl.load(item_qloc_ptr + w), -1).to(tl.int64)
        start = tl.load(item_start_ptr + w).to(tl.int32)
        end = tl.where(valid, tl.load(item_end_ptr + w).to(tl.int32), start)
        merge = tl.load(item_merge_ptr + w)
    return b, row, start, end, merge


# Triton compiles a variant per value class of an int argument (== 1, divisible by 16): arguments
# that change from step to step (table width) must not be specialised, or the first steps of a
# new shape pay a compile (~1.5 s on the H200 in the first W1 run).
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    q_loc_ptr,
    bt_ptr,
    ctx_ptr,
    item_row_ptr,
    item_qloc_ptr,
    item_start_ptr,
    item_end_ptr,
    item_merge_ptr,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_ch,
    stride_ot,
    stride_oh,
    stride_bt,
    scale,
    H: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # SINGLE: program (b, kvh) attends row b over its whole context. Else program (w, kvh) takes
    # item w of the ragged work list (batch.DecodeWork): one partition of one row; a row with one
    # item writes its output, the others write partials at index w for _merge_kernel.
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    # Step metadata (work list, context, query row) before the PDL wait: the host
    # copies it in before the forward and no kernel writes it (ops/pdl.py); q and the pool after.
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
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * G + offs_g
    # q_loc -1: a mixed CUDA graph's unused decode row (cuda_graphs.MixedGraphs): no q, no output.
    qmask = offs_g < tl.where((row >= 0) & (start < end), G, 0)
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=qmask[:, None],
        other=0.0,
    )
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        nmask = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        rows = page * PAGE + pos % PAGE
        kv_off = rows[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=nmask[:, None], other=0.0)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + kv_off, mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new
    # l_i == 0: a padding row (ctx 0); it contributes nothing.
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    has_q = (row >= 0) & (start < end)
    omask = offs_g < tl.where(has_q & direct, G, 0)
    tl.store(
        out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=omask[:, None],
    )
    if not SINGLE:
        idx = w.to(tl.int64) * H + heads
        pmask = offs_g < tl.where(has_q & (merge != 0), G, 0)
        tl.store(part_o_ptr + idx[:, None] * D + offs_d[None, :], o, mask=pmask[:, None])
        tl.store(part_lse_ptr + idx, m_i + tl.log2(safe_l), mask=pmask)


@triton.jit
def _merge_kernel(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    q_loc_ptr,
    row_first_ptr,
    row_items_ptr,
    stride_ot,
    stride_oh,
    H: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # Program (b, h): row b's partials for head h, CHUNK items at a time, combined by their
    # log-sum-exp with a running max. Rows of one item (written by _decode_kernel) skip.
    b = tl.program_id(0)
    h = tl.program_id(1)
    # Step metadata: before the PDL wait.
    row = tl.load(q_loc_ptr + b).to(tl.int64)
    first = tl.load(row_first_ptr + b)
    n = tl.load(row_items_ptr + b).to(tl.int32)
    n = tl.where(n > 1, n, 0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # the partials are the decode kernel's output
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D)
    # The first CHUNK items in one shot (a row rarely has more), the rest in the loop below. At
    # batch 1 under PDL this kernel profiles at 5.3-5.8 us against 4.4 us for a
    # uniform-split merge (2.1-2.4 us vs 1.9-2.0 us without PDL); neither the one-shot first chunk
    # nor num_stages moved that.
    cmask = offs_c < n
    idx = (first + offs_c).to(tl.int64) * H + h
    lse = tl.load(part_lse_ptr + idx, mask=cmask, other=float("-inf"))
    o = tl.load(part_o_ptr + idx[:, None] * D + offs_d[None, :], mask=cmask[:, None], other=0.0)
    if USE_GDC:
        # Early, as in the other kernels: the next kernel's own wait covers this grid's stores.
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row without partials: nothing is stored anyway
    wgt = tl.exp2(lse - m)  # masked items: exp2(-inf) = 0
    total = tl.sum(wgt, 0)
    acc = tl.sum(wgt[:, None] * o, 0)
    for c0 in range(CHUNK, n, CHUNK):  # the rest, with a running max
        cmask = c0 + offs_c < n
        idx = (first + c0 + offs_c).to(tl.int64) * H + h
        lse = tl.load(part_lse_ptr + idx, mask=cmask, other=float("-inf"))
        o = tl.load(part_o_ptr + idx[:, None] * D + offs_d[None, :], mask=cmask[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        wgt = tl.exp2(lse - m_new)
        total = total * alpha + tl.sum(wgt, 0)
        acc = acc * alpha + tl.sum(wgt[:, None] * o, 0)
        m = m_new
    res = acc / tl.where(total > 0, total, 1.0)
    # q_loc -1: no output row (see _decode_kernel); one-item rows were written there.
    dmask = offs_d < tl.where((row >= 0) & (n > 1), D, 0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["stride_bt", "blk_stride"])
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    out_ptr,
    q_start_ptr,
    q_len_ptr,
    bt_ptr,
    ctx_ptr,
    blk_ptr,
    blk_stride,
    stride_qt,
    stride_qh,
    stride_ct,
    stride_ch,
    stride_ot,
    stride_oh,
    stride_bt,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_MAP: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    # Step metadata (block list, spans) is read before the PDL wait: the host copies it in before
    # the forward and no kernel writes it (ops/pdl.py). Every program waits before it can
    # return: a grid that finished without waiting would let the next kernel's wait pass while
    # the kernel before this one still runs.
    if BLOCK_MAP:
        # Grid (blocks, heads) of a fixed size (a CUDA graph's): program i takes query block i of
        # the host-built list blk = [[span of each block], [block index within the span]] (rows
        # blk_stride apart); span -1 marks the unused tail of the grid.
        s_idx = tl.load(blk_ptr + tl.program_id(0)).to(tl.int32)
        mb = tl.load(blk_ptr + blk_stride + tl.program_id(0)).to(tl.int32)
        h = tl.program_id(1)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
        if s_idx < 0:
            return
    else:
        s_idx = tl.program_id(0)
        mb = tl.program_id(1)
        h = tl.program_id(2)
        if USE_GDC:
            tl.extra.cuda.gdc_wait()
    kvh = h // G
    q_len = tl.load(q_len_ptr + s_idx).to(tl.int32)
    q0 = tl.load(q_start_ptr + s_idx).to(tl.int64)
    ctx = tl.load(ctx_ptr + s_idx).to(tl.int32)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    mmask = offs_m < q_len
    q_pos = ctx - q_len + offs_m  # absolute position of each query
    q = tl.load(
        q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mmask[:, None],
        other=0.0,
    )
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    # Keys up to the block's last query (causal); a block past the sequence's queries does nothing.
    hi = tl.minimum(ctx, ctx - q_len + (mb + 1) * BLOCK_M)
    hi = tl.where(mb * BLOCK_M < q_len, hi, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + s_idx.to(tl.int64) * stride_bt
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + offs_n
        nmask = pos < hi
        page = tl.load(bt_row + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        rows = page * PAGE + pos % PAGE
        kv_off = rows[:, None] * stride_ct + kvh * stride_ch + offs_d[None, :]
        k = tl.load(kc_ptr + kv_off, mask=nmask[:, None], other=0.0)
        s = _dot(q, tl.trans(k), PREC, UPCAST) * scale
        s = tl.where(nmask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that see no key yet (only padding rows can) keep m = -inf: avoid -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + kv_off, mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PREC, UPCAST)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mmask[:, None],
    )


# ----------------------------------------------------------------------------- launchers


def _prec(dtype: torch.dtype) -> str:
    # float32 caches (CPU tests, debug runs) must not silently drop to TF32 on a GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k, v: [T, n_kv, D]; caches: one layer, [rows, n_kv, D] contiguous; slots [T] (< 0: skip)."""
    t, h_kv, d = k.shape
    if t == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    gdc = pdl.launch(k)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), k_cache.stride(0),
        H_KV=h_kv, D=d, HD_PAD=triton.next_power_of_2(h_kv * d), USE_GDC=gdc, launch_pdl=gdc,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: DecodeMeta,
    scale: float,
    page_size: int,
    tuning: dict[str, int] | None = None,
) -> None:
    """q, out: [T, H, D] (rows meta.q_loc are read and written); caches [rows, n_kv, D].
    tuning: overrides of DECODE_TUNING (any block_n is correct: partitions are masked)."""
    cfg = {**DECODE_TUNING, **(tuning or {})}
    b = meta.q_loc.shape[0]
    _, h, d = q.shape
    n_kv = k_cache.shape[1]
    g = h // n_kv
    work = meta.work
    if work is not None:
        w = work.item_row.shape[0]
        part_o = torch.empty((w, h, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((w, h), dtype=torch.float32, device=q.device)
        items = (work.item_row, work.item_qloc, work.item_start, work.item_end, work.item_merge)
    else:
        w = b
        part_o = part_lse = out  # unused
        items = (meta.ctx_lens,) * 5  # unused
    gdc = pdl.launch(q)
    _decode_kernel[(w, n_kv)](
        q, k_cache, v_cache, out, part_o, part_lse, meta.q_loc, meta.block_tables, meta.ctx_lens, *items,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), scale * LOG2E,
        H=h, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, PAGE=page_size,
        BLOCK_N=cfg["block_n"], SINGLE=work is None, PREC=_prec(k_cache.dtype), UPCAST=INTERPRET,
        USE_GDC=gdc, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=gdc,
    )  # fmt: skip
    if work is not None:
        _merge_kernel[(b, h)](
            out, part_o, part_lse, meta.q_loc, work.row_first, work.row_items,
            out.stride(0), out.stride(1), H=h, D=d, CHUNK=MERGE_CHUNK, USE_GDC=gdc, launch_pdl=gdc,
        )  # fmt: skip


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: PrefillMeta,
    scale: float,
    page_size: int,
    tuning: dict[str, int] | None = None,
) -> None:
    cfg = {**PREFILL_TUNING, **(tuning or {})}
    s = meta.q_start.shape[0]
    _, h, d = q.shape
    g = h // k_cache.shape[1]
    if meta.blocks is not None:  # a fixed grid over a host-built block list (CUDA graphs)
        if cfg["block_m"] != PREFILL_TUNING["block_m"]:
            raise ValueError("a block list is built for PREFILL_TUNING's block_m")
        grid: tuple[int, ...] = (meta.blocks.shape[1], h)
        blocks, blk_stride = meta.blocks, meta.blocks.stride(0)
    else:
        blocks, blk_stride = meta.q_start, 0
        grid = (s, -(-meta.max_q_len // cfg["block_m"]), h)
    gdc = pdl.launch(q)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, meta.q_start, meta.q_lens, meta.block_tables, meta.ctx_lens,
        blocks, blk_stride,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), scale * LOG2E,
        G=g, D=d, PAGE=page_size, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], PREC=_prec(k_cache.dtype),
        UPCAST=INTERPRET, BLOCK_MAP=meta.blocks is not None, USE_GDC=gdc,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=gdc,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """One layer: store this step's k/v, then attend every query over its sequence's pages.
    q [T, H, D], k/v [T, n_kv, D] -> [T, H, D]."""
    store_kv(k, v, k_cache, v_cache, slots)
    return attend(q, k_cache, v_cache, meta, scale, page_size)


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """Every query over its sequence's pages (this step's K/V already stored): [T, H, D]."""
    # A fixed-shape (CUDA graph) batch has padding token rows that no span attends for; zeros
    # keep them finite through the layers after (an MoE router must not see NaN garbage).
    out = torch.zeros_like(q) if meta.padded else torch.empty_like(q)
    if meta.decode is not None:
        decode_attention(q, k_cache, v_cache, out, meta.decode, scale, page_size)
    if meta.prefill is not None:
        prefill_attention(q, k_cache, v_cache, out, meta.prefill, scale, page_size)
    return out


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_start: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    scale: float,
    page_size: int,
) -> torch.Tensor:
    """Plain torch, one sequence at a time (float32): what the kernels must compute. For tests."""
    out = torch.zeros_like(q, dtype=torch.float32)
    h = q.shape[1]
    for s0, n, ctx, table in zip(q_start, q_lens, ctx_lens, tables, strict=True):
        rows = torch.tensor(
            [table[p // page_size] * page_size + p % page_size for p in range(ctx)], device=k_cache.device
        )
        kk = k_cache[rows].float().repeat_interleave(h // k_cache.shape[1], dim=1)  # [ctx, H, D]
        vv = v_cache[rows].float().repeat_interleave(h // k_cache.shape[1], dim=1)
        qq = q[s0 : s0 + n].float()  # [n, H, D]
        scores = torch.einsum("nhd,chd->hnc", qq, kk) * scale
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out[s0 : s0 + n] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), vv)
    return out


__all__ = [
    "DecodeMeta",
    "PagedMeta",
    "PrefillMeta",
    "attend",
    "decode_attention",
    "paged_attention",
    "prefill_attention",
    "reference_attention",
    "store_kv",
]
