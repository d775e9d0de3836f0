"""The batch-1 decode step as one persistent kernel (EngineConfig.megakernel, docs/engine.md).

At batch 1 the forward of a small dense model is a chain of ~10 dependent kernels per layer,
each a few microseconds of DRAM latency, ramp-up and tail: Qwen3-0.6B's 28 layers took 0.75 ms
against a 0.21 ms read of their weights. Folding kernels together did not shorten it, and
neither did streaming the next weights into L2 from a side stream: with every weight already in
L2 the chain still took 15 us a layer. The time is in the kernel boundaries themselves.

So here one launch runs every layer. Its P programs (one per SM) stay resident and meet at a
grid-wide barrier between the six phases of a layer:

  qkv     RMSNorm of the float32 residual stream (each program the whole row), then its rows of
          the fused q/k/v GEMV
  attn    (KV head, partition) items: q/k RMSNorm + RoPE, the new token's k/v into the page
          pool (by the item that holds its position), online softmax over the partition's keys
  merge   the partitions of each head combined by log-sum-exp
  o       its rows of o_proj; the residual add of those rows
  gate_up RMSNorm, its rows of the fused gate/up GEMV
  down    SiLU(gate) * up, its rows of down_proj; the residual add

Weights do not depend on the data, so each program loads its slice of the next GEMV's weights
into registers a phase or two ahead, after arriving at the barrier and before waiting on it: the
weights stream in while the barriers serialise only the small activations, which stay in L2.
(L2 prefetch instructions instead, of weights or of KV, were slower in every arrangement measured.) Weights and KV are loaded evict_first, so that
their stream does not push the small data every phase waits on out of L2. Fewer phases a layer
(the merge inside o_proj's split-K partials; the MLP in one phase with atomically added down
outputs) and relaxed barrier polling were measured no faster, so the kernel does not have them.

Numerics follow the layered GPU path: bf16 GEMV outputs, float32 residual stream, RMSNorm and
q/k norm + RoPE in float32 rounded once, P cast to the cache dtype for P @ V, partitions merged
by log-sum-exp. Accumulation order differs, so results agree to bf16 rounding, not bit for bit.

Under TRITON_INTERPRET=1 (CPU tests) programs run one after another and a barrier would wait
forever, so `run` launches the same kernel once per (layer, phase) instead: the phases' code is
what the GPU runs; the barrier and the look-ahead loads are the GPU launch's only additions. A
one-program kernel (a one-head model) runs the persistent launch itself, so tests cover those too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
N_PHASES = tl.constexpr(6)
# Weight tensors per layer, in the offset table's column order (_weight's j).
WEIGHTS = ("input_ln", "qkv", "q_norm", "k_norm", "o", "post_ln", "gate_up", "down")
N_WEIGHTS = tl.constexpr(len(WEIGHTS))
NUM_WARPS = tl.constexpr(8)
BLOCK_N = tl.constexpr(64)  # keys per attention tile
MAX_TILE = 32768  # weight elements one GEMV tile loads (128 per thread at 8 warps)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _trace(trace_ptr, i, TRACE: tl.constexpr):
    """TRACE (a per-phase timing breakdown): program 0 records the time at mark i."""
    if TRACE:
        if tl.program_id(0) == 0:
            tl.store(trace_ptr + i, _globaltimer())


@triton.jit
def _mark(trace_ptr, i, dep, TRACE: tl.constexpr):
    """TRACE: program 0 records the time at inner mark i once the 1-D tensor `dep` is ready (the
    timer read takes it as an operand, so it waits for the loads behind it)."""
    if TRACE:
        if tl.program_id(0) == 0:
            t = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;",
                "=l,f",
                [dep.to(tl.float32)],
                dtype=tl.int64,
                is_pure=False,
                pack=1,
            )
            offs = tl.arange(0, dep.shape[0])
            tl.store(trace_ptr + i + offs * 0, t, mask=offs == 0)


@triton.jit
def _grid_arrive(bar_ptr, trace_ptr, nb, NB: tl.constexpr, TRACE_ALL: tl.constexpr):
    """This program's arrival at the grid barrier, after its stores (release). TRACE_ALL: every
    program records the time of each arrival (for a timing breakdown; off in the product)."""
    tl.debug_barrier()
    if TRACE_ALL & 1:
        tl.store(trace_ptr + (tl.program_id(0) * NB + nb) * 2, _globaltimer())
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _trap():
    """Abort the launch (a CUDA error on the host: the engine fails loudly instead of hanging)."""
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grid_wait(bar_ptr, target, MAX_POLLS: tl.constexpr):
    """Wait until the counter reaches `target` arrivals (P programs x barriers so far). A barrier
    is ~1 us on the H200 with 128 programs (polling with ld.acquire instead of atomic reads, or
    spreading the arrivals over 8 counters, was slower).
    Arrive, issue the next phase's weight loads, then wait: a warp that issues 100 KB of loads
    stalls until the memory system takes them, and an arrival behind them made everyone wait.
    A barrier that some program never reaches (not every program resident: another client
    holding SMs) would spin forever: after MAX_POLLS polls (2^26 by default, far longer than any
    step) the launch traps instead."""
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
        if polls > MAX_POLLS:
            _trap()
    tl.debug_barrier()


@triton.jit
def _grid_done(bar_ptr, nb, P: tl.constexpr, trace_ptr, TRACE: tl.constexpr, NB: tl.constexpr,
               TRACE_ALL: tl.constexpr, MAX_POLLS: tl.constexpr):  # fmt: skip
    """Wait out the barrier this program arrived at (its nb + 1-th); returns nb + 1. TRACE_ALL:
    the time this program saw it pass."""
    _grid_wait(bar_ptr, (nb + 1) * P, MAX_POLLS)
    if TRACE_ALL & 2:
        tl.store(trace_ptr + (tl.program_id(0) * NB + nb) * 2 + 1, _globaltimer())
    nb += 1
    _trace(trace_ptr, nb, TRACE)
    return nb


@triton.jit
def _weight(w_ptr, row_ptr, j):
    """Weight j of a layer: base + its offset, which DecodeMegakernel keeps a multiple of 16
    elements. Said here, Triton can prove the tiles 16-byte aligned and load them as vectors;
    without it every weight element was its own 2-byte load."""
    return w_ptr + tl.multiple_of(tl.load(row_ptr + j), 16)


@triton.jit
def _mdot(a, b, UPCAST: tl.constexpr):
    """tl.dot; UPCAST (the interpreter, whose 16-bit dot is wrong) in float32, exactly."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _item_range(item, ctx, S: tl.constexpr):
    """Attention item `item`'s KV head, partition and key range [lo, hi) of a ctx-key context."""
    g = item // S
    s = item % S
    chunk = tl.cdiv(tl.cdiv(ctx, S), BLOCK_N) * BLOCK_N
    lo = s * chunk
    return g, s, lo, tl.minimum(lo + chunk, ctx)


