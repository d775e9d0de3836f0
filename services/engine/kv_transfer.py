"""KV pages as bytes: export pages of the paged cache, import them into another engine's cache.

A page's bytes are, for each pool tensor of the cache in order (K then V for the GQA layout), the
rows of that page across all layers ([n_layers, block_size, ...] contiguous, native dtype), so a
page is `page_nbytes(kv)` raw bytes with no header. What a page *means* is carried by its key:
the prefix-cache hash chain (block_manager.block_hash) rooted at root_hash(weight version, layout_id),
and layout_id names everything that decides the bytes' interpretation (model shape, KV dtype,
page size). Two engines exchange pages only when their layout ids, and so their keys, agree; a
page of another model, dtype, page size or weight version can never be looked up by mistake.

Import registers pages in the prefix cache with no users (ref 0, evictable), exactly as a page a
finished sequence left behind: the scheduler's next admission finds them as ordinary prefix hits.
On CUDA the engine imports asynchronously (PageExchange): the host -> device copy runs on a side
stream while decode steps go on, and the pages are registered only once it has landed; until
then their keys are "landing" and the scheduler holds back a request whose prefix continues with
one of them (a 16k-token prefix is ~2 GB: copied in the loop it would stall every stream's next
token for tens of milliseconds).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import warnings
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from services.engine.block_manager import page_hash, root_hash
from services.engine.kv_cache import KVCache

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
    return sum(_pool_page_bytes(kv, t) for t in pool_tensors(kv))


def layout_id(arch: str, kv: KVCache) -> str:
    """What must agree for a page's bytes to be usable elsewhere: the model's architecture name and
    every pool's per-page shape and dtype (layers, heads, head dim, page size)."""
    parts = [arch, f"bs{kv.block_size}"]
    for t in pool_tensors(kv):
        shape = "x".join(str(d) for d in (t.shape[0], kv.block_size, *t.shape[2:]))
        parts.append(f"{shape}:{str(t.dtype).removeprefix('torch.')}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest() + ":" + ",".join(parts)


def chain_hashes(
    tokens: Seq[int],
    version: int,
    layout: str,
    block_size: int,
    limit: int | None = None,
    breathe: bool = False,
) -> list[bytes]:
    """Keys of the full pages of `tokens` (at most `limit`), as the scheduler computes them
    (block_manager.block_hash, over one buffer of the tokens). `breathe`: the caller is a background thread (a
    router's pull, a prefill request): it lets the GIL go every BREATHE_PAGES pages. A 16k-token
    prompt's chain is ~1-2 ms of Python; held in switch-interval slices it made the engine loop
    wait 0.5 ms at each of its GIL releases, and the decode steps overlapping a pull took 6-9 ms
    instead of 2.5 (stall samples)."""
    n = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    prev = root_hash(version, layout)
    buf = memoryview(array("q", tokens[: n * block_size]).tobytes())
    width = block_size * 8  # int64 tokens
    out = []
    for i in range(n):
        prev = page_hash(prev, buf[i * width : (i + 1) * width])
        out.append(prev)
        if breathe and i % BREATHE_PAGES == BREATHE_PAGES - 1:
            time.sleep(BREATHE_S)
    return out


# Background hashing lets the GIL go this often, for this long: long enough that a waiting engine
# loop takes it (a bare sleep(0) often hands it straight back to the sleeper), ~0.1 ms of work apart.
BREATHE_PAGES = 64
BREATHE_S = 20e-6


def reusable_pages(num_tokens: int, block_size: int, seeded: bool = False) -> int:
    """Full pages a prompt of num_tokens can take from a cache: its last token is always computed
    (its logits give the next token), as in Scheduler._admit. `seeded`: the request comes with its
    first token sampled elsewhere (a prefill service), so no prompt token needs its logits here and
    every full page can be taken: the first step feeds only that token (a pure decode step)."""
    if seeded:
        return num_tokens // block_size
    return max(0, (num_tokens - 1) // block_size)


TAIL_DOMAIN = b"relay-kv-tail|"


def tail_hash(prev: bytes, tokens: Seq[int]) -> bytes:
    """Key of a prompt's partial last page holding `tokens` (fewer than a page), after the chain
    key `prev` (the last full page's, or the root). Hashed in its own domain and over the token
    count, so it never equals any full page's key: a tail can never be looked up as a full page,
    only by a reader that knows the prompt it ends (PromptTail, Scheduler._admit)."""
    body = TAIL_DOMAIN + prev + len(tokens).to_bytes(4, "little") + array("q", list(tokens)).tobytes()
    return hashlib.blake2b(body, digest_size=16).digest()


def prompt_tail_key(
    tokens: Seq[int], version: int, layout: str, block_size: int, keys: Seq[bytes] | None = None
) -> bytes | None:
    """tail_hash of the prompt's partial last page (None: the prompt ends on a page boundary).
    `keys`: the prompt's full-page chain at `version` when the caller has it already (a 16k-token
    prompt's chain is ~2 ms of Python, on a serving thread); else it is computed."""
    full = len(tokens) // block_size
    if len(tokens) == full * block_size:
        return None
    if keys is None or len(keys) < full:
        keys = chain_hashes(tokens, version, layout, block_size)
    prev = keys[full - 1] if full else root_hash(version, layout)
    return tail_hash(prev, tokens[full * block_size :])


@dataclass(frozen=True)
class PromptTail:
    """The KV of a prompt's partial last page, computed elsewhere (a same-host prefill's handoff):
    `tokens` valid rows of one page, `data` its bytes ([page_bytes] uint8, on the cache's device).
    Never registered in a prefix cache (a partial page is not a reusable page): the scheduler
    copies it into the admitted sequence's own page when the sequence's cached prefix is exactly
    the prompt's full pages and `key` is the tail_hash of that chain (same weights, same layout,
    same tokens), so the sequence starts with the whole prompt cached."""

    key: bytes
    tokens: int
    data: torch.Tensor

    def matches(self, prev: bytes, tail_tokens: Seq[int]) -> bool:
        return len(tail_tokens) == self.tokens and tail_hash(prev, tail_tokens) == self.key

    def write(self, kv: KVCache, page: int) -> None:
        """Fill `page` of `kv` (a page the sequence owns) with the tail's bytes: on the caller's
        (compute) stream, so ordered before the forward that reads it."""
        if self.data.is_cuda:
            # `data` may be freed right after (the tail is used once): not before this copy ran.
            self.data.record_stream(torch.cuda.current_stream(self.data.device))
        write_pages(kv, [page], self.data)


def _rows(kv: KVCache, pages: Seq[int]) -> torch.Tensor:
    bs = kv.block_size
    device = pool_tensors(kv)[0].device
    idx = _index(list(pages), device)
    return (idx[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """A long index tensor on `device` without blocking the host: from pageable memory the upload
    is synchronous, and on the import's side stream it would wait behind the page copy queued
    before it (~40 ms for a 16k-token prefix: the decode loop stalled that long, measured)."""
    idx = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return idx
    return idx.pin_memory().to(device, non_blocking=True)


def export_pages(kv: KVCache, pages: Seq[int]) -> bytes:
    """The bytes of `pages` (page ids of this cache), concatenated in order."""
    if not pages:
        return b""
    return export_blob(kv, pages).cpu().numpy().tobytes()


def export_blob(kv: KVCache, pages: Seq[int]) -> torch.Tensor:
    """`pages` as one [n, page_nbytes] uint8 tensor on the cache's device (export_pages' bytes)."""
    n = len(pages)
    device = pool_tensors(kv)[0].device
    if device.type == "cuda" and n:
        blob = torch.empty((n, page_nbytes(kv)), dtype=torch.uint8, device=device)
        if _page_kernel(kv, blob):
            _copy_page_chunks(kv, pages, blob, to_pool=False)
            return blob
    rows = _rows(kv, pages)
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


# Host -> device page copies go in pieces of about this many bytes (see copy_to_device).
H2D_CHUNK_BYTES = 32 << 20

# A staged batch already on the device (a handoff's pages) is launched into the pool this many
# bytes per step (PageExchange.drain): one 1.8 GB scatter of a 16k-token prompt ran beside a decode
# step and held its SMs and memory bandwidth (~7 ms steps at each import),
# and claiming 1,024 pages took 2 ms of the loop thread. A few pieces cost the request a few steps.
IMPORT_BYTES_PER_STEP = 256 << 20


def copy_to_device(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int = H2D_CHUNK_BYTES) -> None:
    """dst.copy_(src) host -> device along dim 0 in pieces of about `chunk_bytes`, each waited for
    before the next is queued: blocks the calling thread, so for worker threads (a handoff's pull).
    One large copy held the GPU's copy engine for its whole length (a 16k-token prompt's 1.8 GB:
    ~36 ms over PCIe) and the decode loop's own small input uploads waited behind it, one 35 ms
    decode step per handoff on the H200; pieces queued all at once did the same, paced pieces let
    the loop's uploads through between them."""
    rows = dst.shape[0]
    row_bytes = dst[0].numel() * dst.element_size() if rows else 1
    per = max(1, chunk_bytes // max(1, row_bytes))
    for i in range(0, rows, per):
        dst[i : i + per].copy_(src[i : i + per], non_blocking=True)
        if dst.is_cuda:
            torch.cuda.current_stream(dst.device).synchronize()


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


def write_pages(
    kv: KVCache, pages: Seq[int], data: PageBytes, non_blocking: bool = False
) -> torch.Tensor | None:
    """Inverse of export_pages: fill `pages` of this cache from their bytes. Returns the device copy
    of the bytes the writes read from: with `non_blocking` (on the caller's stream) the caller keeps
    it, and `data`, alive until that stream has done the copies."""
    n = len(pages)
    if n == 0:
        return None
    per = page_nbytes(kv)
    if _nbytes(data) != n * per:
        raise ValueError(f"{_nbytes(data)} bytes for {n} pages of {per} bytes")
    pools = pool_tensors(kv)
    bs = kv.block_size
    # One host -> device copy of the whole batch (a DMA when `data` is a pinned staging buffer).
    blob = as_uint8(data).reshape(n, per).to(pools[0].device, non_blocking=non_blocking)
    if _page_kernel(kv, blob):
        _copy_page_chunks(kv, pages, blob, to_pool=True)
        return blob
    runs = _runs(pages)
    # Few runs of consecutive pages (the usual case: pages come off the free list in order): one
    # strided copy per run and pool, straight from the batch (no gather, no temporary). Many
    # scattered pages: one indexed write per pool (one kernel on the GPU).
    scattered = len(runs) > MAX_RUN_COPIES and blob.device.type == "cuda"
    rows = _rows(kv, pages) if scattered else None
    off = 0
    for t in pools:
        inner = tuple(t.shape[2:])
        size = _pool_page_bytes(kv, t)
        # [n, size] bytes -> [n, L, bs, ...] of the pool's dtype, a view of the batch.
        g = blob[:, off : off + size].view(t.dtype).reshape(n, t.shape[0], bs, *inner)
        if rows is not None:
            t[:, rows] = g.transpose(0, 1).reshape(t.shape[0], n * bs, *inner)
        else:
            for first, start, m in runs:
                dst = t[:, first * bs : (first + m) * bs].view(t.shape[0], m, bs, *inner)
                dst.copy_(g[start : start + m].transpose(0, 1))
        off += size
    return blob


def _page_kernel(kv: KVCache, blob: torch.Tensor) -> bool:
    """CUDA: pages move by kernels/page_copy.py (one streaming kernel per pool) where it fits."""
    if not blob.is_cuda:
        return False
    from services.engine.kernels import page_copy  # triton: only on the GPU path

    off, fit = 0, True
    for t in pool_tensors(kv):
        fit = fit and page_copy.fits(t, kv.block_size, blob, off)
        off += _pool_page_bytes(kv, t)
    return fit


def _copy_page_chunks(kv: KVCache, pages: Seq[int], blob: torch.Tensor, to_pool: bool) -> None:
    from services.engine.kernels import page_copy

    idx = _index(list(pages), blob.device)
    off = 0
    for t in pool_tensors(kv):
        page_copy.copy_pages(t, kv.block_size, idx, blob, off, to_pool)
        off += _pool_page_bytes(kv, t)


def _pool_page_bytes(kv: KVCache, t: torch.Tensor) -> int:
    """Bytes of one page of pool `t` ([L, tokens, ...]) in a page's batch row: every layer's rows."""
    return t.shape[0] * kv.block_size * t[0, 0].numel() * t.element_size()


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
    _check_size(kv, hashes, data)
    claim = _claim(kv, hashes, pin)
    if claim.pages:
        _fill(kv, claim, data)
    return _register(kv, claim)


@dataclass
class _Claim:
    """Pages taken for an import: `pages[j]` receives the page `todo[j]` of the batch."""

    hashes: list[bytes]
    todo: list[int]
    pages: list[int]
    pinned: list[int]


def _check_size(kv: KVCache, hashes: Seq[bytes], data: PageBytes) -> None:
    per = page_nbytes(kv)
    if _nbytes(data) != len(hashes) * per:
        raise ValueError(f"{_nbytes(data)} bytes for {len(hashes)} pages of {per} bytes")


def _claim(kv: KVCache, hashes: Seq[bytes], pin: Seq[bytes], skip: Any = frozenset()) -> _Claim:
    """Hold the cached head (`pin`) and allocate pages for the keys neither cached nor in `skip`
    (keys another import is landing)."""
    blocks = kv.blocks
    pinned = [b for b in (blocks.lookup(h) for h in pin) if b is not None]
    for b in pinned:
        blocks.acquire(b)
    todo = [i for i, h in enumerate(hashes) if blocks.lookup(h) is None and h not in skip]
    todo = todo[: blocks.num_free]
    return _Claim(list(hashes), todo, [blocks.allocate() for _ in todo], pinned)


def _fill(kv: KVCache, c: _Claim, data: PageBytes, non_blocking: bool = False) -> Any:
    """Copy the claimed pages' bytes into the pool; returns what the copies read (see write_pages)."""
    partial = len(c.todo) != len(c.hashes)
    if isinstance(data, HostPages):
        device = pool_tensors(kv)[0].device
        src = data.to_device_pages(device, c.todo if partial else None)
        write_pages(kv, c.pages, src, non_blocking)
        return src
    flat = as_uint8(data)
    if partial:
        per = page_nbytes(kv)
        device = pool_tensors(kv)[0].device
        # On CUDA gather on the device: a host gather makes a pageable tensor, whose upload
        # would block the loop thread (see _index).
        full = flat.reshape(len(c.hashes), per).to(device, non_blocking=non_blocking)
        src = full[_index(c.todo, device)]
        write_pages(kv, c.pages, src, non_blocking)
        return (full, src)
    return write_pages(kv, c.pages, flat, non_blocking)  # common case: no gather, no copy


def _register(kv: KVCache, c: _Claim) -> int:
    blocks = kv.blocks
    for i, page in zip(c.todo, c.pages, strict=True):
        blocks.register(page, c.hashes[i])
    # Tail first, so under LRU the chain's head is evicted last (as Scheduler._free_pages does).
    for page in [*reversed(c.pages), *reversed(c.pinned)]:
        blocks.release(page)
    return len(c.pages)


@dataclass
class _Landing:
    """An import whose copy is in flight on the exchange's side stream."""

    claim: _Claim
    start: torch.cuda.Event
    done: torch.cuda.Event
    keep: Any  # the device/host tensors the copy reads: alive until `done`
    release: Callable[[], None] | None
    near: bool


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
            fits = [i for i, t in enumerate(self._idle) if t.numel() >= nbytes]
            if fits:
                # By position: list.remove would compare tensors with ==, elementwise.
                return self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))
            # Multi-turn contexts grow every turn: grow buffers by half again, so a growing pull
            # allocates (and pins) a logarithmic number of times, not once a turn.
            want = max(nbytes, 1)
            if want > self._largest:
                want = max(want, min(self._largest * 3 // 2, self.keep_bytes))
            size = -(-want // self.GRAIN) * self.GRAIN
            self._largest = max(self._largest, size)
            self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def reserve(self, count: int, nbytes: int) -> None:
        """Allocate (pin) `count` idle buffers of `nbytes` now. Pinning takes the driver's lock for
        about a second per couple of GB, during which the engine's loop cannot launch a step (a
        1 s stall of every stream, measured on an H200): a service reserves at start, not on its
        first long pull."""
        size = -(-max(nbytes, 1) // self.GRAIN) * self.GRAIN
        bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=self.pin) for _ in range(count)]
        with self._lock:
            self.keep_bytes = max(self.keep_bytes, count * size + sum(t.numel() for t in self._idle))
            self._largest = max(self._largest, size)
            self.allocations += count
        for b in bufs:
            self.give(b)

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
# Receives (tail_hash key, [1, page_bytes] uint8 on the cache's device) of a partial last prompt
# page: loop thread, must not block for long nor raise (PageExchange.tail_sink).
TailSink = Callable[[bytes, torch.Tensor], None]


class PageExchange:
    """The engine's side of page transfer, owned by LLMEngine and driven from its step():

    stage(hashes, data)       any thread: pages to import before the next admission
    drain()                   loop thread, step start: import what was staged
    export(seqs, finished)    loop thread, before pages are released: hand new full pages to `sink`
    stage_first(id, tokens)   any thread: first tokens sampled elsewhere (a prefill service) for
                              the request with that id; add_request takes them
    stage_tail(id, tail)      any thread: that request's partial last prompt page (PromptTail),
                              computed elsewhere; add_request hands it to the scheduler
    stage_keys(id, v, keys)   any thread: that request's prompt page keys at weight version v,
                              already computed for its pull, so admission need not hash again
    forget(id)                what a request that never reached add_request left staged
    """

    def __init__(self, kv: KVCache, remember: int = 1 << 16, layout: str = ""):
        self.kv = kv
        self.layout = layout  # the engine's layout_id: roots the tail keys export computes
        self.sink: PageSink | None = None
        # Set by a prefill service that hands off (services/prefill/server.py): receives the
        # partial last prompt page of every finished sequence that fed exactly its prompt
        # (key = tail_hash, [1, page_bytes] on the device). Kept apart from `sink`: a partial page
        # must never reach the gateway or a prefix cache as a full page.
        self.tail_sink: TailSink | None = None
        # Set with a near tier (services/kvstore/router.attach_near): exported pages go from the
        # device straight into its pinned slots (one DMA), and the sink sends them from there.
        self.host_pages: HostPageTarget | None = None
        self._staged: deque[tuple[list[bytes], PageBytes, list[bytes], Callable[[], None] | None]] = deque()
        self.buffers = StagingBuffers(pin=kv.k.device.type == "cuda")
        # CUDA: imports copy on this side stream and land (get registered) when it is done; the
        # keys of pages on their way in, which the scheduler does not admit past (kv_transfer doc).
        self._copy_stream = torch.cuda.Stream(kv.k.device) if kv.k.device.type == "cuda" else None
        self._landing: deque[_Landing] = deque()
        self.landing_keys: set[bytes] = set()
        self._queued: set[bytes] = set()  # keys of a split batch's pieces not launched yet (drain)
        self._first: dict[str, list[tuple[int, float, int]]] = {}
        self._tails: dict[str, PromptTail] = {}
        self._keys: dict[str, tuple[int, list[bytes]]] = {}
        self._lock = threading.Lock()
        # Keys this engine already pushed or pulled: the store has them, no need to send again.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._remember = remember
        self.imported_pages_total = 0
        self.dropped_batches_total = 0  # staged batches drain() could not import
        self.exported_pages_total = 0
        # Bytes copied into the pool by drain() and the seconds it took: the pull decision's
        # measured import bandwidth (services/kvstore/pull_policy.py).
        self.import_bytes_total = 0
        self.import_seconds_total = 0.0
        # The same for imports from the near tier (HostPages: pinned host -> device only).
        self.near_import_bytes_total = 0
        self.near_import_seconds_total = 0.0

    @property
    def pending(self) -> bool:
        return bool(self._staged or self._landing)

    # Whether pages from elsewhere can be imported (stage / drain) into this engine's pool.
    imports = True

    @property
    def page_bytes(self) -> int:
        """The bytes of one exported page (what the store, the near tier and a reader get)."""
        return page_nbytes(self.kv)

    def blob(self, pages: Seq[int]) -> torch.Tensor:
        """`pages` as one [n, page_bytes] uint8 tensor: what export hands on (export_blob)."""
        return export_blob(self.kv, pages)

    def import_batch(self, hashes: list[bytes], data: PageBytes, pin: list[bytes]) -> int:
        """A staged batch into the pool at once (drain without a copy stream): import_pages."""
        return import_pages(self.kv, hashes, data, pin)

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
        """Import what was staged (CUDA: launch the copies; register the imports that have landed).
        A batch that cannot be imported (bytes that are not whole pages of this layout) is logged
        and dropped: it runs on the loop thread, where raising would abort every request of the
        step; its tokens are computed instead. Returns the pages registered by this call."""
        landed = self._land()
        n = 0
        while self._staged:
            hashes, data, pin, release = self._staged.popleft()
            if self._copy_stream is None:
                n += self.import_now(hashes, data, pin, release, self.import_batch)
                continue
            try:
                per = max(1, IMPORT_BYTES_PER_STEP // page_nbytes(self.kv))
                if isinstance(data, torch.Tensor) and data.is_cuda and len(hashes) > per:
                    # The rest waits for the next step; its keys count as landing meanwhile,
                    # so the scheduler does not admit past them and compute them instead.
                    rest = hashes[per:]
                    self._staged.appendleft((rest, data[per:], pin + hashes[:per], release))
                    self._queued.update(rest)
                    self.landing_keys.update(rest)
                    release = None  # the last piece's
                    self._launch(hashes[:per], data[:per], pin, None)
                    break
                self._launch(hashes, data, pin, release)
                release = None  # called when the copy has landed
            except (ValueError, RuntimeError) as e:
                self._drop(hashes, e)
            finally:
                if release is not None:
                    release()
        return landed + n + self._land()

    def import_now(
        self,
        hashes: list[bytes],
        data: PageBytes,
        pin: list[bytes],
        release: Callable[[], None] | None,
        importer: Callable[[list[bytes], PageBytes, list[bytes]], int],
    ) -> int:
        """One staged batch into a pool at once (`importer`: import_batch, or another pool's); one
        that cannot be imported is dropped as drain() drops it. Returns the pages imported."""
        t0 = time.perf_counter()
        try:
            got = importer(hashes, data, pin)
        except (ValueError, RuntimeError) as e:
            self._drop(hashes, e)
            return 0
        finally:
            if release is not None:
                release()
        if got:
            self._count(got, time.perf_counter() - t0, isinstance(data, HostPages))
        self._mark(hashes)
        self.imported_pages_total += got
        return got

    def _drop(self, hashes: list[bytes], e: Exception) -> None:
        self.dropped_batches_total += 1
        self._unqueue(hashes)
        log.warning(f"dropped {len(hashes)} staged kv pages: {e}")

    def finish(self) -> int:
        """Wait for every import in flight and register it (tests, shutdown)."""
        for x in self._landing:
            x.done.synchronize()
        return self._land()

    def _launch(
        self, hashes: list[bytes], data: PageBytes, pin: list[bytes], release: Callable[[], None] | None
    ) -> None:
        _check_size(self.kv, hashes, data)
        self._unqueue(hashes)  # this batch's own keys, marked when it was split (drain)
        claim = _claim(self.kv, hashes, pin, skip=self.landing_keys)
        stream = self._copy_stream
        assert stream is not None
        if not claim.pages:
            _register(self.kv, claim)
            if release is not None:
                release()
            self._mark(hashes)
            return
        # The pages just taken off the free list may still be read or written by steps already
        # queued on the compute stream (overlap scheduling runs one ahead): copy after those.
        stream.wait_stream(torch.cuda.current_stream(self.kv.k.device))
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        try:
            with torch.cuda.stream(stream):
                start.record(stream)
                keep = _fill(self.kv, claim, data, non_blocking=True)
                done.record(stream)
        except BaseException:
            stream.synchronize()  # nothing of this batch may still be copying into the pages
            for page in [*claim.pages, *claim.pinned]:
                self.kv.blocks.release(page)
            raise
        self._landing.append(_Landing(claim, start, done, (keep, data), release, isinstance(data, HostPages)))
        self.landing_keys.update(claim.hashes[i] for i in claim.todo)

    def _unqueue(self, hashes: Seq[bytes]) -> None:
        if self._queued:
            own = self._queued.intersection(hashes)
            self._queued.difference_update(own)
            self.landing_keys.difference_update(own)

    def _land(self) -> int:
        """Register the imports whose copies are done, in launch order (one stream: in order)."""
        n = 0
        while self._landing and self._landing[0].done.query():
            x = self._landing.popleft()
            got = _register(self.kv, x.claim)
            self.landing_keys.difference_update(x.claim.hashes[i] for i in x.claim.todo)
            self._count(got, x.start.elapsed_time(x.done) / 1000, x.near)
            if x.release is not None:
                x.release()
            self._mark(x.claim.hashes)
            n += got
        self.imported_pages_total += n
        return n

    def _count(self, pages: int, seconds: float, near: bool) -> None:
        # The pages' bytes as moved (page_bytes: a multi-rank engine's whole pages, not the share
        # of them rank 0's pool holds), which the pull policy divides by the seconds.
        nbytes = pages * self.page_bytes
        if near:
            self.near_import_seconds_total += seconds
            self.near_import_bytes_total += nbytes
        else:
            self.import_seconds_total += seconds
            self.import_bytes_total += nbytes

    def stage_first(self, request_id: str, first: list[tuple[int, float, int]]) -> None:
        with self._lock:
            self._first[request_id] = first

    def take_first(self, request_id: str) -> list[tuple[int, float, int]] | None:
        with self._lock:
            return self._first.pop(request_id, None)

    def stage_tail(self, request_id: str, tail: PromptTail) -> None:
        with self._lock:
            self._tails[request_id] = tail

    def take_tail(self, request_id: str) -> PromptTail | None:
        with self._lock:
            return self._tails.pop(request_id, None)

    def stage_keys(self, request_id: str, version: int, keys: list[bytes]) -> None:
        with self._lock:
            self._keys[request_id] = (version, keys)

    def take_keys(self, request_id: str) -> tuple[int, list[bytes]] | None:
        with self._lock:
            return self._keys.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._first.pop(request_id, None)
            self._tails.pop(request_id, None)
            self._keys.pop(request_id, None)

    def _mark(self, hashes: Seq[bytes]) -> None:
        for h in hashes:
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > self._remember:
            self._known.popitem(last=False)

    def export(self, seqs: Seq[Sequence], finished: list[str]) -> None:
        if self.tail_sink is not None:
            self._export_tails(seqs)
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
                data = self.host_pages(hashes, self.blob(pages))
            except (RuntimeError, ValueError) as e:  # e.g. pinned memory refused: bytes instead
                log.warning(f"exporting {len(pages)} kv pages into host slots failed ({e}); copying")
        if data is None:
            data = self.blob(pages).cpu().numpy().tobytes() if pages else b""
        self._mark(hashes)
        self.exported_pages_total += len(hashes)
        self.sink(hashes, data, finished)

    def _export_tails(self, seqs: Seq[Sequence]) -> None:
        """Hand `tail_sink` the partial last prompt page of each sequence that computed exactly its
        prompt (a prefill's: its first token sampled, not fed), once per key. Its rows past the
        prompt are stale bytes the reader overwrites by computing them."""
        assert self.tail_sink is not None
        bs = self.kv.block_size
        seen: set[bytes] = set()
        for s in seqs:
            n = len(s.prompt)
            full = n // bs
            if (
                n == full * bs
                or s.num_cached != n
                or len(s.block_hashes) != full
                or len(s.block_table) <= full
            ):
                continue
            prev = s.block_hashes[-1] if full else root_hash(s.salt, self.layout)
            key = tail_hash(prev, s.prompt[full * bs :])
            if key in seen:
                continue  # the samples of one request share the prompt (forked copies)
            seen.add(key)
            try:
                self.tail_sink(key, self.blob([s.block_table[full]]))
            except (RuntimeError, ValueError) as e:  # the decode computes the tail then
                log.warning(f"exporting a prompt's partial last page failed: {e}")
