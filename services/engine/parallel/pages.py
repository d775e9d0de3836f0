"""KV page export from a multi-rank engine: the full page, as a single-rank engine writes it.

Under tensor parallelism a GQA model's K and V pools are split by KV heads over the tp ranks
(`kv_head_range`: rank r holds heads [r * H / tp, (r + 1) * H / tp), or one head shared by
tp / H ranks when H < tp); MLA's latent, the DSA indexer's keys and the routing store are whole
on every rank. An export (`GatheringPageExchange.blob`, called from rank 0's step loop, between
steps) is an order every rank carries out: each rank cuts its part of the pages out of its pools
and the tp group all-gathers the head-split ones, which rank 0 puts back in head order. The bytes
are then exactly a single-rank engine's page (`kv_transfer.export_blob`'s layout: per pool,
[layers, block_size, heads, head_dim] per page), under the single-rank page layout id
(`full_layout`), so a decode with any number of ranks that imports single-rank pages continues
from them, and the KV store, the near tier and the handoffs see ordinary pages.

Imports (pages pulled from the store, handed off) go the other way: rank 0 claims the pages in its
page table (`GatheringPageExchange.import_batch`, from the step loop's drain, between steps) and
sends the whole pages to every rank (`ImportOrder`), each rank writing its own KV heads of them (and
the pools every rank holds whole) into its pool (`scatter_pages`), synchronously. A handoff's
partial last prompt page (`PromptTail`, written by the scheduler at admission into the sequence's
own page) goes the same way (`GatheringPageExchange.write_tail`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from services.common.config import ModelConfig
from services.engine.kv_cache import KVCache
from services.engine.kv_transfer import (
    HostPages,
    PageBytes,
    PageExchange,
    PromptTail,
    _claim,
    _nbytes,
    _register,
    as_uint8,
    layout_id,
    pool_tensors,
    write_pages,
)
from services.engine.parallel.group import EngineGroups
from services.engine.parallel.linear import kv_head_range


@dataclass
class ExportOrder:
    """Cut these pages out of every rank's pools and gather them on rank 0."""

    pages: list[int]


@dataclass
class ImportOrder:
    """Write these whole pages' (`data`: [n, page bytes] uint8) parts into every rank's pools."""

    pages: list[int]
    data: Any  # numpy uint8 array (pickled by the broadcast)


def heads_split(m: ModelConfig, groups: EngineGroups) -> bool:
    """Whether the rank's K/V pools hold only its share of the KV heads."""
    return groups.tp.size > 1 and not m.is_mla


def page_parts(kv: KVCache, pages: Seq[int]) -> list[torch.Tensor]:
    """Each pool's rows of `pages`, [n, layers, block_size, ...] (export_blob's per-pool layout)."""
    bs = kv.block_size
    idx = torch.tensor(list(pages), dtype=torch.long, device=kv.k.device)
    rows = (idx[:, None] * bs + torch.arange(bs, device=idx.device)).reshape(-1)
    n = len(pages)
    return [
        t[:, rows].reshape(t.shape[0], n, bs, *t.shape[2:]).transpose(0, 1).contiguous()
        for t in pool_tensors(kv)
    ]