@triton.jit
def _rstd(h_ptr, eps, D: tl.constexpr, KC: tl.constexpr):
    offs = tl.arange(0, KC)
    ss = tl.zeros([KC], tl.float32)
    for kc in tl.static_range(D // KC):
        h = tl.load(h_ptr + kc * KC + offs, cache_modifier=".cg")
        ss += h * h
    return 1.0 / tl.sqrt(tl.sum(ss, 0) / D + eps)


@triton.jit
def _gemv_input(x_ptr, lnw_ptr, rstd, cols, X_MODE: tl.constexpr, HALF: tl.constexpr, WDT: tl.constexpr):
    """One K chunk of the GEMV's input, float32 holding model-dtype values.
    X_MODE 0: RMSNorm of the float32 residual stream; 1: a model-dtype vector; 2: SiLU(gate) * up
    of the gate/up output (gate at [0, HALF), up at [HALF, 2 HALF))."""
    if X_MODE == 0:
        h = tl.load(x_ptr + cols, cache_modifier=".cg")
        w = tl.load(lnw_ptr + cols).to(tl.float32)
        x = (h * rstd * w).to(WDT).to(tl.float32)
    elif X_MODE == 1:
        x = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
    else:
        g = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
        u = tl.load(x_ptr + HALF + cols, cache_modifier=".cg").to(tl.float32)
        x = (g / (1.0 + tl.exp(-g)) * u).to(WDT).to(tl.float32)
    return x


@triton.jit
def _tile(w_ptr, r0, c: tl.constexpr, K: tl.constexpr, RC: tl.constexpr, KC: tl.constexpr, ok):
    """Weight tile c of a GEMV slice (row chunk c // (K // KC), K chunk c % (K // KC)); nothing is
    read where `ok` is false (the last layer's look-ahead)."""
    rows = r0 + (c // (K // KC)) * RC + tl.arange(0, RC)
    cols = (c % (K // KC)) * KC + tl.arange(0, KC)
    mask = tl.arange(0, RC)[:, None] < tl.where(ok, RC, 0)
    # evict_first: a step streams ~18x L2's size of weights, which otherwise push out the small
    # data every phase waits on (the activations, partials and barrier counter): 670 against
    # 697 us for 28 layers (H200).
    return tl.load(
        w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
        mask=mask,
        other=0.0,
        eviction_policy="evict_first",
    )


@triton.jit
def _load4(w_ptr, r0, K: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, KC: tl.constexpr, ok):
    """A GEMV slice's tiles (at most 4), the unused ones standing in as the first."""
    w0 = _tile(w_ptr, r0, 0, K, RC, KC, ok)
    w1, w2, w3 = _load_rest(w_ptr, r0, w0, K, R, RC, KC, ok)
    return w0, w1, w2, w3


@triton.jit
def _load_rest(w_ptr, r0, w0, K: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, KC: tl.constexpr, ok):
    """_load4's tiles after the first (w0, already loaded), the unused ones standing in as w0."""
    NCH: tl.constexpr = (R // RC) * (K // KC)
    w1 = w0
    w2 = w0
    w3 = w0
    if NCH > 1:
        w1 = _tile(w_ptr, r0, 1, K, RC, KC, ok)
    if NCH > 2:
        w2 = _tile(w_ptr, r0, 2, K, RC, KC, ok)
    if NCH > 3:
        w3 = _tile(w_ptr, r0, 3, K, RC, KC, ok)
    return w1, w2, w3


@triton.jit
def _gemv(
    w0, w1, w2, w3, r0, x_ptr, lnw_ptr, eps, out_ptr,
    K: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, KC: tl.constexpr,
    X_MODE: tl.constexpr, HALF: tl.constexpr, RESIDUAL: tl.constexpr,
    trace_ptr, tidx, TRACE: tl.constexpr,
):  # fmt: skip
    """Rows [r0, r0 + R) of a row-major [*, K] weight, given as its loaded tiles w0..w3 (_load4),
    times the input (_gemv_input; X_MODE 0 normalises with lnw_ptr and eps), rounded to the
    weight dtype; stored at out_ptr + row, or (RESIDUAL) added to the float32 stream there.
    Two shapes of slice (_tiling): row chunks over the whole K, or one row chunk over K chunks.

    The tiles arrive loaded: the persistent kernel loads a phase's weights at the end of the
    phase before, so they stream in while the grid barrier waits; loaded here, after the
    barrier, every phase began with a DRAM round trip."""
    WDT = w0.dtype
    NKC: tl.constexpr = K // KC
    NCH: tl.constexpr = (R // RC) * NKC
    offs_k = tl.arange(0, KC)
    # Every load of the phase's inputs is issued before any of them is used: the residual rows
    # (RESIDUAL, one row chunk) and the first input chunk go out together after the barrier.
    if RESIDUAL and NCH // NKC == 1:
        res = tl.load(out_ptr + r0 + tl.arange(0, RC), cache_modifier=".cg")
    if X_MODE == 0 and NKC == 1:  # RMSNorm from one load of the stream
        hx = tl.load(x_ptr + offs_k, cache_modifier=".cg")
        lw = tl.load(lnw_ptr + offs_k).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hx * hx, 0) / K + eps)
        x0 = (hx * rstd * lw).to(WDT).to(tl.float32)
    else:
        rstd = 0.0
        if X_MODE == 0:
            rstd = _rstd(x_ptr, eps, K, KC)
        x0 = _gemv_input(x_ptr, lnw_ptr, rstd, offs_k, X_MODE, HALF, WDT)
    _mark(trace_ptr, tidx, x0, TRACE)
    if NKC == 1:
        y0 = _rows_dot(w0, x0)
        _mark(trace_ptr, tidx + 1, y0, TRACE)
        if RESIDUAL and NCH == 1:
            _gemv_store(out_ptr, r0, y0, res, WDT, RC)
        else:
            _gemv_out(out_ptr, r0, y0, WDT, RC, RESIDUAL)
            if NCH > 1:
                _gemv_out(out_ptr, r0 + RC, _rows_dot(w1, x0), WDT, RC, RESIDUAL)
            if NCH > 2:
                _gemv_out(out_ptr, r0 + 2 * RC, _rows_dot(w2, x0), WDT, RC, RESIDUAL)
            if NCH > 3:
                _gemv_out(out_ptr, r0 + 3 * RC, _rows_dot(w3, x0), WDT, RC, RESIDUAL)
    else:  # every K chunk's input loaded before the first dot: 666 against 672 us for 28 layers,
        # lower in all 9 rounds (H200)
        x1 = x0
        x2 = x0
        x3 = x0
        if NKC > 1:
            x1 = _gemv_input(x_ptr, lnw_ptr, rstd, KC + offs_k, X_MODE, HALF, WDT)
        if NKC > 2:
            x2 = _gemv_input(x_ptr, lnw_ptr, rstd, 2 * KC + offs_k, X_MODE, HALF, WDT)
        if NKC > 3:
            x3 = _gemv_input(x_ptr, lnw_ptr, rstd, 3 * KC + offs_k, X_MODE, HALF, WDT)
        acc = _rows_dot(w0, x0)
        if NKC > 1:
            acc += _rows_dot(w1, x1)
        if NKC > 2:
            acc += _rows_dot(w2, x2)
        if NKC > 3:
            acc += _rows_dot(w3, x3)
        _mark(trace_ptr, tidx + 1, acc, TRACE)
        if RESIDUAL:
            _gemv_store(out_ptr, r0, acc, res, WDT, RC)
        else:
            _gemv_out(out_ptr, r0, acc, WDT, RC, False)


@triton.jit
def _gemv_store(out_ptr, r0, acc, res, WDT: tl.constexpr, RC: tl.constexpr):
    """The residual add with the stream's rows already loaded (res)."""
    tl.store(out_ptr + r0 + tl.arange(0, RC), res + acc.to(WDT).to(tl.float32))


@triton.jit
def _rows_dot(w, x):
    return tl.sum(w.to(tl.float32) * x[None, :], 1)


@triton.jit
def _gemv_out(out_ptr, r0, acc, WDT: tl.constexpr, RC: tl.constexpr, RESIDUAL: tl.constexpr):
    """acc rounded to the model dtype WDT, stored at rows [r0, r0 + RC) or added to the float32
    stream there."""
    rows = r0 + tl.arange(0, RC)
    y = acc.to(WDT)
    if RESIDUAL:
        tl.store(out_ptr + rows, tl.load(out_ptr + rows, cache_modifier=".cg") + y.to(tl.float32))
    else:
        tl.store(out_ptr + rows, y)


@triton.jit
def _norm_rope(x_ptr, n, w_ptr, cos_ptr, sin_ptr, eps, WDT: tl.constexpr, N_PAD: tl.constexpr,
               HALF: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    """n heads at x_ptr (contiguous, 2 HALF each): per-head RMSNorm (NORM) and RoPE in float32,
    rounded to the model dtype; returned as the two halves, float32."""
    offs_h = tl.arange(0, N_PAD)
    offs_d = tl.arange(0, HALF)
    hmask = (offs_h < n)[:, None]
    base = x_ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(base, mask=hmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    x2 = tl.load(base + HALF, mask=hmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        x1 = x1 * r * tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        x2 = x2 * r * tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
    c1 = tl.load(cos_ptr + offs_d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + HALF + offs_d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + offs_d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + HALF + offs_d).to(tl.float32)[None, :]
    y1 = (x1 * c1 - x2 * s1).to(WDT).to(tl.float32)
    y2 = (x2 * c2 + x1 * s2).to(WDT).to(tl.float32)
    return y1, y2


@triton.jit
def _kv_tile(kc_ptr, vc_ptr, bt_ptr, g, n0, cached, HKV: tl.constexpr, HD: tl.constexpr, PAGE: tl.constexpr):
    """Keys (as two halves) and values of KV head g at positions [n0, n0 + BLOCK_N) below
    `cached`, read through the block table; and the mask of those positions."""
    HALF: tl.constexpr = HD // 2
    offs_d = tl.arange(0, HALF)
    p_n = n0 + tl.arange(0, BLOCK_N)
    nmask = p_n < cached
    page = tl.load(bt_ptr + p_n // PAGE, mask=nmask, other=0).to(tl.int64)
    rows = (page * PAGE + p_n % PAGE) * (HKV * HD) + g * HD
    # evict_first, as the weights (_tile): 665 against 677 us for 28 layers at context 600
    # (H200).
    ev: tl.constexpr = "evict_first"
    k1 = tl.load(kc_ptr + rows[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0, eviction_policy=ev)
    k2 = tl.load(
        kc_ptr + rows[:, None] + HALF + offs_d[None, :], mask=nmask[:, None], other=0.0, eviction_policy=ev
    )
    v = tl.load(
        vc_ptr + rows[:, None] + tl.arange(0, HD)[None, :], mask=nmask[:, None], other=0.0, eviction_policy=ev
    )
    return k1, k2, v, nmask


@triton.jit
def _first_kv_tile(item, kc_ptr, vc_ptr, bt_ptr, ctx, HKV: tl.constexpr, HD: tl.constexpr, S: tl.constexpr,
                   PAGE: tl.constexpr):  # fmt: skip
    """Attention item `item`'s first tile (_kv_tile). Only keys of earlier steps are read (the
    new token's come from registers), so it can be loaded before this step's q/k/v exist."""
    g, s, lo, hi = _item_range(item, ctx, S)
    return _kv_tile(kc_ptr, vc_ptr, bt_ptr, g, lo, tl.minimum(hi, ctx - 1), HKV, HD, PAGE)


@triton.jit
def _attention_item(
    item, qkv_ptr, qn_ptr, kn_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, bt_ptr, po_ptr, plse_ptr,
    pos, slot, ctx, eps, scale_log2, k1, k2, v, nmask,
    H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, S: tl.constexpr, G_PAD: tl.constexpr,
    PAGE: tl.constexpr, QK_NORM: tl.constexpr, UPCAST: tl.constexpr,
    trace_ptr, tidx, TRACE: tl.constexpr,
):  # fmt: skip
    """Item (KV head g, partition s): softmax over keys [lo, hi) of the context for the group's
    G query heads; the normalised partial output and its log2-sum-exp go to slot s. k1, k2, v,
    nmask: its first key tile, already loaded (_first_kv_tile).

    The new token (position ctx - 1) is not read back from the page pool: the item holding it
    takes its k/v from registers (and stores them for later steps), so no load waits on a store
    and the first KV tile can be loaded before q is even computed."""
    WDT: tl.constexpr = kc_ptr.dtype.element_ty
    G: tl.constexpr = H // HKV
    HALF: tl.constexpr = HD // 2
    g, s, lo, hi = _item_range(item, ctx, S)
    cached = tl.minimum(hi, ctx - 1)  # keys read from the pool: all but the new token's
    offs_d = tl.arange(0, HALF)
    offs_v = tl.arange(0, HD)
    cos_row = cos_ptr + pos.to(tl.int64) * HD
    sin_row = sin_ptr + pos.to(tl.int64) * HD
    q1, q2 = _norm_rope(qkv_ptr + g * G * HD, G, qn_ptr, cos_row, sin_row, eps, WDT, G_PAD, HALF, QK_NORM)
    kn1, kn2 = _norm_rope(qkv_ptr + (H + g) * HD, 1, kn_ptr, cos_row, sin_row, eps, WDT, 1, HALF, QK_NORM)
    v_new = tl.load(qkv_ptr + (H + HKV + g) * HD + offs_v, cache_modifier=".cg").to(tl.float32)
    owner = (ctx - 1 >= lo) & (ctx - 1 < hi)
    dst = slot.to(tl.int64) * (HKV * HD) + g * HD
    keep = owner & (slot >= 0)
    kmask = offs_d[None, :] < tl.where(keep, HALF, 0)
    tl.store(kc_ptr + dst + offs_d[None, :], kn1.to(WDT), mask=kmask)
    tl.store(kc_ptr + dst + HALF + offs_d[None, :], kn2.to(WDT), mask=kmask)
    tl.store(vc_ptr + dst + offs_v, v_new.to(WDT), mask=offs_v < tl.where(keep, HD, 0))
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HD], tl.float32)
    # Tensor-core dots over G_PAD >= 16 query rows (the padding rows are zeros), as the layered
    # decode kernel does: a broadcast-and-sum over [G, keys, dims] cost more than the padding.
    qa = q1.to(WDT)
    qb = q2.to(WDT)
    if TRACE:  # the first tile and q are in registers
        ready = tl.sum(k1.to(tl.float32), 1) + tl.sum(v.to(tl.float32), 1) + tl.sum(tl.sum(q1, 1), 0)
        _mark(trace_ptr, tidx, ready, TRACE)
    n0 = lo
    while n0 < cached:
        if n0 > lo:  # a later tile (long contexts)
            k1, k2, v, nmask = _kv_tile(kc_ptr, vc_ptr, bt_ptr, g, n0, cached, HKV, HD, PAGE)
        sc = _mdot(qa, tl.trans(k1), UPCAST) + _mdot(qb, tl.trans(k2), UPCAST)
        sc = tl.where(nmask[None, :], sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mdot(p.to(WDT), v, UPCAST)
        m_i = m_new
        n0 += BLOCK_N
    # The new token, last (so the sum runs in another order than the layered kernels').
    s_new = (tl.sum(q1 * kn1, 1) + tl.sum(q2 * kn2, 1)) * scale_log2
    s_new = tl.where(owner, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p_last = tl.exp2(s_new - m_safe)
    l_i = l_i * alpha + p_last
    acc = (
        acc * alpha[:, None] + p_last.to(WDT).to(tl.float32)[:, None] * v_new.to(WDT).to(tl.float32)[None, :]
    )
    m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    heads = g * G + tl.arange(0, G_PAD)
    hmask = tl.arange(0, G_PAD) < G
    idx = s * H + heads
    tl.store(po_ptr + idx[:, None] * HD + offs_v[None, :], acc / safe_l[:, None], mask=hmask[:, None])
    lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
    _mark(trace_ptr, tidx + 1, lse, TRACE)
    tl.store(plse_ptr + idx, lse, mask=hmask)


@triton.jit
def _merge(e0, po_ptr, plse_ptr, attn_ptr, H: tl.constexpr, HD: tl.constexpr, S: tl.constexpr,
           EM: tl.constexpr):  # fmt: skip
    """Elements [e0, e0 + EM) of the attention output (one head's slice): the S partitions by
    log-sum-exp."""
    head = e0 // HD
    offs_s = tl.arange(0, S)
    offs_e = tl.arange(0, EM)
    lse = tl.load(plse_ptr + offs_s * H + head, cache_modifier=".cg")
    o = tl.load(po_ptr + (offs_s * H * HD + e0)[:, None] + offs_e[None, :], cache_modifier=".cg")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    wgt = tl.exp2(lse - m)
    total = tl.sum(wgt, 0)
    res = tl.sum(wgt[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(attn_ptr + e0 + offs_e, res.to(attn_ptr.dtype.element_ty))


@triton.jit
def _decode_layers(
    h_ptr, qkv_ptr, po_ptr, plse_ptr, attn_ptr, gu_ptr, bar_ptr, trace_ptr,
    w_ptr, woff_ptr, kc_ptr, vc_ptr, kv_layer_stride,
    cos_ptr, sin_ptr, pos_ptr, slot_ptr, ctx_ptr, bt_ptr,
    eps, scale_log2, layer_lo, layer_hi,
    D: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, HD: tl.constexpr, INTER: tl.constexpr,
    P: tl.constexpr, S: tl.constexpr, G_PAD: tl.constexpr, PAGE: tl.constexpr, QK_NORM: tl.constexpr,
    RC_QKV: tl.constexpr, RC_O: tl.constexpr, RC_GU: tl.constexpr, RC_DN: tl.constexpr,
    KC_QKV: tl.constexpr, KC_O: tl.constexpr, KC_GU: tl.constexpr, KC_DN: tl.constexpr,
    PHASES: tl.constexpr, PERSISTENT: tl.constexpr, UPCAST: tl.constexpr,
    EARLY_GU: tl.constexpr = True, TRACE: tl.constexpr = False, WORK: tl.constexpr = True,
    TRACE_ALL: tl.constexpr = 0, NB: tl.constexpr = 0, MAX_POLLS: tl.constexpr = 1 << 26,
):  # fmt: skip
    """Layers [layer_lo, layer_hi) of the batch-1 decode, the phases in the PHASES bit mask
    (module docstring). PERSISTENT: one launch of P resident programs, a grid barrier after every
    phase, each GEMV's weight slice loaded a phase or more ahead; else one phase per launch.
    The look-ahead is spread over the barriers, since a program polling a barrier behind ~100 KB
    of outstanding loads sees it pass 2-3.5 us late (TRACE_ALL), behind <= 48 KB ~1 us: each
    attention item's first KV tile goes out in the q/k/v phase, o_proj's slice in the attention
    phase, gate/up's first tile in the merge phase and the rest in the o_proj phase (each
    measured faster than the arrangement before it: 715 against 724 us for 28 layers, then
    709-715 against 715-722 in three runs on the H200).
    EARLY_GU off: gate/up's whole slice in the o_proj phase instead (measured slower);
    TRACE: program 0's clock at every barrier and inside the phases; TRACE_ALL (not with TRACE):
    every program's clock at each arrival (bit 0) and each barrier's passing (bit 1), for NB
    barriers; WORK off (the barriers only)
    is for a per-phase timing breakdown. MAX_POLLS: _grid_wait's watchdog (tests
    lower it). (L2 prefetch of weights or KV, and the
    merge folded into the attention phase behind a per-head counter, were measured slower, so the
    kernel does not have them.)"""
    NQ: tl.constexpr = H * HD
    NQKV: tl.constexpr = (H + 2 * HKV) * HD
    R_QKV: tl.constexpr = NQKV // P
    R_O: tl.constexpr = D // P
    R_GU: tl.constexpr = 2 * INTER // P
    R_DN: tl.constexpr = D // P
    EM: tl.constexpr = NQ // P
    pid = tl.program_id(0)
    pos = tl.load(pos_ptr)
    slot = tl.load(slot_ptr)
    ctx = tl.load(ctx_ptr).to(tl.int32)
    nb = pid * 0  # barriers passed (PERSISTENT)
    _trace(trace_ptr, 0, TRACE)
    # Weight slices in registers (_gemv): in the persistent kernel each GEMV phase loads the next
    # one's slice right after its own compute (AHEAD_*), so it streams in during the barrier and
    # the phases between; a phase whose predecessor does not run loads its own.
    AHEAD_O: tl.constexpr = PERSISTENT and (PHASES & 1) != 0 and (PHASES & 8) != 0
    AHEAD_GU: tl.constexpr = PERSISTENT and (PHASES & 8) != 0 and (PHASES & 16) != 0
    AHEAD_DN: tl.constexpr = PERSISTENT and (PHASES & 16) != 0 and (PHASES & 32) != 0
    AHEAD_QKV: tl.constexpr = PERSISTENT and (PHASES & 32) != 0 and (PHASES & 1) != 0
    # EARLY_GU: gate/up's first tile loaded already in the merge phase, the rest in o_proj's.
    GU_AT_MERGE: tl.constexpr = EARLY_GU and AHEAD_GU and (PHASES & 4) != 0
    # Spread over the barriers (docstring): o_proj's slice after the attention phase, each
    # attention item's first key tile in the q/k/v phase.
    O_AT_ATTN: tl.constexpr = AHEAD_O and (PHASES & 2) != 0
    AHEAD_KV: tl.constexpr = PERSISTENT and (PHASES & 1) != 0 and (PHASES & 2) != 0
    r_qkv = pid * R_QKV
    if AHEAD_QKV:  # the first layer's; later layers' come from the down phase before (carried
        # across the loop: a stand-in tile of _load4 folds into the first, the PTX is the same)
        w_first = _weight(w_ptr, woff_ptr + layer_lo * N_WEIGHTS, 1)
        q0, q1, q2, q3 = _load4(w_first, r_qkv, D, R_QKV, RC_QKV, KC_QKV, True)
    for layer in range(layer_lo, layer_hi):
        row = woff_ptr + layer * N_WEIGHTS
        nxt = woff_ptr + tl.minimum(layer + 1, layer_hi - 1) * N_WEIGHTS
        has_next = layer + 1 < layer_hi
        # TRACE's inner marks of this layer: 2 a phase, after the barrier marks.
        tin = (layer_hi - layer_lo) * N_PHASES + 1 + (layer - layer_lo) * (2 * N_PHASES)
        layer_off = tl.cast(layer, tl.int64) * kv_layer_stride  # past 2**31 elements in big pools
        kc_l = kc_ptr + layer_off
        vc_l = vc_ptr + layer_off
        if PHASES & 1:  # qkv
            if not AHEAD_QKV:
                q0, q1, q2, q3 = _load4(_weight(w_ptr, row, 1), r_qkv, D, R_QKV, RC_QKV, KC_QKV, True)
            if WORK:
                _gemv(q0, q1, q2, q3, r_qkv, h_ptr, _weight(w_ptr, row, 0), eps, qkv_ptr,
                      D, R_QKV, RC_QKV, KC_QKV, 0, 0, False, trace_ptr, tin, TRACE)  # fmt: skip
            if PERSISTENT:
                _grid_arrive(bar_ptr, trace_ptr, nb, NB, TRACE_ALL)
            if AHEAD_O and not O_AT_ATTN:
                o0, o1, o2, o3 = _load4(_weight(w_ptr, row, 4), pid * R_O, NQ, R_O, RC_O, KC_O, True)
            if AHEAD_KV:
                k1, k2, v, nmask = _first_kv_tile(pid, kc_l, vc_l, bt_ptr, ctx, HKV, HD, S, PAGE)
            if PERSISTENT:
                nb = _grid_done(bar_ptr, nb, P, trace_ptr, TRACE, NB, TRACE_ALL, MAX_POLLS)
        if PHASES & 2:  # attention partials
            if not AHEAD_KV:
                k1, k2, v, nmask = _first_kv_tile(pid, kc_l, vc_l, bt_ptr, ctx, HKV, HD, S, PAGE)
            if WORK:  # (every program holds an item: P = HKV * S)
                _attention_item(
                    pid, qkv_ptr, _weight(w_ptr, row, 2), _weight(w_ptr, row, 3), kc_l, vc_l,
                    cos_ptr, sin_ptr, bt_ptr, po_ptr, plse_ptr, pos, slot, ctx, eps, scale_log2,
                    k1, k2, v, nmask, H, HKV, HD, S, G_PAD, PAGE, QK_NORM, UPCAST, trace_ptr, tin + 2, TRACE,
                )  # fmt: skip
            if PERSISTENT:
                _grid_arrive(bar_ptr, trace_ptr, nb, NB, TRACE_ALL)
            if O_AT_ATTN:
                o0, o1, o2, o3 = _load4(_weight(w_ptr, row, 4), pid * R_O, NQ, R_O, RC_O, KC_O, True)
            if PERSISTENT:
                nb = _grid_done(bar_ptr, nb, P, trace_ptr, TRACE, NB, TRACE_ALL, MAX_POLLS)
        if PHASES & 4:  # merge
            if WORK:
                _merge(pid * EM, po_ptr, plse_ptr, attn_ptr, H, HD, S, EM)
            if PERSISTENT:
                _grid_arrive(bar_ptr, trace_ptr, nb, NB, TRACE_ALL)
            if GU_AT_MERGE:  # its first tile only, the rest after o_proj
                u0 = _tile(_weight(w_ptr, row, 6), pid * R_GU, 0, D, RC_GU, KC_GU, True)
            if PERSISTENT:
                nb = _grid_done(bar_ptr, nb, P, trace_ptr, TRACE, NB, TRACE_ALL, MAX_POLLS)
        if PHASES & 8:  # o_proj + residual
            if not AHEAD_O:
                o0, o1, o2, o3 = _load4(_weight(w_ptr, row, 4), pid * R_O, NQ, R_O, RC_O, KC_O, True)
            if WORK:
                _gemv(o0, o1, o2, o3, pid * R_O, attn_ptr, w_ptr, eps, h_ptr, NQ, R_O, RC_O, KC_O, 1, 0, True,
                      trace_ptr, tin + 6, TRACE)  # fmt: skip
            if PERSISTENT:
                _grid_arrive(bar_ptr, trace_ptr, nb, NB, TRACE_ALL)
            if AHEAD_GU and not GU_AT_MERGE:
                u0, u1, u2, u3 = _load4(_weight(w_ptr, row, 6), pid * R_GU, D, R_GU, RC_GU, KC_GU, True)
            if GU_AT_MERGE:
                u1, u2, u3 = _load_rest(_weight(w_ptr, row, 6), pid * R_GU, u0, D, R_GU, RC_GU, KC_GU, True)
            if PERSISTENT:
                nb = _grid_done(bar_ptr, nb, P, trace_ptr, TRACE, NB, TRACE_ALL, MAX_POLLS)
        if PHASES & 16:  # gate/up
            if not AHEAD_GU:
                u0, u1, u2, u3 = _load4(_weight(w_ptr, row, 6), pid * R_GU, D, R_GU, RC_GU, KC_GU, True)
            if WORK:
                _gemv(u0, u1, u2, u3, pid * R_GU, h_ptr, _weight(w_ptr, row, 5), eps, gu_ptr,
                      D, R_GU, RC_GU, KC_GU, 0, 0, False, trace_ptr, tin + 8, TRACE)  # fmt: skip
            if PERSISTENT:
                _grid_arrive(bar_ptr, trace_ptr, nb, NB, TRACE_ALL)
            if AHEAD_DN:
                d0, d1, d2, d3 = _load4(_weight(w_ptr, row, 7), pid * R_DN, INTER, R_DN, RC_DN, KC_DN, True)
            if PERSISTENT:
                nb = _grid_done(bar_ptr, nb, P, trace_ptr, TRACE, NB, TRACE_ALL, MAX_POLLS)
        if PHASES & 32:  # down + residual
            if not AHEAD_DN:
                d0, d1, d2, d3 = _load4(_weight(w_ptr, row, 7), pid * R_DN, INTER, R_DN, RC_DN, KC_DN, True)
            if WORK:
                _gemv(d0, d1, d2, d3, pid * R_DN, gu_ptr, w_ptr, eps, h_ptr,
                      INTER, R_DN, RC_DN, KC_DN, 2, INTER, True, trace_ptr, tin + 10, TRACE)  # fmt: skip
            if PERSISTENT and layer + 1 < layer_hi:
                _grid_arrive(bar_ptr, trace_ptr, nb, NB, TRACE_ALL)
            if AHEAD_QKV:
                q0, q1, q2, q3 = _load4(_weight(w_ptr, nxt, 1), r_qkv, D, R_QKV, RC_QKV, KC_QKV, has_next)
            if PERSISTENT and layer + 1 < layer_hi:
                nb = _grid_done(bar_ptr, nb, P, trace_ptr, TRACE, NB, TRACE_ALL, MAX_POLLS)


def _weight_offsets(per_layer: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, list[list[int]]]:
    """(base, offsets): the kernel reaches weight j of layer i at base + offsets[i][j] elements.
    On the GPU base is the lowest-addressed weight, so the model's own tensors are read in place
    (weight updates need nothing) with non-negative offsets. The interpreter copies every tensor
    argument, so a pointer into one cannot reach another: there the weights are packed into one
    buffer (a copy: tests only)."""
    flat = [t for ts in per_layer for t in ts]
    if os.environ.get("TRITON_INTERPRET") == "1":
        at, offs = 0, []
        for t in flat:
            offs.append(at)
            at += -(-t.numel() // 16) * 16  # the kernel's alignment promise (_weight)
        base = torch.zeros(at, dtype=flat[0].dtype, device=flat[0].device)
        for t, o in zip(flat, offs, strict=True):
            base[o : o + t.numel()] = t.reshape(-1)
    else:
        base = min(flat, key=lambda t: t.data_ptr())
        offs = [(t.data_ptr() - base.data_ptr()) // base.element_size() for t in flat]
        if base.data_ptr() % 16 or any(o % 16 for o in offs):
            raise ValueError("megakernel: weights must start 16-element aligned")
    n = len(per_layer[0])
    return base, [offs[i : i + n] for i in range(0, len(offs), n)]


def _tiling(rows: int, k: int) -> tuple[int, int] | None:
    """(RC, KC) of a GEMV slice of `rows` x `k` (_gemv): row chunks of RC over the whole K when K
    is a power of two, else one row chunk over K chunks of KC; at most 4 tiles of at most
    MAX_TILE elements. None if neither fits."""
    if k & (k - 1) == 0 and k <= MAX_TILE:
        rc = _pow2_divisor(rows, MAX_TILE // k)
        return (rc, k) if rows // rc <= 4 else None
    if rows & (rows - 1) == 0 and rows <= MAX_TILE:
        kc = _pow2_divisor(k, MAX_TILE // rows)
        return (rows, kc) if k // kc <= 4 else None
    return None


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n, at most cap."""
    return min(n & -n, cap)


@dataclass(frozen=True)
class Shape:
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    inter: int
    n_layers: int


def programs_for(shape: Shape, num_sms: int) -> int | None:
    """The program count P: the largest power of two <= num_sms dividing every phase's rows (so
    each program owns whole rows) with whole attention items, or None when none fits."""
    nq, nqkv = shape.n_heads * shape.head_dim, (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
    p = 1 << (max(num_sms, 1).bit_length() - 1)
    while p >= shape.n_kv_heads:
        rows_ok = all(n % p == 0 for n in (nqkv, shape.dim, 2 * shape.inter, nq))
        if rows_ok and p % shape.n_kv_heads == 0 and shape.head_dim % (nq // p) == 0:
            return p
        p //= 2
    return None


def residency_risk(env: Mapping[str, str] = os.environ) -> str | None:
    """Why the kernel's P programs might not all be resident at once (None: they will be, on an
    otherwise idle GPU with one program per SM). Under MPS with an SM limit
    (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE below 100) this client gets part of the SMs: the barrier
    would wait for programs that cannot start."""
    pct = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    if pct:
        try:
            limited = float(pct) < 100
        except ValueError:
            return f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct!r} is not a number"
        if limited:
            return f"MPS limits this client to {pct}% of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)"
    return None


# What the kernel reads of a layer's attention (q/k/v fused, optional QK norms) and MLP (gate/up fused).
_ATTENTION_PARTS = ("qkv", "q_norm", "k_norm", "o_proj")
_MLP_PARTS = ("gate_up", "down_proj")


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run the megakernel (None: it can). Dense GQA decoders with the fused
    q/k/v and gate/up GEMMs (CausalLM.fuse_projections), no biases, the float32 residual stream,
    a 16-bit dtype on the GPU (float32 too on CPU, for tests) and power-of-two head dims. The
    layers are checked for the modules the kernel reads, not for their classes: the model
    package builds on this one, not the other way round."""
    m = model.config  # type: ignore[attr-defined]
    if m.is_moe or m.is_mla:
        return "MoE and MLA models are not covered"
    if not model.fp32_residual:  # type: ignore[attr-defined]
        return "needs the float32 residual stream (ModelConfig.fp32_residual)"
    d = m.head_dim
    if d < 32 or d & (d - 1) or m.n_heads % m.n_kv_heads:
        # 32: the attention's tensor-core dots take head halves of >= 16 dims.
        return "needs a power-of-two head_dim >= 32 and whole GQA groups"
    g = m.n_heads // m.n_kv_heads
    if g & (g - 1):
        return "needs a power-of-two GQA group"
    for layer in model.model.layers:  # type: ignore[attr-defined]
        att, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(att, a) for a in _ATTENTION_PARTS) or not all(hasattr(mlp, a) for a in _MLP_PARTS):
            return "every layer must be plain attention + MLP"
        if att.qkv is None or mlp.gate_up is None or att.qkv.fp8 is not None or mlp.gate_up.fp8 is not None:
            return "needs q/k/v and gate/up fused into one bf16 GEMM each"
        if att.qkv.bias is not None or type(att.o_proj) is not torch.nn.Linear or att.o_proj.bias is not None:
            return "biases and converted linears are not covered"
        if type(mlp.down_proj) is not torch.nn.Linear:
            return "converted linears are not covered"
    weight = model.model.embed_tokens.weight  # type: ignore[attr-defined]
    if weight.is_cuda and weight.dtype not in (torch.bfloat16, torch.float16):
        return "needs a 16-bit model dtype"  # (float32 runs on CPU, under the interpreter: tests)
    return None


class DecodeMegakernel:
    """Runs a model's layers for one decode token (module docstring). Build after
    CausalLM.fuse_projections; weights are read in place, so weight updates need no rebuild."""

    def __init__(
        self, model: torch.nn.Module, kv_k: torch.Tensor, kv_v: torch.Tensor, page: int, num_sms: int
    ):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"megakernel: {why}")
        m = model.config  # type: ignore[attr-defined]
        self.shape = Shape(m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.hidden_dim, m.n_layers)
        p = programs_for(self.shape, num_sms)
        if p is None:
            raise ValueError(f"megakernel: no program count <= {num_sms} divides the model's rows")
        self.programs, self.eps = p, m.norm_eps
        self.kv_k, self.kv_v = kv_k, kv_v
        self.scale_log2 = m.head_dim**-0.5 * LOG2E
        layers = model.model.layers  # type: ignore[attr-defined]
        per_layer = []
        for layer in layers:
            att, mlp = layer.self_attn, layer.mlp
            qn = att.q_norm.weight if att.q_norm is not None else att.qkv.weight  # unread without QK norm
            kn = att.k_norm.weight if att.k_norm is not None else att.qkv.weight
            per_layer.append((layer.input_layernorm.weight, att.qkv.weight, qn, kn, att.o_proj.weight,
                              layer.post_attention_layernorm.weight, mlp.gate_up.weight, mlp.down_proj.weight))  # fmt: skip
        for t in (t for ts in per_layer for t in ts):
            if t.dtype != per_layer[0][1].dtype or not t.is_contiguous():
                raise ValueError("megakernel: every weight must be contiguous, in the model dtype")
        self.weights = per_layer  # the kernel reads them through raw offsets: keep them alive
        self.base, rows = _weight_offsets(per_layer)
        dev = self.base.device
        self.offsets = torch.tensor(rows, dtype=torch.int64, device=dev)
        self.cos, self.sin = model.rope_cos, model.rope_sin  # type: ignore[attr-defined]
        s = self.shape
        nq, nkv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        # Every program holds one attention item: P = HKV x partitions, both powers of two
        # (programs_for: P is one, and a multiple of HKV).
        self.partitions = p // s.n_kv_heads
        dt = self.base.dtype
        self.qkv = torch.zeros(nq + 2 * nkv, dtype=dt, device=dev)
        self.part_o = torch.zeros(self.partitions, s.n_heads, s.head_dim, dtype=torch.float32, device=dev)
        self.part_lse = torch.zeros(self.partitions, s.n_heads, dtype=torch.float32, device=dev)
        self.attn = torch.zeros(nq, dtype=dt, device=dev)
        self.gate_up = torch.zeros(2 * s.inter, dtype=dt, device=dev)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=dev)  # zeroed before every launch
        # Program 0's time after each barrier, then two inner marks a phase (TRACE: a per-phase
        # timing breakdown; off in the product).
        # TRACE_ALL: (arrival, passing) of every program at every barrier.
        marks = max(3 * s.n_layers * int(N_PHASES) + 1, 2 * p * s.n_layers * int(N_PHASES))
        self.trace = torch.zeros(marks, dtype=torch.int64, device=dev)
        r = {"QKV": (nq + 2 * nkv) // p, "O": s.dim // p, "GU": 2 * s.inter // p, "DN": s.dim // p}
        k = {"QKV": s.dim, "O": nq, "GU": s.dim, "DN": s.inter}
        tiling = {name: _tiling(r[name], k[name]) for name in r}
        if any(t is None for t in tiling.values()):
            raise ValueError(f"megakernel: no tiling of the GEMV slices {r} (K {k}) in <= 4 tiles")
        self.meta = {
            "D": s.dim, "H": s.n_heads, "HKV": s.n_kv_heads, "HD": s.head_dim, "INTER": s.inter, "P": p,
            # >= 16 query rows: the attention's tensor-core dots (padding rows are zeros).
            "S": self.partitions, "G_PAD": max(16, triton.next_power_of_2(s.n_heads // s.n_kv_heads)),
            "PAGE": page, "QK_NORM": bool(m.qk_norm), "NB": s.n_layers * int(N_PHASES),
            **{f"RC_{name}": t[0] for name, t in tiling.items() if t is not None},
            **{f"KC_{name}": t[1] for name, t in tiling.items() if t is not None},
        }  # fmt: skip
        # Launch overrides of _decode_layers' switches and num_warps, for measuring them (none in
        # the product).
        self.tuning: dict[str, int | bool] = {}
        self.compiled: object = None

    def run(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor,
            block_table: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """h: the float32 residual stream [1, dim] after the embedding, updated in place through
        every layer and returned. positions / slots / ctx_lens: [1] device tensors of the decode
        row; block_table: its [pages] row (unit stride)."""
        if h.dtype != torch.float32 or h.numel() != self.shape.dim or not h.is_contiguous():
            raise ValueError("megakernel: h must be a contiguous float32 [1, dim] row")
        if block_table.stride(-1) != 1:
            raise ValueError("megakernel: the block table row must have unit stride")
        args = (
            h, self.qkv, self.part_o, self.part_lse, self.attn, self.gate_up, self.barrier, self.trace,
            self.base, self.offsets, self.kv_k, self.kv_v, self.kv_k.stride(0),
            self.cos, self.sin, positions, slots, ctx_lens, block_table,
            self.eps, self.scale_log2,
        )  # fmt: skip
        n = self.shape.n_layers
        self.barrier.zero_()
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if interpreted and self.programs > 1:
            # Programs run one after another: a barrier would wait forever, so one launch a phase.
            for layer in range(n):
                for phase in range(int(N_PHASES)):
                    _decode_layers[(self.programs,)](
                        *args, layer, layer + 1, **self.meta, PHASES=1 << phase, PERSISTENT=False, UPCAST=True
                    )
            return h
        # The persistent launch; interpreted only with one program, whose barriers pass at once
        # (how tests run this launch's look-ahead loads and barrier bookkeeping on CPU).
        launch = {"PHASES": (1 << int(N_PHASES)) - 1, "num_warps": int(NUM_WARPS), **self.tuning}
        # (the compiled kernel: its n_regs and n_spills say whether it fits the registers)
        self.compiled = _decode_layers[(self.programs,)](
            *args, 0, n, **self.meta, PERSISTENT=True, UPCAST=interpreted, **launch
        )
        return h


__all__ = ["DecodeMegakernel", "programs_for", "residency_risk", "unsupported"]
