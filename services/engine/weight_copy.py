"""Weight bytes from host memory (memory-mapped weight files) into device parameters, fast.

A plain `param.copy_(host_tensor)` from pageable memory runs the driver's own staging copy on one
thread, page faults included. `copy_weight` stages large tensors through a small ring of pinned
buffers instead: several threads fill a slot from the map while the DMA of the previous slot
runs, on the current stream (later kernels are ordered after it; a slot is reused only once its
DMA is done). Anything else (CPU engines, small tensors, dtype casts) is a plain copy.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

SLOT_BYTES = 64 << 20
SLOTS = 3
THREADS = 4
SMALL_BYTES = 1 << 20  # below this a plain copy costs less than the staging's bookkeeping


class Uploader:
    """The pinned ring and the copy threads of one CUDA device."""

    def __init__(
        self, device: torch.device, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS, threads: int = THREADS
    ):
        self.device = device
        self.slot_bytes = slot_bytes
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="weight-copy")

    def _fill(self, slot: torch.Tensor, src: torch.Tensor) -> None:
        n = src.numel()
        part = -(-n // self.threads)
        parts = [(a, min(n, a + part)) for a in range(0, n, part)]
        # torch releases the GIL inside copy_: the threads fault in and copy their parts at once.
        list(self.pool.map(lambda ab: slot[ab[0] : ab[1]].copy_(src[ab[0] : ab[1]]), parts))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (CUDA, contiguous) <- src (CPU, same dtype and element count)."""
        d = dst.view(-1).view(torch.uint8)
        s = src.contiguous().view(-1).view(torch.uint8)
        for off in range(0, s.numel(), self.slot_bytes):
            k = min(self.slot_bytes, s.numel() - off)
            i = self.next
            self.next = (i + 1) % len(self.slots)
            ev = self.events[i]
            if ev is not None:
                ev.synchronize()  # its previous DMA has read the slot
            slot = self.slots[i]
            self._fill(slot, s[off : off + k])
            d[off : off + k].copy_(slot[:k], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.events[i] = ev


_uploaders: dict[torch.device, Uploader] = {}
_lock = threading.Lock()


def uploader(device: torch.device) -> Uploader:
    with _lock:
        up = _uploaders.get(device)
        if up is None:
            up = _uploaders[device] = Uploader(device)
        return up


@torch.no_grad()
def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a weight (shapes already checked), staged when src is a large host
    tensor and dst a CUDA one of the same dtype."""
    if (
        dst.device.type != "cuda"
        or src.device.type != "cpu"
        or src.dtype != dst.dtype
        or not dst.is_contiguous()
        or src.numel() * src.element_size() < SMALL_BYTES
    ):
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))
        return
    uploader(dst.device).copy(dst, src)
