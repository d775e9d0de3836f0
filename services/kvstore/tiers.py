"""Storage tiers of the KV store and the LRU hierarchy over them.

Every tier is an LRU of pages (key -> bytes) under a byte budget. TieredStore keeps them in order
(host RAM, local disk, Mooncake): new pages enter the top tier; a tier over budget demotes its
least recently used pages to the next one, and the last tier evicts them. A read that hits a lower
tier promotes the page to RAM (moved out of a private tier; copied out of the shared Mooncake pool,
where other gateways may still want it).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from services.kvstore.wire import StoreStats, TierStats


class Tier(Protocol):
    name: str
    budget_bytes: int
    used_bytes: int
    # False: a page read from here is copied up (it stays for others), not moved.
    exclusive: bool

    def __len__(self) -> int: ...
    def __contains__(self, key: bytes) -> bool: ...
    def get(self, key: bytes) -> bytes | None: ...
    def put(self, key: bytes, data: bytes) -> bool: ...
    def discard(self, key: bytes) -> None: ...
    def pop_lru(self) -> tuple[bytes, bytes] | None: ...
    def close(self) -> None: ...


class MemoryTier:
    exclusive = True

    def __init__(self, budget_bytes: int, name: str = "ram"):
        self.name, self.budget_bytes, self.used_bytes = name, budget_bytes, 0
        self._pages: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pages

    def get(self, key: bytes) -> bytes | None:
        data = self._pages.get(key)
        if data is not None:
            self._pages.move_to_end(key)
        return data

    def put(self, key: bytes, data: bytes) -> bool:
        self.discard(key)
        self._pages[key] = data
        self.used_bytes += len(data)
        return True

    def discard(self, key: bytes) -> None:
        data = self._pages.pop(key, None)
        if data is not None:
            self.used_bytes -= len(data)

    def pop_lru(self) -> tuple[bytes, bytes] | None:
        if not self._pages:
            return None
        key, data = self._pages.popitem(last=False)
        self.used_bytes -= len(data)
        return key, data

    def close(self) -> None:
        self._pages.clear()
        self.used_bytes = 0


class IndexedTier:
    """A tier whose page bytes live outside the process (files, a shared pool): an LRU index of the
    pages it holds (key -> size) and their byte count."""

    def __init__(self, name: str, budget_bytes: int):
        self.name, self.budget_bytes, self.used_bytes = name, budget_bytes, 0
        self._index: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def _remember(self, key: bytes, size: int) -> None:
        self._index[key] = size
        self.used_bytes += size

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self.used_bytes -= size


class DiskTier(IndexedTier):
    """One file per page under `root` (written to a temporary name, then renamed, so a crash never
    leaves a torn page under a valid key). Pages already on disk are indexed at start, oldest
    first, so a restarted gateway keeps serving them."""

    exclusive = True

    def __init__(self, root: str | Path, budget_bytes: int, name: str = "disk"):
        super().__init__(name, budget_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        found = []
        for p in self.root.glob("*/*.page"):
            try:
                found.append((p.stat().st_mtime, bytes.fromhex(p.stem), p.stat().st_size))
            except (ValueError, OSError):
                continue
        for _mtime, key, size in sorted(found):
            self._remember(key, size)
        for p in self.root.glob("*/*.tmp"):
            p.unlink(missing_ok=True)

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / f"{h}.page"

    def get(self, key: bytes) -> bytes | None:
        if key not in self._index:
            return None
        try:
            data = self._path(key).read_bytes()
        except OSError:
            self._forget(key)
            return None
        self._index.move_to_end(key)
        return data

    def put(self, key: bytes, data: bytes) -> bool:
        self.discard(key)
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        tmp.rename(path)
        self._remember(key, len(data))
        return True

    def discard(self, key: bytes) -> None:
        if key in self._index:
            self._path(key).unlink(missing_ok=True)
            self._forget(key)

    def pop_lru(self) -> tuple[bytes, bytes] | None:
        while self._index:
            key = next(iter(self._index))
            path = self._path(key)
            try:
                data = path.read_bytes()
            except OSError:
                data = None
            path.unlink(missing_ok=True)
            self._forget(key)
            if data is not None:
                return key, data
        return None

    def close(self) -> None:
        pass  # the files stay: the next gateway on this directory serves them


class _Counters:
    def __init__(self) -> None:
        self.hits = self.puts = self.demotions = self.promotions = self.evictions = self.errors = 0


class TieredStore:
    """The tier hierarchy, thread-safe (one lock: every operation is a few dict moves plus, for the
    lower tiers, file or network I/O of one page)."""

    def __init__(self, tiers: list[Tier]):
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = tiers
        self.counters = [_Counters() for _ in tiers]
        self.gets = self.misses = 0
        self._lock = threading.Lock()

    def put(self, key: bytes, data: bytes) -> bool:
        """Store a page; False when no tier can hold it. A page already stored is only touched."""
        with self._lock:
            for tier in self.tiers:
                if key in tier:
                    return True
            return self._insert(0, key, data, count_put=True)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        with self._lock:
            return [self._get(k) for k in keys]

    def get_prefix(self, keys: list[bytes]) -> list[bytes]:
        """The pages of the longest prefix of `keys` held in some tier (a hash chain is only
        usable from its head, so pages after the first miss are neither read nor promoted)."""
        out: list[bytes] = []
        with self._lock:
            for k in keys:
                data = self._get(k)
                if data is None:
                    break
                out.append(data)
        return out

    def _get(self, key: bytes) -> bytes | None:
        self.gets += 1
        for i, tier in enumerate(self.tiers):
            try:
                data = tier.get(key)
            except Exception:  # noqa: BLE001 - a failing tier (e.g. pool down) is a miss there
                self.counters[i].errors += 1
                data = None
            if data is None:
                continue
            self.counters[i].hits += 1
            if i > 0 and len(data) <= self.tiers[0].budget_bytes:
                if tier.exclusive:
                    tier.discard(key)
                self.counters[i].promotions += 1
                self._insert(0, key, data)
            return data
        self.misses += 1
        return None

    def _insert(self, start: int, key: bytes, data: bytes, count_put: bool = False) -> bool:
        """Put into the first tier from `start` that can hold the page, then demote down the
        hierarchy whatever no longer fits."""
        for i in range(start, len(self.tiers)):
            tier = self.tiers[i]
            if len(data) > tier.budget_bytes:
                continue
            try:
                ok = tier.put(key, data)
            except Exception:  # noqa: BLE001 - this tier refused: try the next one
                self.counters[i].errors += 1
                ok = False
            if not ok:
                continue
            if count_put:
                self.counters[i].puts += 1
            self._shrink(i)
            return True
        return False

    def _shrink(self, i: int) -> None:
        tier = self.tiers[i]
        while tier.used_bytes > tier.budget_bytes:
            victim = tier.pop_lru()
            if victim is None:
                break
            key, data = victim
            if i + 1 < len(self.tiers) and self._insert(i + 1, key, data):
                self.counters[i].demotions += 1
            else:
                self.counters[i].evictions += 1

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                gets=self.gets,
                misses=self.misses,
                tiers=[
                    TierStats(
                        name=t.name,
                        budget_bytes=t.budget_bytes,
                        used_bytes=t.used_bytes,
                        pages=len(t),
                        hits=c.hits,
                        puts=c.puts,
                        demotions=c.demotions,
                        promotions=c.promotions,
                        evictions=c.evictions,
                        errors=c.errors,
                    )
                    for t, c in zip(self.tiers, self.counters, strict=True)
                ],
            )

    def close(self) -> None:
        with self._lock:
            for t in self.tiers:
                t.close()
