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
import threading
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from services.engine.kv_cache import KVCache, block_hash, root_hash

if TYPE_CHECKING:
    from services.engine.sequence import Sequence


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
    rows = _rows(kv, pages)
    n = len(pages)
    parts = []
    for t in pool_tensors(kv):
        # [L, n*bs, ...] -> [n, L, bs, ...]: one page's rows of every layer are contiguous.
        g = t[:, rows].reshape(t.shape[0], n, kv.block_size, *t.shape[2:]).transpose(0, 1).contiguous()
        parts.append(g.view(torch.uint8).reshape(n, -1))
    blob = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    return blob.cpu().numpy().tobytes()


def write_pages(kv: KVCache, pages: Seq[int], data: bytes | bytearray | memoryview) -> None:
    """Inverse of export_pages: fill `pages` of this cache from their bytes."""
    n = len(pages)
    if n == 0:
        return
    per = page_nbytes(kv)
    if len(data) != n * per:
        raise ValueError(f"{len(data)} bytes for {n} pages of {per} bytes")
    rows = _rows(kv, pages)
    pools = pool_tensors(kv)
    with warnings.catch_warnings():
        # A read-only buffer (bytes) is only read here: no copy into a bytearray first.
        warnings.simplefilter("ignore", UserWarning)
        blob = torch.frombuffer(data, dtype=torch.uint8).reshape(n, per).to(pools[0].device)
    off = 0
    for t in pools:
        inner = tuple(t.shape[2:])
        size = t.shape[0] * kv.block_size * t[0, 0].numel() * t.element_size()
        g = blob[:, off : off + size].contiguous().view(t.dtype)
        g = g.reshape(n, t.shape[0], kv.block_size, *inner).transpose(0, 1)
        t[:, rows] = g.reshape(t.shape[0], n * kv.block_size, *inner)
        off += size


def import_pages(
    kv: KVCache, hashes: Seq[bytes], data: bytes | bytearray | memoryview, pin: Seq[bytes] = ()
) -> int:
    """Make the pages (chain order, keys `hashes`, bytes `data`) prefix-cache hits of this cache.

    Pages already cached are skipped; at most the pages that fit without evicting the ones just
    imported are taken (a chain is useless without its head). `pin`: keys of the chain's head that
    are already cached here; they are held while importing, so the import never evicts the prefix
    it extends. Returns how many were imported. Call only where nothing else touches the cache
    (the engine's loop thread, between steps)."""
    per = page_nbytes(kv)
    if len(data) != len(hashes) * per:
        raise ValueError(f"{len(data)} bytes for {len(hashes)} pages of {per} bytes")
    blocks = kv.blocks
    pinned = [b for b in (blocks.lookup(h) for h in pin) if b is not None]
    for b in pinned:
        blocks.acquire(b)
    todo = [i for i, h in enumerate(hashes) if blocks.lookup(h) is None]
    todo = todo[: blocks.num_free]
    pages = [blocks.allocate() for _ in todo]
    view = memoryview(data)
    write_pages(kv, pages, b"".join(view[i * per : (i + 1) * per] for i in todo))
    for i, page in zip(todo, pages, strict=True):
        blocks.register(page, hashes[i])
    # Tail first, so under LRU the chain's head is evicted last (as Scheduler._free_pages does).
    for page in [*reversed(pages), *reversed(pinned)]:
        blocks.release(page)
    return len(pages)


# A sink receives (page keys, their bytes, ids of the requests that finished with this export):
# the KV store client pushes them to the gateway; it must not block for long (it runs on the
# engine's loop thread) and must not raise.
PageSink = Callable[[list[bytes], bytes, list[str]], None]


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
        self._staged: deque[tuple[list[bytes], bytes, list[bytes]]] = deque()
        self._first: dict[str, list[tuple[int, float, int]]] = {}
        self._lock = threading.Lock()
        # Keys this engine already pushed or pulled: the store has them, no need to send again.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember
        self.imported_pages_total = 0
        self.exported_pages_total = 0

    @property
    def pending(self) -> bool:
        return bool(self._staged)

    def stage(self, hashes: list[bytes], data: bytes, pin: list[bytes] | None = None) -> None:
        """`pin`: the keys before `hashes` in their chain (kept cached while importing)."""
        if hashes:
            self._staged.append((hashes, data, pin or []))

    def drain(self) -> int:
        n = 0
        while self._staged:
            hashes, data, pin = self._staged.popleft()
            n += import_pages(self.kv, hashes, data, pin)
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
        data = export_pages(self.kv, pages)
        self._mark(hashes)
        self.exported_pages_total += len(hashes)
        self.sink(hashes, data, finished)
