"""Programmatic Dependent Launch (PDL): the one place that decides whether a kernel launch uses it.

On Hopper (compute capability 9+) a kernel launched with the programmatic-stream-serialization
attribute (Triton: `launch_pdl=True`) may start while the kernel before it on the stream is still
running, once every program of that kernel has executed `griddepcontrol.launch_dependents` (or
exited). It runs its independent prologue (index math, loading weights nothing in the forward
writes), then `griddepcontrol.wait` (`tl.extra.cuda.gdc_wait()`), which returns when the previous
grid has completed and its writes are visible. A batch-1 decode step is ~280 small kernels whose
time is mostly launch latency, ramp-up and tail, so hiding each launch behind the previous
kernel's tail is what this buys (docs/engine.md, "Programmatic dependent launch").

The hazard rule every kernel that takes `USE_GDC` follows: gdc_wait before the first global load
of anything an earlier kernel may write (activations, the KV pool, sampler partials) and before the
first global store (a CUDA graph reuses buffers: the previous kernel may still read what this one
overwrites), on every path of every program (a program that returns early waits first: the next
kernel's wait covers only this grid, so this grid must not finish before the one before it).
Loaded before the wait only: weights and the step metadata the host copies in before the forward
(slots, context lengths, query rows, partitions, block lists). Both are written only by work that
completes before the forward's first kernel (a torch op, launched normally) starts, and a PDL
kernel never starts before the kernel ahead of it has started, so none of those reads can race.

Off on CPU, under TRITON_INTERPRET (the interpreter has no grids to overlap), on GPUs below
capability 9 and with a Triton without the GDC intrinsics. The engine resolves
`EngineConfig.pdl` once (`resolve`) and `CausalLM.forward` / the fused sampler enter `scope`;
every launcher in services/engine/kernels/ asks `launch(tensor)` for its `launch_pdl` and
`USE_GDC` values. This module imports neither Triton nor CUDA state at import time (the CPU path
imports it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# Whether launches on this thread (the engine's stepping thread) use PDL: a context variable, so
# two engines in one process (one with PDL and one without) and the eager launches of each keep
# their own setting.
_ACTIVE: ContextVar[bool] = ContextVar("relay_pdl_active", default=False)
_CAPABLE: dict[int | None, bool] = {}  # device index -> capability >= 9 and GDC available


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1): read at every launch, as Triton does."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_has_gdc() -> bool:
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    return hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")


def usable(device: torch.device) -> bool:
    """True if kernels on `device` can be launched with PDL here: a CUDA device of compute
    capability >= 9 (Hopper), compiled kernels (not the interpreter), a Triton with GDC. Cached
    per device (every launch asks)."""
    if device.type != "cuda" or interpreting():
        return False
    ok = _CAPABLE.get(device.index)
    if ok is None:
        ok = torch.cuda.is_available() and _triton_has_gdc()
        if ok:
            idx = device.index if device.index is not None else torch.cuda.current_device()
            ok = torch.cuda.get_device_capability(idx)[0] >= 9
        _CAPABLE[device.index] = ok
    return ok


def resolve(want: bool, device: torch.device) -> bool:
    """EngineConfig.pdl as it applies on `device`: off wherever `usable` says no."""
    return want and usable(device)


@contextmanager
def scope(on: bool) -> Iterator[None]:
    """Kernel launches inside use PDL if `on` (and `usable`); restores the previous setting."""
    token = _ACTIVE.set(on)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """The current scope's setting (False outside any scope)."""
    return _ACTIVE.get()


def launch(x: torch.Tensor) -> bool:
    """For a launcher whose kernel runs on x's device: its `launch_pdl` and `USE_GDC` (always the
    same value: a kernel launched with PDL that does not wait races with the one before it)."""
    return _ACTIVE.get() and usable(x.device)


__all__ = ["active", "interpreting", "launch", "resolve", "scope", "usable"]
