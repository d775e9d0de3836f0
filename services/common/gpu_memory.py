"""A process's share of its GPU's memory, for services that share one device (decode and the
trainer on one GPU: decode.engine.cuda_memory_gib, trainer.cuda_memory_gib).

The cap is torch's per-process fraction of the device: the caching allocator refuses to hold more
(the allocation fails as out of memory, naming the cap) instead of taking memory the other process
was promised. What the allocator does not manage is outside it: the CUDA context (~0.5 GiB per
process) and library workspaces allocated before the cap is set.
"""

from __future__ import annotations

from typing import Any

import torch

GIB = 1 << 30


def cap_process_memory(device: torch.device, gib: float | None) -> dict[str, Any]:
    """Limit this process's allocator on `device` to `gib` GiB (None, or a CPU device: nothing).
    Returns what was set, for the service's start-up log."""
    if gib is None or device.type != "cuda":
        return {}
    if device.index is None:  # torch's fraction setter wants an index: "cuda" means the current one
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return {"cuda_memory_gib": gib, "device_gib": round(total / GIB, 2), "fraction": round(fraction, 4)}


def memory_held(device: torch.device) -> dict[str, float]:
    """This process's allocator on `device` now and at its peak, in GiB ({} on a CPU device)."""
    if device.type != "cuda":
        return {}
    return {
        "cuda_allocated_gib": round(torch.cuda.memory_allocated(device) / GIB, 3),
        "cuda_reserved_gib": round(torch.cuda.memory_reserved(device) / GIB, 3),
        "cuda_peak_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 3),
    }
