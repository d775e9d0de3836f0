"""The paged KV cache: a pool of fixed-size pages (blocks) plus the block manager that hands them out.

Each sequence owns a *block table*: the page ids holding its positions 0.., block_size per page.
Pages are allocated as a sequence grows, so memory follows the tokens actually held rather than
max_seq_len per sequence, and pages can be *shared*: the n samples of a request share their
prompt's pages, and a full page whose tokens (and everything before them) match an earlier
sequence's is reused from the prefix cache instead of being recomputed.

Prefix cache: a full, computed page is registered under a chained hash
h_i = H(h_{i-1}, tokens of page i) whose root is salted with the weight version, so a hit implies
the same tokens at the same positions after the same prefix under the same weights. Pages with no
users stay cached (ref count 0) and are evicted least-recently-released first, only when the
free list of never-cached pages is empty.

The attention side only sees `store(layer, slot_mapping, k, v)` and `load(layer, block_tables)`;
a Triton/FlexAttention paged kernel can replace `load` + SDPA without touching the scheduler.

Layouts (`KVCache.for_model`): GQA keeps K and V per KV head. MLA (layers/mla.py) keeps one latent "head"
of kv_lora_rank + qk_rope_head_dim values per token in the K pool and has a V pool of width 0.
MoE models add a routing store next to the pages: the expert ids each MoE layer chose for the
token in that slot, [moe_layers, slots, top_k] (uint8, or int16 read back as uint16, past 254
experts; unwritten slots hold the "unrecorded" sentinel). A prefix-cache hit skips the forward,
so the ids must live with the page for a request to get ids for every prompt token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

import numpy as np
import torch

from services.common.config import ModelConfig
from services.common.routing import routing_dtype, unrecorded


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


class KVCache:
    def __init__(
        self,
        n_layers: int,
        num_blocks: int,
        block_size: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        v_head_dim: int | None = None,
        moe_layers: int = 0,
        top_k: int = 0,
        n_experts: int = 0,
        index_head_dim: int = 0,
    ):
        """v_head_dim: V width (None: head_dim; 0: no V, the MLA latent layout). moe_layers, top_k,
        n_experts: the routing store's shape (0 layers: no store, a dense model). index_head_dim:
        the DSA indexer's key per token and layer (0: no indexer)."""
        self.num_blocks, self.block_size, self.max_seq_len = num_blocks, block_size, max_seq_len
        self.blocks = BlockManager(num_blocks, block_size)
        # Flat over (page, offset): a token's K/V live at row page * block_size + offset.
        shape = (n_layers, num_blocks * block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self.v = torch.zeros((*shape[:3], v_dim), dtype=dtype, device=device)
        self.index_k: torch.Tensor | None = None
        if index_head_dim:
            self.index_k = torch.zeros((n_layers, shape[1], index_head_dim), dtype=dtype, device=device)
        self.routing: torch.Tensor | None = None
        self.routing_dtype = np.dtype(np.uint8)
        if moe_layers:
            self.routing_dtype = routing_dtype(n_experts)
            # torch's uint16 lacks indexing kernels; int16 holds the same bits (ids < 32767, the
            # sentinel 65535 is -1) and is viewed as uint16 when read back.
            tdtype = torch.uint8 if self.routing_dtype == np.uint8 else torch.int16
            fill = unrecorded(self.routing_dtype) if tdtype == torch.uint8 else -1
            # One row past the pages: padding tokens of a CUDA-graph decode step carry slot -1,
            # which lands there instead of in a real page's last slot.
            self.routing = torch.full(
                (moe_layers, num_blocks * block_size + 1, top_k), fill, dtype=tdtype, device=device
            )

    @classmethod
    def for_model(
        cls,
        m: ModelConfig,
        num_blocks: int,
        block_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """The cache layout model `m` needs (GQA or MLA latent, plus routing for MoE)."""
        return cls(m.n_layers, num_blocks, block_size, max_seq_len, dtype=dtype, device=device, **_layout(m))

    @staticmethod
    def bytes_per_block_for(m: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        lay = _layout(m)
        v_dim = lay["v_head_dim"] if lay["v_head_dim"] is not None else lay["head_dim"]
        kv = m.n_layers * block_size * lay["n_kv_heads"] * (lay["head_dim"] + v_dim) * dtype.itemsize
        kv += m.n_layers * block_size * lay["index_head_dim"] * dtype.itemsize
        ids = lay["moe_layers"] * block_size * lay["top_k"] * routing_dtype(lay["n_experts"]).itemsize
        return kv + ids

    @staticmethod
    def bytes_per_block(
        n_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * n_layers * block_size * n_kv_heads * head_dim * dtype.itemsize

    def pools(self) -> list[torch.Tensor]:
        """Every per-slot tensor, each [layers, num_blocks * block_size, ...]: what a page is made
        of (copy_block, kv_transfer's page bytes). Empty V pools (MLA) are left out."""
        out = [self.k] + ([self.v] if self.v.shape[-1] else [])
        out += [self.index_k] if self.index_k is not None else []
        return out + ([self.routing[:, :-1]] if self.routing is not None else [])

    @property
    def num_free(self) -> int:
        return self.blocks.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one page (all layers): a forked sample's private copy of a partly filled page."""
        bs = self.block_size
        for t in self.pools():
            t[:, dst * bs : (dst + 1) * bs] = t[:, src * bs : (src + 1) * bs]

    # ------------------------------------------------------------ data (attention side)

    def store(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write per-token k/v [T, n_kv, D] at flat rows slot_mapping [T]."""
        self.k[layer, slot_mapping] = k.to(self.k.dtype)
        self.v[layer, slot_mapping] = v.to(self.v.dtype)

    def load(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather each sequence's pages in order: [B, n_pages * block_size, n_kv, D]. Positions past
        a sequence's length read whatever page padded its table; the caller masks them."""
        b, n = block_tables.shape
        bs = self.block_size
        rows = (block_tables[:, :, None] * bs + torch.arange(bs, device=block_tables.device)).view(b, n * bs)
        return self.k[layer, rows], self.v[layer, rows]

    # ------------------------------------------------------------ DSA indexer keys (GLM-5)

    def store_index(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor) -> None:
        assert self.index_k is not None, "this cache has no indexer pool"
        self.index_k[layer, slot_mapping] = k.to(self.index_k.dtype)

    def load_index(self, layer: int, block_tables: torch.Tensor) -> torch.Tensor:
        """[B, n_pages * block_size, index_head_dim], gathered by page like `load`."""
        assert self.index_k is not None, "this cache has no indexer pool"
        b, n = block_tables.shape
        bs = self.block_size
        rows = (block_tables[:, :, None] * bs + torch.arange(bs, device=block_tables.device)).view(b, n * bs)
        return self.index_k[layer, rows]

    # ------------------------------------------------------------ routed experts (MoE)

    def store_routing(self, moe_layer: int, slot_mapping: torch.Tensor, ids: torch.Tensor) -> None:
        """Record the expert ids [T, top_k] one MoE layer chose for the tokens at slot_mapping [T]."""
        assert self.routing is not None, "a dense model's cache has no routing store"
        self.routing[moe_layer, slot_mapping] = ids.to(self.routing.dtype)

    def read_routing(self, block_table: list[int], num_cached: int, num_tokens: int) -> np.ndarray:
        """[num_tokens, moe_layers, top_k] ids of a sequence's positions 0..num_tokens-1 in the wire
        dtype (services/common/routing.py); positions from num_cached on were never forwarded and
        hold the unrecorded sentinel."""
        assert self.routing is not None, "a dense model's cache has no routing store"
        bs = self.block_size
        layers, _, k = self.routing.shape
        out = np.full((num_tokens, layers, k), unrecorded(self.routing_dtype), dtype=self.routing_dtype)
        if num_cached:
            pos = torch.arange(num_cached)
            pages = torch.tensor(block_table[: self.blocks_for(num_cached)], dtype=torch.long)
            rows = (pages[pos // bs] * bs + pos % bs).to(self.routing.device)
            ids = self.routing[:, rows].permute(1, 0, 2).cpu().numpy()
            out[:num_cached] = ids.view(self.routing_dtype)
        return out


def _layout(m: ModelConfig) -> dict[str, int | None]:
    """KVCache constructor arguments (past n_layers) for model m."""
    moe_layers = m.n_layers - m.first_k_dense if m.is_moe else 0
    routing = {"moe_layers": moe_layers, "top_k": m.n_experts_per_tok, "n_experts": m.n_routed_experts}
    routing["index_head_dim"] = m.index_head_dim if m.index_topk else 0
    if m.is_mla:
        return {"n_kv_heads": 1, "head_dim": m.kv_lora_rank + m.qk_rope_head_dim, "v_head_dim": 0, **routing}
    return {"n_kv_heads": m.n_kv_heads, "head_dim": m.head_dim, "v_head_dim": None, **routing}
