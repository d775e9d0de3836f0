"""The block manager: hands out the KV cache's fixed-size pages (blocks) and keeps the prefix cache.

Pages are allocated as a sequence grows, so memory follows the tokens actually held rather than
max_seq_len per sequence, and pages can be *shared*: the n samples of a request share their
prompt's pages, and a full page whose tokens (and everything before them) match an earlier
sequence's is reused from the prefix cache instead of being recomputed.

Prefix cache: a full, computed page is registered under a chained hash
h_i = H(h_{i-1}, tokens of page i) whose root is salted with the weight version, so a hit implies
the same tokens at the same positions after the same prefix under the same weights. Pages with no
users stay cached (ref count 0) and are evicted least-recently-released first, only when the
free list of never-cached pages is empty.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


def root_hash(version: int, layout: str = "") -> bytes:
    """Start of a hash chain: KV computed by other weights must never match, nor (through `layout`,
    kv_transfer.layout_id: model shape, KV dtype, page size) KV of another model or page layout,
    which matters once pages travel between engines through the KV store (services/kvstore)."""
    salt = f"relay-kv-v{version}" + (f"|{layout}" if layout else "")
    return hashlib.blake2b(salt.encode(), digest_size=16).digest()


def block_hash(prev: bytes, tokens: list[int]) -> bytes:
    """Chained page hash: covers this page's tokens and, through `prev`, every earlier one."""
    return page_hash(prev, array("q", tokens).tobytes())


def page_hash(prev: bytes, raw: bytes | memoryview) -> bytes:
    """block_hash of a page given as its tokens' int64 bytes (kv_transfer.chain_hashes hashes a
    long prompt from one buffer)."""
    return hashlib.blake2b(prev + raw, digest_size=16).digest()


class BlockManager:
    """Reference-counted pages with a free list, a hash -> page map and an LRU of cached pages.

    allocate() -> page      a fresh page (ref 1); evicts the LRU cached page if no free one
    lookup(hash) -> page?   a cached page holding exactly that chain, if any
    acquire(page)           one more user of an existing page (a prefix hit or a shared prompt)
    release(page)           one user fewer; at 0 a registered page stays cached, else is freed
    register(page, hash)    a full, computed page becomes reusable under `hash`
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # unused and holding nothing reusable
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0 but registered: LRU order

    @property
    def num_free(self) -> int:
        """Pages allocate() can return now (free or evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)  # least recently released
            self._unregister(block)
        else:
            raise RuntimeError("KV cache full: the scheduler must check num_free before allocating")
        self.ref[block] = 1
        return block

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def acquire(self, block: int) -> None:
        if self.ref[block] == 0:
            del self._cached[block]
        self.ref[block] += 1

    def release(self, block: int) -> None:
        assert self.ref[block] > 0, f"page {block} released more often than acquired"
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.hash_of[block] is not None:
                self._cached[block] = None  # most recently released: evicted last
            else:
                self._free.append(block)

    def register(self, block: int, h: bytes) -> None:
        """Identical pages computed concurrently keep the first registration; the other stays
        private and is freed normally."""
        if h in self.by_hash or self.hash_of[block] is not None:
            return
        self.by_hash[h] = block
        self.hash_of[block] = h

    def _unregister(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            del self.by_hash[h]
            self.hash_of[block] = None
