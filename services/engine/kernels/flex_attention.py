"""Paged attention through FlexAttention: the comparison backend to the Triton kernels.

attention_backend "flex". The page pool of one layer, [rows, n_kv, D], is viewed as one KV
"sequence" [1, n_kv, rows, D]; the step's queries are gathered per sequence into [S, H, Lq, D]
(Lq: the longest span, padded to a power of two). A BlockMask with KV blocks of one page lists each
sequence's pages (its block table, already physical page ids), so the kernel visits only those; a
mask_mod then keeps key row r for query i of sequence b iff r's page is b's page at that logical
index and r's logical position is <= i's position. The logical index of a page comes from a
per-step page -> index map: a page shared by several sequences (prefix cache, forks) sits at the
same index in all of them, so the map is well defined.

On CUDA flex_attention is torch.compile'd (dynamic shapes: batch, query and page counts change
every step); elsewhere it runs eagerly (dense reference implementation), which is what the CPU
tests use.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from services.engine.batch import HostBatch

Q_BLOCK = 128
_compiled: dict[str, Any] = {}
# The transposed (per-KV-block) lists only serve the backward pass; skip them where torch allows.
_NO_Q_BLOCKS: dict[str, Any] = (
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)


@dataclass
class FlexMeta:
    q_index: torch.Tensor  # [S, Lq] flat row of each (sequence, query) (padding: the first row)
    q_valid: torch.Tensor  # [S, Lq]
    out_rows: torch.Tensor  # [N] flat rows of the valid queries, in q_valid order
    block_mask: BlockMask


def _flex(device: torch.device) -> Any:
    if device.type != "cuda":
        return flex_attention
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(flex_attention, dynamic=True)
    return _compiled["fn"]


def build_flex_meta(hb: HostBatch, device: torch.device, num_pages: int, page: int) -> FlexMeta:
    lq = 1 << (int(hb.q_lens.max()) - 1).bit_length()
    ar = np.arange(lq)
    valid = ar[None, :] < hb.q_lens[:, None]
    q_index = np.where(valid, hb.q_start[:, None] + ar[None, :], 0)
    # Padding queries sit at the sequence's last position: they see keys, so no all-masked row.
    q_pos = np.minimum(hb.ctx_lens[:, None] - hb.q_lens[:, None] + ar[None, :], hb.ctx_lens[:, None] - 1)
    n_pages = -(-hb.ctx_lens // page)
    p = hb.tables.shape[1]
    in_table = np.arange(p)[None, :] < n_pages[:, None]
    tables = np.where(in_table, hb.tables, -1)
    q_blocks = -(-lq // Q_BLOCK)

    def dev(x: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype)

    tables_d = dev(tables)
    q_pos_d = dev(q_pos)
    logical = torch.zeros(num_pages, dtype=torch.int64, device=device)
    cols = np.broadcast_to(np.arange(p), tables.shape)
    logical[dev(hb.tables[in_table])] = dev(cols[in_table])

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        pg = kv_idx // page
        lp = logical[pg]
        return (tables_d[b, lp] == pg) & (lp * page + kv_idx % page <= q_pos_d[b, q_idx])

    kv_num = dev(np.repeat(n_pages[:, None, None], q_blocks, axis=2), torch.int32)
    # BlockMask wants the index lists as wide as the KV has blocks (here: pages in the pool).
    kv_idx = torch.zeros((len(hb.q_lens), 1, q_blocks, num_pages), dtype=torch.int32, device=device)
    kv_idx[..., :p] = dev(np.where(in_table, hb.tables, 0), torch.int32)[:, None, None, :]
    block_mask = BlockMask.from_kv_blocks(
        kv_num, kv_idx, BLOCK_SIZE=(Q_BLOCK, page), mask_mod=mask_mod, seq_lengths=(lq, num_pages * page),
        **_NO_Q_BLOCKS,
    )  # fmt: skip
    return FlexMeta(dev(q_index), dev(valid, torch.bool), dev(q_index[valid]), block_mask)


def kernel_options(page: int) -> dict[str, Any]:
    """Compiled flex tiles the KV in blocks that must divide the BlockMask's KV block (one page):
    its default 64-128 key tiles failed to compile for 16-token pages (torch 2.11; with a tile of
    one page the engine's flex tests pass on the H200). Pages under 16 tokens: engine.py refuses."""
    return {"BLOCK_N": min(page, 128)}


def flex_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: FlexMeta, scale: float
) -> torch.Tensor:
    """q [T, H, D] (k/v already stored) -> [T, H, D]."""
    h, n_kv = q.shape[1], k_cache.shape[1]
    qg = q[meta.q_index].transpose(1, 2)  # [S, H, Lq, D]
    s = qg.shape[0]
    # One KV "sequence": the whole pool, shared by every batch row.
    k = k_cache.permute(1, 0, 2).unsqueeze(0).expand(s, -1, -1, -1)
    v = v_cache.permute(1, 0, 2).unsqueeze(0).expand(s, -1, -1, -1)
    page = meta.block_mask.BLOCK_SIZE[1]
    o = _flex(q.device)(
        qg,
        k,
        v,
        block_mask=meta.block_mask,
        scale=scale,
        enable_gqa=h != n_kv,
        kernel_options=kernel_options(page),
    )
    out = torch.empty_like(q)
    out[meta.out_rows] = o.transpose(1, 2)[meta.q_valid]
    return out
