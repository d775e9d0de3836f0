"""The near KV tier: a byte-budgeted LRU of KV pages in (on CUDA pinned) host memory, inside the
process that holds the engine, in front of the KV store gateway.

Why: the gateway moves pages over TCP at ~1-2 GB/s, below what an H200 recomputes a small model's
KV at (~9 GB/s of KV for Qwen3-0.6B), so remote pulls rarely pay there. A page already in this
process's pinned memory is one DMA away (~20-50 GB/s host -> device), which beats recomputing.
This is what vLLM's CPU offload and LMCache's local CPU backend are.

Pages live in fixed-size slots of a few large host tensors (chunks, allocated as the tier fills,
so an idle tier pins nothing and pinning is paid once per chunk, not per page). Keys are the same
salted content hashes the gateway uses (the prefix-cache chain rooted at weight version and
layout), so a page of other weights can never be found. A slot that a reader holds (an import not
yet copied to the device, a put being sent) is never reused until released, even if the LRU
evicts its key meanwhile.

Thread-safety: one lock over the index; page bytes are copied outside it (a slot being written is
held by the writer and indexed only once complete).

Shared (`shared=True`, the prefill's tier when `kvstore.near.shared_lease_s > 0`): chunks are
named shared-memory segments (shared_segment.py) and every slot write is stamped (generation, key),
so `handoff()` can give a same-host decode process the segment names and slots of a prompt's pages
to copy straight from, validating each slot's stamp around its copy (services/kvstore/handoff.py).
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from prometheus_client import Counter, Gauge

from services.engine.kv_transfer import as_uint8
from services.kvstore.shared_segment import SharedSegment, shm_room, sweep_dead

if TYPE_CHECKING:
    from services.common.config import KVNearSection
    from services.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

NEAR_HITS = Counter("relay_kv_near_hits", "pages served from the near (in-process) KV tier")
NEAR_HIT_BYTES = Counter("relay_kv_near_hit_bytes", "bytes served from the near KV tier")
NEAR_MISSES = Counter("relay_kv_near_misses", "pages asked of the near KV tier and not found there")
NEAR_PUTS = Counter("relay_kv_near_puts", "pages stored in the near KV tier")
NEAR_EVICTIONS = Counter("relay_kv_near_evictions", "pages evicted from the near KV tier (LRU)")
NEAR_USED = Gauge("relay_kv_near_used_bytes", "bytes of pages held in the near KV tier")
NEAR_BUDGET = Gauge("relay_kv_near_budget_bytes", "the near KV tier's byte budget")

# Slots are allocated in chunks of about this many bytes (one pinned allocation each).
CHUNK_BYTES = 256 << 20


def _copy_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, length) of each run of consecutive slot ids."""
    out: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s:
            start, first, m = out[-1]
            out[-1] = (start, first, m + 1)
        else:
            out.append((i, s, 1))
    return out


class NearRun:
    """A run of pages held out of the near tier (chain order): their slots are not reused until
    `release()`. `to_device_pages` copies them to a device in one [n, page_bytes] tensor (pinned -> device,
    non_blocking; no bytes, no sockets); release waits for those copies before letting go."""

    def __init__(self, cache: NearCache, keys: list[bytes], slots: list[int]):
        self.cache, self.keys, self.slots = cache, keys, slots
        self.page_bytes = cache.page_bytes
        self._event: torch.cuda.Event | None = None
        self._released = False

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.page_bytes

    def __len__(self) -> int:
        return len(self.slots)

    def segments(self, rows: Sequence[int] | None = None) -> list[tuple[int, torch.Tensor]]:
        """(destination row, [m, page_bytes] view of m consecutive slots) covering `rows` (indices
        into this run; None: all), in order."""
        slots = self.slots if rows is None else [self.slots[r] for r in rows]
        return [(start, self.cache._view(first, m)) for start, first, m in self.cache._chunk_runs(slots)]

    def to_device_pages(self, device: torch.device, rows: Sequence[int] | None = None) -> torch.Tensor:
        """The pages (all, or `rows` of them) as one [n, page_bytes] uint8 tensor on `device`."""
        segs = self.segments(rows)
        n = len(self.slots) if rows is None else len(rows)
        if device.type == "cpu" and len(segs) == 1:
            return segs[0][1]  # already one host block: the import reads it in place
        out = torch.empty((n, self.page_bytes), dtype=torch.uint8, device=device)
        for start, seg in segs:
            out[start : start + seg.shape[0]].copy_(seg, non_blocking=True)
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def tobytes(self) -> bytes:
        return b"".join(seg.numpy().tobytes() for _, seg in self.segments())

    def byte_views(self, first: int = 0, count: int | None = None) -> list[memoryview]:
        """Views of pages [first, first + count) of this run, one per run of consecutive slots:
        what a put sends straight from the slots (no join)."""
        rows = range(first, len(self.slots) if count is None else first + count)
        return [memoryview(seg.numpy()).cast("B") for _, seg in self.segments(list(rows))]

    def release(self) -> None:
        """Let the slots go (idempotent); waits for an in-flight device copy out of them first."""
        if self._released:
            return
        if self._event is not None:
            self._event.synchronize()
        self._released = True
        self.cache._unhold(self.slots)


