"""The KV cache: one preallocated slot of max_seq_len positions per running sequence.

Everything else talks to it through `allocate/free/copy` (the scheduler and engine) and
`store/load` (attention), so replacing it with a paged cache and block manager only changes this
module and what the scheduler hands to `Span.slot`.
"""

from __future__ import annotations

import heapq

import torch


class KVCache:
    def __init__(
        self,
        n_layers: int,
        num_slots: int,
        max_seq_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        shape = (n_layers, num_slots, max_seq_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # A min-heap: lowest slots first, so a lightly loaded engine reuses the same memory.
        self._free = list(range(num_slots))

    # ------------------------------------------------------------ allocation (scheduler side)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("KV cache full: the scheduler must check num_free before allocating")
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def copy(self, src: int, dst: int, length: int) -> None:
        """Share a computed prefix: used to fork n samples from one prompt prefill."""
        self.k[:, dst, :length] = self.k[:, src, :length]
        self.v[:, dst, :length] = self.v[:, src, :length]

    # ------------------------------------------------------------ data (attention side)

    def store(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write per-token k/v [T, n_kv, D] at (slot, position) for each token."""
        self.k[layer, slots, positions] = k.to(self.k.dtype)
        self.v[layer, slots, positions] = v.to(self.v.dtype)

    def load(self, layer: int, slots: torch.Tensor, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of positions [0, ctx_len) for each slot: [B, ctx_len, n_kv, D]."""
        return self.k[layer, slots, :ctx_len], self.v[layer, slots, :ctx_len]
