"""Weight bytes from host memory (memory-mapped weight files) into device parameters, fast.

A plain `param.copy_(host_tensor)` from pageable memory runs the driver's own staging copy on one
thread, page faults included. `copy_weight` stages large tensors through a small ring of pinned
buffers instead: several threads fill a slot from the map while the DMA of the previous slot
runs, on the current stream (later kernels are ordered after it; a slot is reused only once its
DMA is done). Anything else (CPU engines, small tensors, dtype casts) is a plain copy.

`copy_pieces` fills one destination from many host tensors laid end to end (a layer's experts:
128 tensors of 1.5-3 MB each in Qwen3-30B-A3B): the pieces are packed into the same ring, so a
layer's projection costs a few 64 MB transfers instead of one staged copy per expert; on a CPU
engine it is one `torch.cat` into the destination.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
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

    def _send(self, d: torch.Tensor, off: int, k: int, fill: Callable[[torch.Tensor], None]) -> None:
        """d[off : off + k] <- the bytes `fill` writes into the next slot."""
        i = self.next
        self.next = (i + 1) % len(self.slots)
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()  # its previous DMA has read the slot
        slot = self.slots[i]
        fill(slot)
        d[off : off + k].copy_(slot[:k], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.events[i] = ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (CUDA, contiguous) <- src (CPU, same dtype and element count)."""
        d = dst.view(-1).view(torch.uint8)
        s = src.contiguous().view(-1).view(torch.uint8)
        for off in range(0, s.numel(), self.slot_bytes):
            k = min(self.slot_bytes, s.numel() - off)
            self._send(d, off, k, lambda slot, off=off, k=k: self._fill(slot, s[off : off + k]))

    def copy_pieces(self, dst: torch.Tensor, pieces: list[torch.Tensor]) -> None:
        """dst (CUDA, contiguous) <- the pieces' bytes end to end (CPU, dst's dtype; their sizes
        sum to dst's): each slot packed with as many pieces (or parts of one) as it holds."""
        d = dst.view(-1).view(torch.uint8)
        flat = [p.contiguous().view(-1).view(torch.uint8) for p in pieces]
        for off, k, parts in slot_plan(flat, self.slot_bytes):
            self._send(d, off, k, lambda slot, parts=parts: pack(slot, parts, self.pool, self.threads))


Part = tuple[int, torch.Tensor]  # (byte offset in a slot, the bytes to put there)


def slot_plan(flat: list[torch.Tensor], slot_bytes: int) -> Iterator[tuple[int, int, list[Part]]]:
    """Byte tensors laid end to end, cut into slots: (offset in the destination, bytes, parts)
    per slot, every slot full but the last; a piece larger than what a slot has left spans slots."""
    parts: list[Part] = []
    start = used = 0  # the slot's first byte in the destination; its bytes so far
    for src in flat:
        a = 0
        while a < src.numel():
            k = min(slot_bytes - used, src.numel() - a)
            parts.append((used, src[a : a + k]))
            used, a = used + k, a + k
            if used == slot_bytes:
                yield start, used, parts
                parts, start, used = [], start + used, 0
    if used:
        yield start, used, parts


def pack(slot: torch.Tensor, parts: list[Part], pool: ThreadPoolExecutor, threads: int) -> None:
    """slot[at : at + len(src)] <- src for each part. Over the pool's threads in jobs of about an
    even share of the slot (torch releases the GIL inside copy_), each job one part's piece or
    several small parts: a layer's 256 scale tensors of 384 bytes are a few jobs, not 256."""
    grain = max(1 << 20, -(-sum(src.numel() for _, src in parts) // threads))
    jobs: list[list[Part]] = [[]]
    size = 0
    for at, src in parts:
        for a in range(0, src.numel(), grain):
            piece = src[a : a + grain]
            if size and size + piece.numel() > grain:
                jobs.append([])
                size = 0
            jobs[-1].append((at + a, piece))
            size += piece.numel()

    def run(job: list[Part]) -> None:
        for at, src in job:
            slot[at : at + src.numel()].copy_(src)

    if len(jobs) == 1:
        run(jobs[0])
    else:
        list(pool.map(run, jobs))


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


@torch.no_grad()
def copy_pieces(dst: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
    """dst <- the pieces laid end to end in row-major order (e.g. dst [E, N, K] from E tensors
    [N, K]): one packed staging pass on CUDA, one concatenation on the CPU. Pieces of another
    dtype than dst's are cast piece by piece. Raises ValueError unless their sizes sum to dst's."""
    if sum(p.numel() for p in pieces) != dst.numel():
        raise ValueError(
            f"{len(pieces)} pieces of {sum(p.numel() for p in pieces)} elements != {dst.numel()}"
        )
    if not dst.is_contiguous():
        raise ValueError("copy_pieces: the destination must be contiguous")
    if any(p.dtype != dst.dtype or p.device.type != "cpu" for p in pieces):
        copy_each(dst, pieces)
    elif dst.device.type == "cuda":
        uploader(dst.device).copy_pieces(dst, list(pieces))
    else:
        torch.cat([p.reshape(-1) for p in pieces], out=dst.view(-1))


@torch.no_grad()
def copy_each(dst: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
    """What copy_pieces does, one `copy_weight` per piece into its part of dst (contiguous): for
    pieces it must cast (one copy per piece, so a copy per expert tensor)."""
    flat, off = dst.view(-1), 0
    for p in pieces:
        copy_weight(flat[off : off + p.numel()], p.reshape(-1))
        off += p.numel()
