"""The paged KV cache: the page pools of every layer (K, V, the DSA indexer's keys, the routed-expert
store) over the pages block_manager.py hands out.

Each sequence owns a *block table*: the page ids holding its positions 0.., block_size per page.
A token's K/V live at row page * block_size + offset of its layer's pool. The attention side only
sees `store(layer, slot_mapping, k, v)` and `load(layer, block_tables)`; the Triton paged kernels
read the pools directly.

Layouts (`KVCache.for_model`): GQA keeps K and V per KV head. MLA (layers/mla.py) keeps one latent "head"
of kv_lora_rank + qk_rope_head_dim values per token in the K pool and has a V pool of width 0.
MoE models add a routing store next to the pages: the expert ids each MoE layer chose for the
token in that slot, [moe_layers, slots, top_k] (uint8, or int16 read back as uint16, past 254
experts; unwritten slots hold the "unrecorded" sentinel). A prefix-cache hit skips the forward,
so the ids must live with the page for a request to get ids for every prompt token.

A hybrid model (nemotron_h) has KV pools for its attention layers only, and `states`, the
per-sequence recurrent state of its Mamba-2 layers (state_cache.py).
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.config import EngineConfig, ModelConfig
from services.common.routing import routing_dtype, unrecorded
from services.engine.block_manager import BlockManager
from services.engine.state_cache import StateCache


class KVCache:
    state_cache: type[StateCache] = StateCache  # what `for_model` builds a hybrid model's states as

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
        # A hybrid model's per-sequence Mamba-2 states (state_cache.py; set by for_model).
        self.states: StateCache | None = None
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
        max_seqs: int = 1,
    ) -> KVCache:
        """The cache layout model `m` needs (GQA or MLA latent, plus routing for MoE; a hybrid
        model's attention layers only, and its Mamba-2 layers' state cache with `max_seqs`
        slots)."""
        kv = cls(kv_layers(m), num_blocks, block_size, max_seq_len, dtype=dtype, device=device, **_layout(m))
        kv.states = cls.state_cache.for_model(m, max_seqs, dtype, device)
        return kv

    @staticmethod
    def bytes_per_block_for(m: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        lay = _layout(m)
        v_dim = lay["v_head_dim"] if lay["v_head_dim"] is not None else lay["head_dim"]
        layers = kv_layers(m)
        kv = layers * block_size * lay["n_kv_heads"] * (lay["head_dim"] + v_dim) * dtype.itemsize
        kv += layers * block_size * lay["index_head_dim"] * dtype.itemsize
        ids = lay["moe_layers"] * block_size * lay["top_k"] * routing_dtype(lay["n_experts"]).itemsize
        return kv + ids

    @staticmethod
    def bytes_per_block(
        n_layers: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * n_layers * block_size * n_kv_heads * head_dim * dtype.itemsize

    @property
    def kv_bytes(self) -> int:
        """Bytes of the page pools (the routing store's pad row included)."""
        return sum(t.nbytes for t in (self.k, self.v, self.index_k, self.routing) if t is not None)

    @property
    def state_bytes(self) -> int:
        """Bytes of the Mamba-2 state slots (0 without them)."""
        return self.states.nbytes if self.states is not None else 0

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


def pool_blocks(
    cfg: EngineConfig, m: ModelConfig, max_seq_len: int, dtype: torch.dtype, slots: int | None = None
) -> int:
    """Pages of the pool for engine `cfg` over model `m` (a rank's shapes under tensor parallelism).

    num_kv_blocks is taken as it is. A byte budget (kv_cache_bytes) holds the hybrid model's Mamba-2
    state slots first, one per sequence that may run (`slots`, default max_batch_size: an attention
    group's share of it with data-parallel attention; StateCache.bytes_for), and pages in what
    is left; it must leave at least one max_seq_len sequence's pages, or the engine could admit no
    request of full length. Neither: max_batch_size sequences of max_seq_len."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if cfg.kv_cache_bytes is None:
        return cfg.max_batch_size * -(-max_seq_len // cfg.block_size)
    per_block = KVCache.bytes_per_block_for(m, cfg.block_size, dtype)
    slots = cfg.max_batch_size if slots is None else slots
    states = StateCache.bytes_for(m, slots, dtype)
    if not states:
        return max(1, cfg.kv_cache_bytes // per_block)
    least = -(-max_seq_len // cfg.block_size)
    if cfg.kv_cache_bytes - states < least * per_block:
        raise ValueError(
            f"decode.engine.kv_cache_bytes: {cfg.kv_cache_bytes:,} bytes cannot hold the Mamba-2 state"
            f" slots ({slots} x {states // slots:,} = {states:,} bytes, one per"
            f" max_batch_size) plus one max_seq_len sequence's KV pages ({least} x {per_block:,} bytes):"
            f" raise kv_cache_bytes to at least {states + least * per_block:,} or lower max_batch_size"
        )
    return (cfg.kv_cache_bytes - states) // per_block


def check_memory_cap(
    cfg: EngineConfig, m: ModelConfig, blocks: int, weight_bytes: int, dtype: torch.dtype
) -> None:
    """Refuse, before allocating them, a KV pool and state slots that with the weights already
    exceed cuda_memory_gib: past the cap the allocator would fail mid-start-up with a bare out of
    memory. A lower bound (activations and CUDA graph pools come on top), so any engine that fits
    its cap passes; checked on every device, so a CPU run catches a GPU config's mistake too."""
    if cfg.cuda_memory_gib is None:
        return
    kv = blocks * KVCache.bytes_per_block_for(m, cfg.block_size, dtype)
    states = StateCache.bytes_for(m, cfg.max_batch_size, dtype)
    cap = int(cfg.cuda_memory_gib * (1 << 30))
    if weight_bytes + kv + states > cap:
        raise ValueError(
            f"decode.engine.cuda_memory_gib: {cfg.cuda_memory_gib:g} GiB ({cap:,} bytes) cannot hold the"
            f" weights ({weight_bytes:,} bytes) and {blocks} KV pages ({kv:,} bytes)"
            + (f" and {cfg.max_batch_size} Mamba-2 state slots ({states:,} bytes)" if states else "")
            + ": raise it, or lower kv_cache_bytes / num_kv_blocks / max_batch_size"
        )


def kv_layers(m: ModelConfig) -> int:
    """Layers with a KV pool: every layer, or a hybrid model's attention layers (in order: the
    pool index of the i-th "*" of its hybrid_pattern is i)."""
    return m.hybrid_pattern.count("*") if m.is_hybrid else m.n_layers


def _layout(m: ModelConfig) -> dict[str, int | None]:
    """KVCache constructor arguments (past n_layers) for model m."""
    moe_layers = len(m.moe_layers())
    routing = {"moe_layers": moe_layers, "top_k": m.n_experts_per_tok, "n_experts": m.n_routed_experts}
    routing["index_head_dim"] = m.index_head_dim if m.index_topk else 0
    if m.is_mla:
        return {"n_kv_heads": 1, "head_dim": m.kv_lora_rank + m.qk_rope_head_dim, "v_head_dim": 0, **routing}
    return {"n_kv_heads": m.n_kv_heads, "head_dim": m.head_dim, "v_head_dim": None, **routing}
