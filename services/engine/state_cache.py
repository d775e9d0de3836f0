"""The recurrent state cache of a hybrid model's Mamba-2 layers (arch nemotron_h), beside the paged
KV cache: one *slot* per running sequence, holding every Mamba-2 layer's convolution state (the
last conv_kernel - 1 inputs of its depthwise convolution, model dtype) and SSM state ([heads,
head_dim, state] float32, what ops/mamba2.py's scan and step carry).

Unlike KV pages a state summarises the whole prefix, so it is neither shared nor reusable at a page
boundary: a sequence takes a slot at admission and gives it back when it finishes, is aborted or
is preempted (its recompute starts from a zeroed state); a forked sample copies its parent's slot
after the prefill that both share. Prefix caching is off for these models (the scheduler's
`prefix_caching` is False whenever a state cache exists): a cached page would skip tokens whose
effect on the state was never computed. The slots number the engine's max_batch_size, the most
sequences that run at once.

The slots are allocated whole at start-up, ahead of the KV pages, and come out of the same byte
budget (decode.engine.kv_cache_bytes): `bytes_for` is what the engine subtracts before sizing the
page pool (model_runner.py). One more row than `slots` exists: the padding slot (`pad_slot`, never
allocated), where the padding rows of a captured decode graph (cuda_graphs.py) read and write, so
a graph's fixed batch advances its real rows' states in place and leaves every other slot as it
was (the routing store's pad row does the same for expert ids, kv_cache.py).
"""

from __future__ import annotations

import torch

from services.common.config import ModelConfig


class StateCache:
    def __init__(
        self,
        n_layers: int,
        slots: int,
        conv_dim: int,
        conv_kernel: int,
        n_heads: int,
        head_dim: int,
        state_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.slots = slots
        self.pad_slot = slots  # the extra row (module docstring)
        # [layer, slot, ...]: one layer's view [slot, ...] has each slot contiguous, the layout
        # ops/mamba2_triton.ssd_step_pool updates in place.
        self.conv = torch.zeros(n_layers, slots + 1, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        self.ssm = torch.zeros(
            n_layers, slots + 1, n_heads, head_dim, state_size, dtype=torch.float32, device=device
        )
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first

    @staticmethod
    def _shape(m: ModelConfig) -> tuple[int, int, int, int, int, int] | None:
        """(Mamba-2 layers, conv_dim, conv_kernel, heads, head_dim, state); None without any."""
        n = m.hybrid_pattern.count("M") if m.is_hybrid else 0
        if not n:
            return None
        conv_dim = m.mamba_n_heads * m.mamba_head_dim + 2 * m.mamba_n_groups * m.ssm_state_size
        return n, conv_dim, m.mamba_conv_kernel, m.mamba_n_heads, m.mamba_head_dim, m.ssm_state_size

    @classmethod
    def slot_bytes(cls, m: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one slot, every Mamba-2 layer's states (0 for a model without any)."""
        shape = cls._shape(m)
        if shape is None:
            return 0
        n, conv_dim, kernel, heads, head_dim, state = shape
        return n * (conv_dim * (kernel - 1) * dtype.itemsize + heads * head_dim * state * 4)

    @classmethod
    def bytes_for(cls, m: ModelConfig, slots: int, dtype: torch.dtype) -> int:
        """Bytes of the cache `for_model` allocates: `slots` and the padding slot (0 for a model
        without Mamba-2 layers)."""
        return (slots + 1) * cls.slot_bytes(m, dtype)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    @classmethod
    def for_model(
        cls, m: ModelConfig, slots: int, dtype: torch.dtype, device: torch.device
    ) -> StateCache | None:
        """The cache of model `m`'s Mamba-2 layers; None for a model without any."""
        shape = cls._shape(m)
        if shape is None:
            return None
        n, conv_dim, kernel, heads, head_dim, state = shape
        return cls(n, slots, conv_dim, kernel, heads, head_dim, state, dtype, device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("state cache full: the scheduler admits at most `slots` sequences")
        return self._free.pop()

    def release(self, slot: int) -> None:
        assert 0 <= slot < self.slots and slot not in self._free, f"state slot {slot} released twice"
        self._free.append(slot)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero every layer's state of `slots` [n] (sequences whose first token is fed now)."""
        self.conv[:, slots] = 0
        self.ssm[:, slots] = 0

    def copy(self, src: int, dst: int) -> None:
        """A forked sample starts from its parent's state (all layers)."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]