def gather_pages(kv: KVCache, pages: Seq[int], m: ModelConfig, groups: EngineGroups) -> torch.Tensor:
    """The full pages as one [n, page bytes] uint8 tensor (every rank of the tp group calls it;
    only rank 0's result is used). The K and V pools of a head-split cache are gathered from the
    tp group and put back in head order, one copy of each replicated head; every other pool is
    whole on each rank already."""
    parts = page_parts(kv, pages)
    n = len(pages)
    if heads_split(m, groups):
        tp = groups.tp
        # Ranks holding distinct heads: all of them, or the first of each run sharing a head.
        every = max(1, tp.size // m.n_kv_heads)
        for i in range(2):  # k, v: [n, L, bs, H_local, head_dim]
            got = tp.all_gather(parts[i])[::every]  # [holders, n, L, bs, H_local, d]
            parts[i] = got.permute(1, 2, 3, 0, 4, 5).reshape(*got.shape[1:4], -1, got.shape[-1])
    return torch.cat([p.contiguous().view(torch.uint8).reshape(n, -1) for p in parts], dim=1)


def full_pools(m: ModelConfig, kv: KVCache, groups: EngineGroups) -> list[torch.Tensor]:
    """One page of each pool as a single-rank engine holds it (meta tensors [layers, block_size,
    ...]): the K and V pools with every KV head."""
    out = []
    for i, t in enumerate(pool_tensors(kv)):
        rest = (m.n_kv_heads, *t.shape[3:]) if i < 2 and heads_split(m, groups) else t.shape[2:]
        out.append(torch.empty((t.shape[0], kv.block_size, *rest), dtype=t.dtype, device="meta"))
    return out


def full_layout(m: ModelConfig, kv: KVCache, groups: EngineGroups) -> str:
    """The single-rank engine's layout id for this model and page size (what gathered pages are)."""
    pools = full_pools(m, kv, groups)
    return layout_id(m.arch, SimpleNamespace(block_size=kv.block_size, pools=lambda: pools))  # type: ignore[arg-type]


def scatter_pages(
    kv: KVCache, pages: Seq[int], full: torch.Tensor, m: ModelConfig, groups: EngineGroups
) -> None:
    """Write whole pages (`full` [n, page bytes] uint8, the single-rank layout) into this rank's
    pools: its KV heads of the K and V pools when they are head-split, every other pool whole."""
    n = len(pages)
    local, at = [], 0
    for i, t in enumerate(full_pools(m, kv, groups)):
        size = t.numel() * t.element_size()
        part = full[:, at : at + size]
        at += size
        if i < 2 and heads_split(m, groups):
            first, last = kv_head_range(m.n_kv_heads, groups.tp.size, groups.tp.rank)
            part = part.view(t.dtype).reshape(n, *t.shape)[:, :, :, first:last].contiguous()
            part = part.view(torch.uint8).reshape(n, -1)
        local.append(part)
    write_pages(kv, pages, torch.cat(local, dim=1).contiguous())


class GatheringPageExchange(PageExchange):
    """Rank 0's page exchange of a multi-rank engine (one attention group): exports and imports
    whole pages (gather_pages, scatter_pages)."""

    def __init__(self, kv: KVCache, m: ModelConfig, groups: EngineGroups) -> None:
        super().__init__(kv, layout=full_layout(m, kv, groups))
        self.model_config, self.groups = m, groups
        self._page_bytes = sum(t.numel() * t.element_size() for t in full_pools(m, kv, groups))
        self._copy_stream = None  # imports are orders to every rank, in step order: synchronous

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    def blob(self, pages: Seq[int]) -> torch.Tensor:
        if not pages:
            return torch.empty((0, self._page_bytes), dtype=torch.uint8, device=self.kv.k.device)
        if heads_split(self.model_config, self.groups):
            self.groups.world.broadcast_object(ExportOrder(list(pages)))
        return gather_pages(self.kv, pages, self.model_config, self.groups)

    def import_batch(self, hashes: list[bytes], data: PageBytes, pin: list[bytes]) -> int:
        """Claim the pages that are not cached yet in rank 0's page table, have every rank write
        its parts of them, register them (kv_transfer.import_pages over the ranks)."""
        per = self._page_bytes
        if _nbytes(data) != len(hashes) * per:
            raise ValueError(f"{_nbytes(data)} bytes for {len(hashes)} pages of {per} bytes")
        claim = _claim(self.kv, hashes, pin)
        if claim.pages:
            if isinstance(data, HostPages):
                full = data.to_device_pages(torch.device("cpu"), claim.todo)
            else:
                full = as_uint8(data).reshape(len(hashes), per)[claim.todo]
            full = full.cpu().contiguous()
            self.groups.world.broadcast_object(ImportOrder(claim.pages, full.numpy()))
            scatter_pages(self.kv, claim.pages, full, self.model_config, self.groups)
        return _register(self.kv, claim)

    def write_tail(self, tail: PromptTail, page: int) -> None:
        """The scheduler's tail write (Scheduler.write_tail) over the ranks: the whole page to
        every rank, each writing its parts into `page` of its pool, before the step that reads it
        (orders run in step order)."""
        full = tail.data.reshape(1, -1).cpu().contiguous()
        if full.shape[1] != self._page_bytes:
            raise ValueError(f"a tail of {full.shape[1]} bytes for pages of {self._page_bytes} bytes")
        self.groups.world.broadcast_object(ImportOrder([page], full.numpy()))
        scatter_pages(self.kv, [page], full, self.model_config, self.groups)