class NearCache:
    """LRU of `page_bytes`-sized pages under `budget_bytes` (rounded down to whole pages)."""

    def __init__(
        self,
        budget_bytes: int,
        page_bytes: int,
        pin: bool,
        chunk_bytes: int = CHUNK_BYTES,
        shared: bool = False,
    ):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be > 0, not {page_bytes}")
        self.page_bytes, self.pin = page_bytes, pin
        # One SharedSegment per chunk when shared (None for a chunk that had to be private: a
        # full /dev/shm); empty when not.
        self.shared = shared
        self._segments: list[SharedSegment | None] = []
        if shared:
            sweep_dead()
        self.capacity = max(0, budget_bytes) // page_bytes  # slots
        self.budget_bytes = self.capacity * page_bytes
        self.chunk_slots = max(1, min(self.capacity, chunk_bytes // page_bytes))
        self._chunks: list[torch.Tensor] = []
        self._free: list[int] = []  # a heap: lowest slot first, so a batch gets consecutive slots
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, LRU first
        self._key_of: dict[int, bytes] = {}
        self._holds: dict[int, int] = {}  # slot -> readers/writers holding it
        self._lock = threading.Lock()
        self.hits = self.hit_bytes = self.misses = self.puts = self.evictions = 0
        self.dropped = 0  # pages not stored: every slot was held
        NEAR_BUDGET.set(self.budget_bytes)

    # ------------------------------------------------------------------ slots

    @property
    def allocated_slots(self) -> int:
        return sum(c.shape[0] for c in self._chunks)

    def _view(self, first: int, m: int) -> torch.Tensor:
        c, i = divmod(first, self.chunk_slots)
        return self._chunks[c][i : i + m]

    def _chunk_runs(self, slots: Sequence[int]) -> list[tuple[int, int, int]]:
        """Runs of consecutive slots that also lie in one chunk (one view each)."""
        out: list[tuple[int, int, int]] = []
        for start, first, m in _copy_runs(slots):
            while m > 0:
                room = self.chunk_slots - first % self.chunk_slots
                k = min(m, room)
                out.append((start, first, k))
                start, first, m = start + k, first + k, m - k
        return out

    def reserve(self) -> int:
        """Allocate (pin) every chunk now rather than as the tier fills, so no later put pays for
        it (a benchmark's timed turns, or a service that wants its memory up front). Returns the
        slots allocated."""
        with self._lock:
            while self.allocated_slots < self.capacity:
                self._grow()
            return self.allocated_slots

    def _grow(self) -> None:
        have = self.allocated_slots
        n = min(self.chunk_slots, self.capacity - have)
        # A pinned chunk is a DMA source/target; pageable memory would make every device copy a
        # staged one. Chunks are never returned: the tier keeps what it has filled. Not an
        # inference tensor, whichever thread grows the tier (an engine's loop thread runs under
        # inference_mode): pull and publisher threads write into it too.
        seg = self._new_segment(n) if self.shared else None
        if seg is not None:
            chunk = seg.data
        else:
            with torch.inference_mode(False):
                chunk = torch.empty((n, self.page_bytes), dtype=torch.uint8, pin_memory=self.pin)
        if self.shared:
            self._segments.append(seg)
        self._chunks.append(chunk)
        for s in range(have, have + n):
            heapq.heappush(self._free, s)

    def _new_segment(self, n: int) -> SharedSegment | None:
        """A shared chunk of n slots, or None (a private chunk instead: no handoff of its pages)
        when /dev/shm has no room for it."""
        size = SharedSegment.segment_bytes(n, self.page_bytes)
        try:
            if shm_room() < size:
                log.warning(f"/dev/shm has no room for a {size}-byte kv segment: private chunk (no handoff)")
                return None
            with torch.inference_mode(False):
                return SharedSegment.create(n, self.page_bytes, self.pin, tag=f"-{len(self._chunks)}")
        except OSError as e:
            log.warning(f"cannot create a kv segment ({e}): private chunk (no handoff)")
            return None

    def _segment_of(self, slot: int) -> tuple[SharedSegment | None, int]:
        """The segment holding `slot` (None: private) and the slot's index inside it."""
        c, i = divmod(slot, self.chunk_slots)
        return (self._segments[c] if self.shared else None), i

    def _alloc(self) -> int | None:
        """A free slot, held by the caller (lock held). Grows a chunk while under budget, else
        evicts the least recently used page; None when every slot is held."""
        while True:
            if self._free:
                slot = heapq.heappop(self._free)
                self._holds[slot] = 1
                return slot
            if self.allocated_slots < self.capacity:
                try:
                    self._grow()
                    continue
                except RuntimeError as e:  # e.g. pinned memory refused: keep the tier as it is
                    log.warning(f"kv near tier cannot grow past {self.allocated_slots} pages ({e})")
                    self.capacity = self.allocated_slots
                    self.budget_bytes = self.capacity * self.page_bytes
                    NEAR_BUDGET.set(self.budget_bytes)
            if not self._index:
                return None
            key, slot = self._index.popitem(last=False)
            del self._key_of[slot]
            self.evictions += 1
            NEAR_EVICTIONS.inc()
            if slot not in self._holds:
                heapq.heappush(self._free, slot)

    def _unhold(self, slots: Sequence[int]) -> None:
        with self._lock:
            for s in slots:
                left = self._holds[s] - 1
                if left:
                    self._holds[s] = left
                    continue
                del self._holds[s]
                if s not in self._key_of:  # evicted (or never indexed) while held: free now
                    heapq.heappush(self._free, s)
            self._gauge()

    def _gauge(self) -> None:
        NEAR_USED.set(len(self._index) * self.page_bytes)

    # ------------------------------------------------------------------ pages

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self) * self.page_bytes

    def run_length(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` are here (a hint for the pull decision: no LRU touch, no stats)."""
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._index:
                    break
                n += 1
            return n

    def acquire(self, keys: Sequence[bytes], count: bool = True) -> NearRun:
        """The leading run of `keys` held here, held for the caller (release it when copied).
        `count`: a lookup (hits / misses counted), not the tier's own bookkeeping."""
        with self._lock:
            slots = []
            for k in keys:
                slot = self._index.get(k)
                if slot is None:
                    break
                slots.append(slot)
                self._holds[slot] = self._holds.get(slot, 0) + 1
            got = list(keys[: len(slots)])
            self._touch(got)
            if not count:
                return NearRun(self, got, slots)
            self.hits += len(slots)
            self.hit_bytes += len(slots) * self.page_bytes
            self.misses += len(keys) - len(slots)
        NEAR_HITS.inc(len(slots))
        NEAR_HIT_BYTES.inc(len(slots) * self.page_bytes)
        NEAR_MISSES.inc(len(keys) - len(slots))
        return NearRun(self, got, slots)

    def _touch(self, chain: Sequence[bytes]) -> None:
        # Tail first, so under LRU a chain's head is evicted last (a chain is useless without it),
        # as the engine's prefix cache and import_pages do.
        for k in reversed(chain):
            if k in self._index:
                self._index.move_to_end(k)

    def put(self, keys: Sequence[bytes], data: Any) -> int:
        """Store pages (chain order; `data`: their bytes concatenated, any buffer or a uint8 tensor,
        host or device). Pages already here are only touched. Returns how many were stored. At most
        `capacity` pages, the chain's head first: more would only evict each other."""
        src = as_uint8(data) if not isinstance(data, torch.Tensor) else data.reshape(-1).view(torch.uint8)
        if src.numel() != len(keys) * self.page_bytes:
            raise ValueError(f"{src.numel()} bytes for {len(keys)} pages of {self.page_bytes} bytes")
        if not keys:
            return 0
        rows = src.view(len(keys), self.page_bytes)
        with self._lock:
            todo: list[int] = []
            slots: list[int] = []
            seen: set[bytes] = set()
            want = keys[: self.capacity]
            for i, k in enumerate(want):
                if k in self._index or k in seen:
                    continue
                slot = self._alloc()
                if slot is None:
                    self.dropped += len(want) - i
                    break
                seen.add(k)
                todo.append(i)
                slots.append(slot)
            self._touch(list(keys))
        # Copies outside the lock: the slots are held by this writer and not yet indexed.
        device_src = src.device.type == "cuda"
        for slot in slots:  # a reader that recorded the slot's old generation now sees a change
            seg, i = self._segment_of(slot)
            if seg is not None:
                seg.begin_write(i)
        try:
            for start, first, m in self._chunk_runs(slots):
                idx = todo[start : start + m]
                dst = self._view(first, m)
                if idx[-1] - idx[0] == m - 1:  # consecutive source pages too: one copy
                    dst.copy_(rows[idx[0] : idx[0] + m], non_blocking=device_src)
                else:
                    for j, i in enumerate(idx):
                        dst[j].copy_(rows[i], non_blocking=device_src)
            if device_src and slots:
                torch.cuda.current_stream(src.device).synchronize()  # the slots must hold the bytes
        except BaseException:
            self._unhold(slots)  # never indexed: the slots go back to the free list
            raise
        for i, slot in zip(todo, slots, strict=True):
            seg, j = self._segment_of(slot)
            if seg is not None:
                seg.end_write(j, keys[i])
        stored = 0
        with self._lock:
            for i, slot in zip(todo, slots, strict=True):
                k = keys[i]
                if k in self._index:  # another writer stored it meanwhile: keep theirs
                    continue
                self._index[k] = slot
                self._key_of[slot] = k
                stored += 1
            self._touch(list(keys))
            self.puts += stored
        self._unhold(slots)
        NEAR_PUTS.inc(stored)
        return stored

    def hold_export(self, keys: list[bytes], blob: torch.Tensor) -> NearRun | None:
        """Write-through of an engine's export (PageExchange.host_pages): `blob` ([n, page_bytes]
        on the device) goes straight into pinned slots (one DMA, no pageable copy, no bytes
        object), and the pages come back held, for the publisher to send from the slots. None
        when not all of them could be kept (the caller exports bytes instead)."""
        self.put(keys, blob)
        run = self.acquire(keys, count=False)
        if len(run) == len(keys):
            return run
        run.release()
        return None

    def handoff(self, keys: Sequence[bytes]) -> tuple[NearRun, list[tuple[SharedSegment, int, int]]]:
        """The leading run of `keys` that lies in shared segments, held (release it when the
        reader is done or its lease ends), with each page's (segment, slot in it, generation)."""
        run = self.acquire(keys, count=False)
        refs: list[tuple[SharedSegment, int, int]] = []
        for slot in run.slots:
            seg, i = self._segment_of(slot)
            if seg is None:
                break
            refs.append((seg, i, seg.generation(i)))
        if len(refs) < len(run):  # only a shared prefix can be handed off: let the rest go
            tail = NearRun(self, run.keys[len(refs) :], run.slots[len(refs) :])
            run = NearRun(self, run.keys[: len(refs)], run.slots[: len(refs)])
            tail.release()
        return run, refs

    @property
    def shared_segments(self) -> list[SharedSegment]:
        """The tier's shared segments (chunks that had to be private left out)."""
        return [s for s in self._segments if s is not None]

    def close(self) -> None:
        """Unlink the shared segments (no /dev/shm left behind); the tier is unusable after.
        Idempotent."""
        for seg in self._segments:
            if seg is not None:
                seg.close()
        self._segments = [None] * len(self._segments)

    def clear(self) -> None:
        """Forget every page (slots held by readers are freed when released)."""
        with self._lock:
            for slot in self._index.values():
                del self._key_of[slot]
                if slot not in self._holds:
                    heapq.heappush(self._free, slot)
            self._index.clear()
            self._gauge()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "near_budget_bytes": self.budget_bytes,
                "near_used_bytes": len(self._index) * self.page_bytes,
                "near_pages": len(self._index),
                "near_hits": self.hits,
                "near_hit_bytes": self.hit_bytes,
                "near_misses": self.misses,
                "near_puts": self.puts,
                "near_evictions": self.evictions,
                "near_dropped": self.dropped,
            }


def near_budget(section: KVNearSection, device_type: str) -> int:
    """`kvstore.near.bytes`, or its per-device default when unset."""
    if section.bytes is not None:
        return section.bytes
    return section.default_cuda_bytes if device_type == "cuda" else section.default_cpu_bytes


def near_for_engine(engine: LLMEngine, section: KVNearSection, shared: bool = False) -> NearCache | None:
    """The near tier for this engine's page layout (None when its budget is under one page).
    `shared`: in named shared-memory segments, handed off to same-host readers (a prefill's)."""
    device = engine.kv.k.device.type
    per = engine.pages.page_bytes  # a multi-rank engine's exported pages are whole (parallel/pages.py)
    budget = near_budget(section, device)
    if budget < per:
        log.info(f"kv near tier off (kvstore.near.bytes={budget})")
        return None
    cache = NearCache(budget, per, pin=device == "cuda", shared=shared)
    log.info(
        f"kv near tier: {cache.budget_bytes} bytes ({cache.capacity} pages of {per} bytes), "
        f"{'pinned' if cache.pin else 'pageable'} {'shared' if shared else 'private'} host memory"
    )
    return cache
