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

With data-parallel attention every attention group has its own pool and page ids: an exchange per
group (`GroupedPageExchange`) sends its imports to that group's ranks only and reads its exports
from them (another group's first rank sends the gathered pages to rank 0).
"""

from __future__ import annotations

from collections.abc import Callable
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
from services.engine.parallel.orders import send
from services.engine.sequence import Sequence


@dataclass
class ExportOrder:
    """Cut these pages out of the pools of attention group `group`'s ranks and gather them in its
    first rank; with `send` that rank sends them to rank 0 (a gather over the whole engine, every
    rank taking part), which does not hold that group's pages."""

    pages: list[int]
    group: int = 0
    send: bool = False


@dataclass
class ImportOrder:
    """Write these whole pages' (`data`: [n, page bytes] uint8) parts into the pools of attention
    group `group`'s ranks (the other groups' ranks have other pages under these ids)."""

    pages: list[int]
    data: Any  # numpy uint8 array (pickled by the broadcast)
    group: int = 0


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


def run_export(order: ExportOrder, kv: KVCache, m: ModelConfig, groups: EngineGroups) -> None:
    """A worker rank's part of an export: its group's gather, and the send to rank 0."""
    mine = order.group == groups.dp_rank
    part = gather_pages(kv, order.pages, m, groups) if mine else None
    if order.send:
        groups.world.gather_objects(part.cpu().numpy() if part is not None and groups.tp.rank == 0 else None)


def run_import(order: ImportOrder, kv: KVCache, m: ModelConfig, groups: EngineGroups) -> None:
    """A worker rank's part of an import: only the ranks of the order's attention group write."""
    if order.group == groups.dp_rank:
        scatter_pages(kv, order.pages, torch.from_numpy(order.data), m, groups)


class GatheringPageExchange(PageExchange):
    """Rank 0's page exchange for one attention group's pool (`group`; the only one without
    data-parallel attention): exports and imports whole pages (gather_pages, scatter_pages) through
    that group's ranks. For a group other than rank 0's, `kv` is rank 0's bookkeeping of its pool
    (dp.group_pages): pages are claimed and registered there, their bytes live on the group's ranks."""

    def __init__(self, kv: KVCache, m: ModelConfig, groups: EngineGroups, group: int = 0) -> None:
        super().__init__(kv, layout=full_layout(m, kv, groups))
        self.model_config, self.groups, self.group = m, groups, group
        self._page_bytes = sum(t.numel() * t.element_size() for t in full_pools(m, kv, groups))
        self._copy_stream = None  # imports are orders to every rank, in step order: synchronous

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    def blob(self, pages: Seq[int]) -> torch.Tensor:
        if not pages:
            device = self.kv.k.device if self.group == 0 else torch.device("cpu")
            return torch.empty((0, self._page_bytes), dtype=torch.uint8, device=device)
        if self.group != 0:
            send(self.groups, ExportOrder(list(pages), self.group, send=True))
            got = self.groups.world.gather_objects(None)
            assert got is not None
            return torch.from_numpy(got[self.group * self.groups.tp.size])
        if heads_split(self.model_config, self.groups):
            send(self.groups, ExportOrder(list(pages)))
        return gather_pages(self.kv, pages, self.model_config, self.groups)

    def _scatter(self, pages: list[int], full: torch.Tensor) -> None:
        """Every rank of the group writes its parts of the whole pages (rank 0 when it is one)."""
        send(self.groups, ImportOrder(pages, full.numpy(), self.group))
        if self.group == 0:
            scatter_pages(self.kv, pages, full, self.model_config, self.groups)

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
            self._scatter(claim.pages, full.cpu().contiguous())
        return _register(self.kv, claim)

    def write_tail(self, tail: PromptTail, page: int) -> None:
        """The scheduler's tail write (Scheduler.write_tail) over the ranks: the whole page to
        every rank, each writing its parts into `page` of its pool, before the step that reads it
        (orders run in step order)."""
        full = tail.data.reshape(1, -1).cpu().contiguous()
        if full.shape[1] != self._page_bytes:
            raise ValueError(f"a tail of {full.shape[1]} bytes for pages of {self._page_bytes} bytes")
        self._scatter([page], full)


class GroupedPageExchange(PageExchange):
    """Rank 0's page exchange with data-parallel attention: one GatheringPageExchange per attention
    group (`parts`), behind the single exchange's interface (stage, drain, export, ...).

    Placement comes first: when a request is added, the grouped scheduler picks its group (taking
    into account the pages staged for its prompt, `staged_keys`) and calls `import_for`, which
    imports the staged batches of that prompt into that group's pool at once. A staged batch no
    request claimed is imported at the next drain into the group that holds most of its chain's
    cached head (`choose_group`). Exports read each sequence's pages from its own group's ranks."""

    def __init__(
        self,
        parts: list[GatheringPageExchange],
        group_of: Callable[[Sequence], int],
        choose_group: Callable[[list[bytes], list[bytes]], int],
    ) -> None:
        super().__init__(parts[0].kv, layout=parts[0].layout)
        self.parts, self.group_of, self.choose_group = parts, group_of, choose_group
        self._copy_stream = None  # imports are orders to the ranks, in step order: synchronous
        self._export_group = 0

    @property
    def page_bytes(self) -> int:
        return self.parts[0].page_bytes

    def blob(self, pages: Seq[int]) -> torch.Tensor:
        return self.parts[self._export_group].blob(pages)

    def import_batch(self, hashes: list[bytes], data: PageBytes, pin: list[bytes]) -> int:
        return self.parts[self.choose_group(hashes, pin)].import_batch(hashes, data, pin)

    def staged_keys(self) -> set[bytes]:
        """The keys of every page staged and not imported yet (placement reads them)."""
        return {h for hashes, _, _, _ in self._staged for h in hashes}

    def import_for(self, keys: set[bytes], group: int) -> int:
        """Import the staged batches holding any of `keys` (a prompt's pages) into `group`'s pool
        now, before the request is admitted there. Returns the pages imported."""
        n = 0
        rest = []
        for batch in self._staged:
            hashes, data, pin, release = batch
            if keys.isdisjoint(hashes):
                rest.append(batch)
            else:
                n += self.import_now(hashes, data, pin, release, self.parts[group].import_batch)
        self._staged.clear()
        self._staged.extend(rest)
        return n

    def export(self, seqs: Seq[Sequence], finished: list[str]) -> None:
        """Each group's sequences from its own ranks (page ids are per group); the finished
        request ids go with the last call."""
        by_group: dict[int, list[Sequence]] = {}
        for s in seqs:
            by_group.setdefault(self.group_of(s), []).append(s)
        order = sorted(by_group) or [0]
        for i, g in enumerate(order):
            self._export_group = g
            try:
                super().export(by_group.get(g, []), finished if i == len(order) - 1 else [])
            finally:
                self._export_group = 0
