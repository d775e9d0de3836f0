"""CUDA graphs for decode-only steps, one per batch size of a ladder.

A decode step of a small model is hundreds of small kernels (28 layers x ~12); launched one by
one from Python that costs more than the GPU work at small batches. The model forward of a
decode-only step is captured once per ladder size (1, 2, 4, 8, 16, 32, then every 32 up to the
largest batch) and replayed: a batch of n sequences runs the graph of the next ladder size >= n,
its extra rows being padding (slot -1: nothing stored; context 0: nothing read; output dropped).
Prefill and mixed steps, and batches above the largest size, run eagerly.

Inputs live in static device buffers the graphs were captured on (one int64 buffer: token ids,
positions, slots, context lengths, block tables, the decode partition) and are refreshed from a
pinned host mirror with one copy per step. Each size's decode split count is fixed at capture
(sized for max_seq_len); the keys per split follow the step's longest context, so a short batch
still spreads over all splits. The logits projection and the sampler stay outside the graph: the sampler
draws from per-request host RNGs and must stay exact about log-probs.

Weights are updated in place (CausalLM.load_hf_state), so captured graphs stay valid across
weight versions; the KV pool is allocated once, so its addresses never change either.
"""

from __future__ import annotations

import bisect

import torch

from services.engine.batch import (
    DECODE_BLOCK_N,
    DecodeMeta,
    ForwardBatch,
    HostBatch,
    PagedMeta,
    decode_splits,
    split_partition,
)
from services.engine.kv_cache import KVCache
from services.engine.model import CausalLM
from services.engine.overlap import Feed, feed_pending


def ladder(max_batch: int) -> list[int]:
    """Captured batch sizes: powers of two up to 32, then multiples of 32 (padding waste stays
    under ~1/3 at small sizes and under 32 rows above), always ending at max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4, 8, 16) if s < max_batch]
    sizes += list(range(32, max_batch, 32))
    return [*sizes, max_batch]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest ladder size >= n, or None if n is larger than every captured size."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class InputBuffers:
    """Static inputs for the largest size; smaller graphs use leading slices. Host side pinned:
    the H2D copy is asynchronous; the next fill waits for it (an event) before rewriting the host
    mirror, which with overlap scheduling can come before the previous step's tokens are read."""

    def __init__(self, max_batch: int, width: int, device: torch.device):
        self.max_batch, self.width = max_batch, width
        b = max_batch
        n = 4 * b + b * width + 1
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        h = self.host.numpy()
        self.h_ids, self.h_pos, self.h_slots, self.h_ctx = (h[i * b : (i + 1) * b] for i in range(4))
        self.h_tables = h[4 * b : -1].reshape(b, width)
        self.h_partition = h[-1:]
        d = self.dev
        self.ids, self.pos, self.slots, self.ctx = (d[i * b : (i + 1) * b] for i in range(4))
        self.tables = d[4 * b : -1].view(b, width)
        self.partition = d[-1:]
        self.h_slots[:] = -1  # every row starts as padding
        self.h_partition[0] = DECODE_BLOCK_N
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def fill(self, hb: HostBatch, size: int, partition: int) -> None:
        """Rows [0, n) from the batch, rows [n, size) padding; then one copy to the device."""
        n, p = len(hb.ids), hb.tables.shape[1]
        if p > self.width:
            raise ValueError(f"block table of {p} pages exceeds the captured width {self.width}")
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has read the host mirror (normally long ago)
        self.h_ids[:n], self.h_pos[:n], self.h_slots[:n], self.h_ctx[:n] = (
            hb.ids,
            hb.positions,
            hb.slots,
            hb.ctx_lens,
        )
        self.h_tables[:n, :p] = hb.tables  # columns past p are stale but never read (ctx bounds)
        self.h_ids[n:size] = 0
        self.h_pos[n:size] = 0
        self.h_slots[n:size] = -1
        self.h_ctx[n:size] = 0
        self.h_partition[0] = partition
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        max_batch: int,
        num_sms: int,
        device: torch.device,
    ):
        self.model, self.kv, self.device = model, kv, device
        self.sizes = ladder(max_batch)
        self.width = -(-kv.max_seq_len // kv.block_size)
        self.n_kv_heads = model.config.n_kv_heads
        self.num_sms = num_sms
        self.buf = InputBuffers(self.sizes[-1], self.width, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Decode splits per size: sized for the longest context, the partition follows each step's.
        self.splits = {
            size: decode_splits(size, self.n_kv_heads, kv.max_seq_len, num_sms)[0] for size in self.sizes
        }
        self.outputs: dict[int, torch.Tensor] = {}
        self.arange = torch.arange(self.sizes[-1], device=device)

    def static_batch(self, size: int) -> ForwardBatch:
        b = self.buf
        decode = DecodeMeta(self.arange[:size], b.tables[:size], b.ctx[:size], self.splits[size], b.partition)
        return ForwardBatch(
            b.ids[:size], b.pos[:size], b.slots[:size], [], self.arange[:size], PagedMeta(decode, None)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all in one memory pool (a smaller graph reuses the larger one's blocks).
        The buffers hold padding only (slot -1, context 0), so capture neither reads nor writes KV."""
        self.buf.dev.copy_(self.buf.host)
        pool = None
        for size in reversed(self.sizes):
            batch = self.static_batch(size)
            # Warm up outside the graph: Triton compiles, cuBLAS picks its kernels and workspaces.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.model(batch, self.kv)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(batch, self.kv)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, hb: HostBatch) -> bool:
        return hb.decode_only and len(hb.ids) <= self.sizes[-1]

    def run(self, hb: HostBatch, feed: Feed | None = None) -> torch.Tensor:
        """Final hidden states [n, dim] of a decode-only batch (row i: span i). `feed`: rows whose
        token is still on the device (overlap scheduling), written into the input buffer first."""
        n = len(hb.ids)
        size = padded_size(n, self.sizes)
        assert size is not None and hb.decode_only
        self.buf.fill(hb, size, split_partition(int(hb.ctx_lens.max()), self.splits[size]))
        feed_pending(self.buf.ids, feed)
        self.graphs[size].replay()
        return self.outputs[size][:n]


__all__ = ["DecodeGraphs", "InputBuffers", "ladder", "padded_size"]
