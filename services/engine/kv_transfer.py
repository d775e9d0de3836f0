"""KV pages as bytes: export pages of the paged cache, import them into another engine's cache.

A page's bytes are, for each pool tensor of the cache in order (K then V for the GQA layout), the
rows of that page across all layers ([n_layers, block_size, ...] contiguous, native dtype), so a
page is `page_nbytes(kv)` raw bytes with no header. What a page *means* is carried by its key:
the prefix-cache hash chain (kv_cache.block_hash) rooted at root_hash(weight version, layout_id),
and layout_id names everything that decides the bytes' interpretation (model shape, KV dtype,
page size). Two engines exchange pages only when their layout ids, and so their keys, agree; a
page of another model, dtype, page size or weight version can never be looked up by mistake.

Import registers pages in the prefix cache with no users (ref 0, evictable), exactly as a page a
finished sequence left behind: the scheduler's next admission finds them as ordinary prefix hits.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from services.engine.kv_cache import KVCache, block_hash, root_hash

if TYPE_CHECKING:
    from services.engine.sequence import Sequence

log = logging.getLogger(__name__)


def pool_tensors(kv: KVCache) -> list[torch.Tensor]:
    """The cache's per-token pools, each [n_layers, num_blocks * block_size, ...]. A cache layout
    with other pools (e.g. an MLA latent cache) exposes them as `kv.pools()`."""
    pools = getattr(kv, "pools", None)
    if callable(pools):
        return list(pools())
    return [kv.k, kv.v]


def page_nbytes(kv: KVCache) -> int:
    bs = kv.block_size
    return sum(t.shape[0] * bs * t[0, 0].numel() * t.element_size() for t in pool_tensors(kv))


def layout_id(arch: str, kv: KVCache) -> str:
    """What must agree for a page's bytes to be usable elsewhere: the model's architecture name and
    every pool's per-page shape and dtype (layers, heads, head dim, page size)."""
    parts = [arch, f"bs{kv.block_size}"]
    for t in pool_tensors(kv):
        shape = "x".join(str(d) for d in (t.shape[0], kv.block_size, *t.shape[2:]))
        parts.append(f"{shape}:{str(t.dtype).removeprefix('torch.')}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest() + ":" + ",".join(parts)


def chain_hashes(
    tokens: Seq[int], version: int, layout: str, block_size: int, limit: int | None = None
) -> list[bytes]:
    """Keys of the full pages of `tokens` (at most `limit`), as the scheduler computes them."""
    n = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    prev = root_hash(version, layout)
    out = []
    for i in range(n):
        prev = block_hash(prev, list(tokens[i * block_size : (i + 1) * block_size]))
        out.append(prev)
    return out


def reusable_pages(num_tokens: int, block_size: int) -> int:
    """Full pages a prompt of num_tokens can take from a cache: its last token is always computed
    (its logits give the next token), as in Scheduler._admit."""
    return max(0, (num_tokens - 1) // block_size)


def _rows(kv: KVCache, pages: Seq[int]) -> torch.Tensor:
    bs = kv.block_size
    device = pool_tensors(kv)[0].device
    idx = torch.tensor(list(pages), dtype=torch.long, device=device)
    return (idx[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)


def export_pages(kv: KVCache, pages: Seq[int]) -> bytes:
    """The bytes of `pages` (page ids of this cache), concatenated in order."""
    if not pages:
        return b""
    return export_blob(kv, pages).cpu().numpy().tobytes()


def export_blob(kv: KVCache, pages: Seq[int]) -> torch.Tensor:
    """`pages` as one [n, page_nbytes] uint8 tensor on the cache's device (export_pages' bytes)."""
    rows = _rows(kv, pages)
    n = len(pages)
    parts = []
    for t in pool_tensors(kv):
        # [L, n*bs, ...] -> [n, L, bs, ...]: one page's rows of every layer are contiguous.
        g = t[:, rows].reshape(t.shape[0], n, kv.block_size, *t.shape[2:]).transpose(0, 1).contiguous()
        parts.append(g.view(torch.uint8).reshape(n, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


@runtime_checkable
class HostPages(Protocol):
    """Pages held in host memory outside one buffer (the near tier's pinned slots,
    services/kvstore/near_cache.py): the holder copies them to the device itself (pinned -> device,
    non_blocking), so importing them touches no bytes object and no socket."""

    @property
    def nbytes(self) -> int: ...

    def to_device_pages(self, device: torch.device, rows: Seq[int] | None = None) -> torch.Tensor:
        """The pages (all, or `rows` of them) as one [n, page_bytes] uint8 tensor on `device`."""
        ...


PageBytes = bytes | bytearray | memoryview | torch.Tensor | HostPages


def as_uint8(data: PageBytes) -> torch.Tensor:
    """A flat uint8 tensor over `data` without copying (a tensor is taken as it is)."""
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # A read-only buffer (bytes) is only read here: no copy into a bytearray first.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def _nbytes(data: PageBytes) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    return data.nbytes if isinstance(data, HostPages) else len(data)


def write_pages(kv: KVCache, pages: Seq[int], data: PageBytes) -> None:
    """Inverse of export_pages: fill `pages` of this cache from their bytes."""
    n = len(pages)
    if n == 0:
        return
    per = page_nbytes(kv)
    if _nbytes(data) != n * per:
        raise ValueError(f"{_nbytes(data)} bytes for {n} pages of {per} bytes")
    pools = pool_tensors(kv)
    bs = kv.block_size
    # One host -> device copy of the whole batch (a DMA when `data` is a pinned staging buffer).
    blob = as_uint8(data).reshape(n, per).to(pools[0].device)
    runs = _runs(pages)
    # Few runs of consecutive pages (the usual case: pages come off the free list in order): one
    # strided copy per run and pool, straight from the batch (no gather, no temporary). Many
    # scattered pages: one indexed write per pool (one kernel on the GPU).
    scattered = len(runs) > MAX_RUN_COPIES and blob.device.type == "cuda"
    rows = _rows(kv, pages) if scattered else None
    off = 0
    for t in pools:
        inner = tuple(t.shape[2:])
        size = t.shape[0] * bs * t[0, 0].numel() * t.element_size()
        # [n, size] bytes -> [n, L, bs, ...] of the pool's dtype, a view of the batch.
        g = blob[:, off : off + size].view(t.dtype).reshape(n, t.shape[0], bs, *inner)
        if rows is not None:
            t[:, rows] = g.transpose(0, 1).reshape(t.shape[0], n * bs, *inner)
        else:
            for first, start, m in runs:
                dst = t[:, first * bs : (first + m) * bs].view(t.shape[0], m, bs, *inner)
                dst.copy_(g[start : start + m].transpose(0, 1))
        off += size


# Above this many runs of consecutive pages, a CUDA import writes with one indexed kernel per pool.
MAX_RUN_COPIES = 16


def _runs(pages: Seq[int]) -> list[tuple[int, int, int]]:
    """(first page, index of it in `pages`, length) of each run of consecutive page ids."""
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if out and out[-1][0] + out[-1][2] == p:
            first, start, m = out[-1]
            out[-1] = (first, start, m + 1)
        else:
            out.append((p, i, 1))
    return out


def import_pages(kv: KVCache, hashes: Seq[bytes], data: PageBytes, pin: Seq[bytes] = ()) -> int:
    """Make the pages (chain order, keys `hashes`, bytes `data`) prefix-cache hits of this cache.

    Pages already cached are skipped; at most the pages that fit without evicting the ones just
    imported are taken (a chain is useless without its head). `pin`: keys of the chain's head that
    are already cached here; they are held while importing, so the import never evicts the prefix
    it extends. Returns how many were imported. Call only where nothing else touches the cache
    (the engine's loop thread, between steps)."""
    per = page_nbytes(kv)
    if _nbytes(data) != len(hashes) * per:
        raise ValueError(f"{_nbytes(data)} bytes for {len(hashes)} pages of {per} bytes")
    blocks = kv.blocks
    pinned = [b for b in (blocks.lookup(h) for h in pin) if b is not None]
    for b in pinned:
        blocks.acquire(b)
    todo = [i for i, h in enumerate(hashes) if blocks.lookup(h) is None]
    todo = todo[: blocks.num_free]
    pages = [blocks.allocate() for _ in todo]
    if pages and isinstance(data, HostPages):
        device = pool_tensors(kv)[0].device
        write_pages(kv, pages, data.to_device_pages(device, None if len(todo) == len(hashes) else todo))
    elif pages:
        flat = as_uint8(data)
        if len(todo) == len(hashes):
            src = flat  # the common case (nothing cached yet): no gather, no copy
        else:
            src = flat.reshape(len(hashes), per)[torch.tensor(todo, dtype=torch.long)]
        write_pages(kv, pages, src)
    for i, page in zip(todo, pages, strict=True):
        blocks.register(page, hashes[i])
    # Tail first, so under LRU the chain's head is evicted last (as Scheduler._free_pages does).
    for page in [*reversed(pages), *reversed(pinned)]:
        blocks.release(page)
    return len(pages)


class StagingBuffers:
    """Reused host buffers that pulled pages are received into and imported from. A fresh 1 GB
    buffer costs its page faults (half the loopback throughput, measured) and, on CUDA, pageable
    memory makes the host -> device copy a staged one; so buffers are pinned on CUDA and kept for
    the next pull (up to `keep_bytes` idle). Thread-safe: pulls take, the loop thread gives back."""

    GRAIN = 16 << 20  # sizes round up to this, so slightly different pulls reuse a buffer

    def __init__(self, pin: bool, keep_bytes: int = 4 << 30):
        self.pin, self.keep_bytes = pin, keep_bytes
        self._idle: list[torch.Tensor] = []
        self._largest = 0
        self._lock = threading.Lock()
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor of at least nbytes (its first nbytes are the caller's)."""
        with self._lock:
            fits = [t for t in self._idle if t.numel() >= nbytes]
            if fits:
                best = min(fits, key=lambda t: t.numel())
                self._idle.remove(best)
                return best
            # Multi-turn contexts grow every turn: grow buffers by half again, so a growing pull
            # allocates (and pins) a logarithmic number of times, not once a turn.
            want = max(nbytes, 1)
            if want > self._largest:
                want = max(want, min(self._largest * 3 // 2, self.keep_bytes))
            size = -(-want // self.GRAIN) * self.GRAIN
            self._largest = max(self._largest, size)
            self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=lambda t: -t.numel())
            while sum(t.numel() for t in self._idle) > self.keep_bytes:
                self._idle.pop()  # drop the smallest first: big pulls are the ones that pay

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(t.numel() for t in self._idle)


# A sink receives (page keys, their bytes, ids of the requests that finished with this export):
# the KV store client pushes them to the gateway; it must not block for long (it runs on the
# engine's loop thread) and must not raise.
# With `PageExchange.host_pages` set, the bytes may instead be HostPages (the near tier's pinned
# slots the pages were copied into, held until the sink releases them).
PageSink = Callable[[list[bytes], "bytes | HostPages", list[str]], None]
# Copies exported pages ([n, page_bytes] on the cache's device) into host slots of its own and
# returns them held, or None when it cannot hold them all (export_pages' bytes are used then).
HostPageTarget = Callable[[list[bytes], torch.Tensor], "HostPages | None"]


class PageExchange:
    """The engine's side of page transfer, owned by LLMEngine and driven from its step():

    stage(hashes, data)       any thread: pages to import before the next admission
    drain()                   loop thread, step start: import what was staged
    export(seqs, finished)    loop thread, before pages are released: hand new full pages to `sink`
    stage_first(id, tokens)   any thread: first tokens sampled elsewhere (a prefill service) for
                              the request with that id; add_request takes them
    """

    def __init__(self, kv: KVCache, remember: int = 1 << 16):
        self.kv = kv
        self.sink: PageSink | None = None
        # Set with a near tier (services/prefill/router.attach_near): exported pages go from the
        # device straight into its pinned slots (one DMA), and the sink sends them from there.
        self.host_pages: HostPageTarget | None = None
        self._staged: deque[tuple[list[bytes], PageBytes, list[bytes], Callable[[], None] | None]] = deque()
        self.buffers = StagingBuffers(pin=kv.k.device.type == "cuda")
        self._first: dict[str, list[tuple[int, float, int]]] = {}
        self._lock = threading.Lock()
        # Keys this engine already pushed or pulled: the store has them, no need to send again.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember
        self.imported_pages_total = 0
        self.dropped_batches_total = 0  # staged batches drain() could not import
        self.exported_pages_total = 0
        # Bytes copied into the pool by drain() and the seconds it took: the pull decision's
        # measured import bandwidth (services/prefill/pull_policy.py).
        self.import_bytes_total = 0
        self.import_seconds_total = 0.0
        # The same for imports from the near tier (HostPages: pinned host -> device only).
        self.near_import_bytes_total = 0
        self.near_import_seconds_total = 0.0

    @property
    def pending(self) -> bool:
        return bool(self._staged)

    def stage(
        self,
        hashes: list[bytes],
        data: PageBytes,
        pin: list[bytes] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        """`pin`: the keys before `hashes` in their chain (kept cached while importing).
        `release`: called once `data` has been copied into the pool (e.g. gives a staging
        buffer back)."""
        if hashes:
            self._staged.append((hashes, data, pin or [], release))
        elif release is not None:
            release()

    def drain(self) -> int:
        """Import what was staged. A batch that cannot be imported (bytes that are not whole pages
        of this layout) is logged and dropped: it runs on the loop thread, where raising would
        abort every request of the step; its tokens are computed instead."""
        n = 0
        while self._staged:
            hashes, data, pin, release = self._staged.popleft()
            t0 = time.perf_counter()
            try:
                got = import_pages(self.kv, hashes, data, pin)
            except (ValueError, RuntimeError) as e:
                self.dropped_batches_total += 1
                log.warning(f"dropped {len(hashes)} staged kv pages: {e}")
                continue
            finally:
                if release is not None:
                    release()
            if got:
                if self.kv.k.device.type == "cuda":
                    torch.cuda.synchronize(self.kv.k.device)  # time the copy, not its launch
                seconds, nbytes = time.perf_counter() - t0, got * page_nbytes(self.kv)
                if isinstance(data, HostPages):
                    self.near_import_seconds_total += seconds
                    self.near_import_bytes_total += nbytes
                else:
                    self.import_seconds_total += seconds
                    self.import_bytes_total += nbytes
            n += got
            self._mark(hashes)
        self.imported_pages_total += n
        return n

    def stage_first(self, request_id: str, first: list[tuple[int, float, int]]) -> None:
        with self._lock:
            self._first[request_id] = first

    def take_first(self, request_id: str) -> list[tuple[int, float, int]] | None:
        with self._lock:
            return self._first.pop(request_id, None)

    def _mark(self, hashes: Seq[bytes]) -> None:
        for h in hashes:
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > self._remember:
            self._known.popitem(last=False)

    def export(self, seqs: Seq[Sequence], finished: list[str]) -> None:
        if self.sink is None:
            return
        hashes: list[bytes] = []
        pages: list[int] = []
        seen: set[bytes] = set()
        for s in seqs:
            for h, page in zip(s.block_hashes, s.block_table, strict=False):
                if h not in self._known and h not in seen:
                    seen.add(h)
                    hashes.append(h)
                    pages.append(page)
        if not hashes and not finished:
            return
        data: bytes | HostPages | None = None
        if self.host_pages is not None and pages:
            try:
                data = self.host_pages(hashes, export_blob(self.kv, pages))
            except (RuntimeError, ValueError) as e:  # e.g. pinned memory refused: bytes instead
                log.warning(f"exporting {len(pages)} kv pages into host slots failed ({e}); copying")
        if data is None:
            data = export_pages(self.kv, pages)
        self._mark(hashes)
        self.exported_pages_total += len(hashes)
        self.sink(hashes, data, finished)
