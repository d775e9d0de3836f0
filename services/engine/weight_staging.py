"""Staged weight applies (EngineConfig.stage_weights): a new version is written into a staging
copy of the model's weights off the engine loop, while steps keep running on the old weights;
the loop then only copies the staging buffers into the live ones (device to device) at a step
boundary.

The staging copy (`staging_copy`) is a structural copy of the model: the same module tree, each
parameter and persistent buffer a tensor of the same shape, dtype, strides and offset over a
storage of its own, one per live storage, so views stay views of one buffer (fused q/k/v and
gate/up rows, tied embeddings). The runner's own load (ModelRunner.load_state: re-quantising
into FP8 buffers, FP8 pairs copied as they are, stacked experts, dequantising for a bf16 engine,
router rounding) runs against it unchanged, and `swap` copies every staged storage into its live
one byte for byte: the live tensors keep their addresses (CUDA graphs and the batch-1 kernel
point at them). Other tensors the modules hold (rope tables) are shared with the live model, not
copied: no load writes them. The cost is one more copy of the weights in device memory.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from services.engine.loader import Checkpoint

StorageKey = tuple[int, torch.device]


def _key(t: torch.Tensor) -> StorageKey | None:
    s = t.untyped_storage()
    return (s.data_ptr(), t.device) if s.nbytes() else None


def weight_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors a weight load writes: every parameter and persistent buffer."""
    out: list[torch.Tensor] = []
    for mod in model.modules():
        out += [p for p in mod._parameters.values() if p is not None]
        skip = mod._non_persistent_buffers_set
        out += [b for n, b in mod._buffers.items() if b is not None and n not in skip]
    return out


def staging_bytes(model: nn.Module) -> int:
    """Bytes of the staging copy of `model`: its weights' storages, each once."""
    sizes = {k: t.untyped_storage().nbytes() for t in weight_tensors(model) if (k := _key(t))}
    return sum(sizes.values())


def _held_tensors(obj: Any, seen: set[int], out: list[torch.Tensor]) -> None:
    """Every tensor a module tree holds: registered or plain attributes, inside containers,
    dataclasses (linear.FusedRows) and unregistered modules (its fused Fp8Linear)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _held_tensors(v, seen, out)
    elif isinstance(obj, list | tuple | set):
        for v in obj:
            _held_tensors(v, seen, out)
    elif isinstance(obj, nn.Module):
        for v in vars(obj).values():
            _held_tensors(v, seen, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _held_tensors(getattr(obj, f.name), seen, out)


def staging_copy(model: nn.Module) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(the staging model, (live bytes, staged bytes) per weight storage). The staged storages
    start as clones of the live ones, so the two are equal until a load writes the staging copy."""
    staged: dict[StorageKey, torch.UntypedStorage] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in weight_tensors(model):
        k = _key(t)
        if k is None or k in staged:
            continue
        live = t.untyped_storage()
        staged[k] = new = live.clone()
        pairs.append((_bytes(live, t.device), _bytes(new, t.device)))
    memo: dict[int, Any] = {}
    held: list[torch.Tensor] = []
    _held_tensors(model, set(), held)
    for t in held:
        k = _key(t)
        if k not in staged:
            memo[id(t)] = t  # not a weight: shared
            continue
        assert k is not None
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        view.set_(staged[k], t.storage_offset(), t.size(), t.stride())  # type: ignore[call-overload]
        memo[id(t)] = (
            nn.Parameter(view, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else view
        )
    return copy.deepcopy(model, memo), pairs


def _bytes(s: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(s)  # type: ignore[call-overload]


class WeightStager:
    """The staging copy of one model and the two halves of a staged apply: `stage` (any thread
    but the engine loop's, while steps run) and `swap` (the loop, between steps). One version at
    a time: stage, swap, stage, ...; a failed stage leaves the live weights as they were."""

    def __init__(self, model: nn.Module, device: torch.device, load: Callable[[nn.Module, Checkpoint], None]):
        self.device = device
        self._load = load
        self.model, pairs = staging_copy(model)
        self._live = [a for a, _ in pairs]
        self._staged = [b for _, b in pairs]
        self.nbytes = sum(b.numel() for b in self._staged)
        # CUDA: the staging's copies and quantisation kernels run on a stream of their own, so
        # the loop's steps are not queued behind them.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._swapped: torch.cuda.Event | None = None  # the last swap's copies, on the loop's stream
        self.ready = False  # a staged version waits for its swap

    @torch.no_grad()
    def stage(self, ckpt: Checkpoint) -> float:
        """Write `ckpt` into the staging copy and wait until it is there; returns the seconds
        taken. Raises what the load raises (e.g. ValueError naming a tensor), after putting the
        live weights back into the staging copy."""
        if self.ready:
            raise RuntimeError("a staged weight version has not been swapped in yet")
        t0 = time.monotonic()
        if self.stream is None:
            self._stage(ckpt)
        else:
            with torch.cuda.stream(self.stream):
                if self._swapped is not None:
                    self.stream.wait_event(self._swapped)  # the last swap has read the staging copy
                try:
                    self._stage(ckpt)
                finally:
                    self.stream.synchronize()
        self.ready = True
        return time.monotonic() - t0

    def _stage(self, ckpt: Checkpoint) -> None:
        try:
            self._load(self.model, ckpt)
        except BaseException:
            # A load may stop part way (a shape found wrong while writing): the staging copy
            # goes back to the live weights, so the next version starts from equal buffers.
            torch._foreach_copy_(self._staged, self._live)
            raise

    @torch.no_grad()
    def swap(self) -> None:
        """The staged version goes live: one device-to-device copy per weight storage, queued on
        the loop's stream after the staging stream's work (and before the next step's forward)."""
        if not self.ready:
            raise RuntimeError("no staged weight version to swap in")
        self.ready = False
        if self.stream is None:
            torch._foreach_copy_(self._live, self._staged)
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        torch._foreach_copy_(self._live, self._staged)
        done = torch.cuda.Event()
        done.record(current)
        self._swapped = done
