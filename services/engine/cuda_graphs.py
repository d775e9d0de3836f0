"""CUDA graphs for decode-only steps, one per batch size of a ladder.

A decode step of a small model is hundreds of small kernels (28 layers x ~12); launched one by
one from Python that costs more than the GPU work at small batches. The model forward of a
decode-only step is captured once per ladder size (1, 2, 4, 8, 16, 32, then every 32 up to the
largest batch) and replayed: a batch of n sequences runs the graph of the next ladder size >= n,
its extra rows being padding (slot -1: nothing stored; context 0: nothing read; output dropped).
Batches above the largest size run eagerly. Steps that carry prefill tokens run MixedGraphs
(below): one graph per token count of a ladder, the decode graphs' memory pool shared.

Inputs live in static device buffers the graphs were captured on (one int64 buffer: token ids,
positions, slots, context lengths, block tables, the decode work list, each row's temperature,
sampling seed and pending-token source) and are refreshed from a pinned host mirror with one copy
per step. Each size has two graphs: one program per row (batch.plan_decode says None), and the
ragged work list (batch.DecodeWork) with a fixed grid of item_capacity(size) items, unused ones
-1; the step's plan fills it.

A decode graph is the whole step on the device (docs/engine.md, "The decode step on the device"):
pending tokens of the step in flight fed in (kernels/feed.py), the forward, the logits, and, with
`sample_in_graph` (the engine's fused sampler), kernels/sampling.py over every row into the static
token / log-prob buffer, read back with one copy into one of two pinned host buffers. At batch 1
the step's host work is then a handful of calls instead of ~30 launches and copies. A step that
cannot sample that way (top-k/top-p/min-p rows, top-n log-probs, forks) samples the graph's static
logits with the torch sampler; the graph's own draws are then ignored (no host RNG was drawn for
them, so no request's random stream moves).

Weights are updated in place (CausalLM.load_hf_state), so captured graphs stay valid across
weight versions; the KV pool is allocated once, so its addresses never change either.

A hybrid model (nemotron_h) also carries its Mamba-2 states (state_cache.py) through the graph:
each row's state slot is one more static buffer, its Mamba-2 layers gather those slots' states and
write the new ones back in place (the pool is allocated once too), and padding rows name the
cache's padding slot, so they touch no sequence's state. Slots of sequences whose first token
this step feeds are zeroed before the replay, outside the graph. Mixed steps of a hybrid model run
eagerly: a prompt chunk's chunked scan runs span by span.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import fields

import numpy as np
import torch

from services.engine.batch import (
    DecodeMeta,
    DecodePlan,
    DecodeWork,
    ForwardBatch,
    HostBatch,
    PagedMeta,
    PrefillMeta,
    StateMeta,
    capped,
    decode_layout,
    host_to_device,
    item_capacity,
    plan_decode,
)
from services.engine.kv_cache import KVCache
from services.engine.layers.sampler import PendingSample
from services.engine.models.causal_lm import CausalLM
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


class WorkBuffers:
    """The decode work list's slots in a graph's int64 buffers (host mirror and device): the
    DecodeWork arrays for `capacity` items and `rows` rows."""

    # DecodeWork's fields: per item, then per row.
    ITEM = tuple(f.name for f in fields(DecodeWork) if f.name.startswith("item_"))
    ROW = tuple(f.name for f in fields(DecodeWork) if f.name.startswith("row_"))

    def __init__(self, h: dict[str, np.ndarray], d: dict[str, torch.Tensor]):
        self.h, self.d = h, d
        h["item_row"][:] = -1

    @classmethod
    def sizes(cls, rows: int, capacity: int) -> dict[str, int]:
        return {**dict.fromkeys(cls.ITEM, capacity), **dict.fromkeys(cls.ROW, rows)}

    def work(self, rows: int, capacity: int) -> DecodeWork:
        d = self.d
        return DecodeWork(*(d[k][:capacity] for k in self.ITEM), *(d[k][:rows] for k in self.ROW))

    def fill(self, plan: DecodePlan | None, capacity: int) -> None:
        """The plan's items, then unused ones (row -1) up to this graph's capacity, and rows past
        the plan's with no items (no plan: nothing to write, the graph reads none of it)."""
        if plan is None:
            return
        h, n, b = self.h, len(plan.item_row), len(plan.row_first)
        assert n <= capacity, (n, capacity)
        for name, values in zip(self.ITEM + self.ROW, plan.arrays(), strict=True):
            h[name][: len(values)] = values
        h["item_row"][n:capacity] = -1
        h["row_items"][b:] = 0


def carve(
    parts: dict[str, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """One pinned int64 host mirror and its device buffer, cut into named consecutive slices."""
    n = sum(parts.values())
    host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
    dev = torch.zeros(n, dtype=torch.int64, device=device)
    h: dict[str, np.ndarray] = {}
    d: dict[str, torch.Tensor] = {}
    at = 0
    hnp = host.numpy()
    for name, size in parts.items():
        h[name], d[name] = hnp[at : at + size], dev[at : at + size]
        at += size
    return host, dev, h, d


class InputBuffers:
    """Static inputs for the largest size; smaller graphs use leading slices. Host side pinned:
    the H2D copy is asynchronous; the next fill waits for it (an event) before rewriting the host
    mirror, which with overlap scheduling can come before the previous step's tokens are read."""

    def __init__(self, max_batch: int, width: int, capacity: int, device: torch.device, pad_state: int = -1):
        """pad_state: the state slot of padding rows (a hybrid model's StateCache.pad_slot)."""
        self.max_batch, self.width, self.pad_state = max_batch, width, pad_state
        b = max_batch
        parts = {
            "ids": b,
            "pos": b,
            "slots": b,
            "ctx": b,
            "tables": b * width,
            "temps": b,  # float32 in the first half of these int64 slots (host and device alike)
            "seeds": b,
            "feed": b,  # the row of the in-flight step's tokens to take, or -1: the host's id
            "state": b,  # each row's Mamba-2 state slot (a hybrid model's; padding: pad_state)
            **WorkBuffers.sizes(b, capacity),
        }
        self.host, self.dev, h, d = carve(parts, device)
        self.h_ids, self.h_pos, self.h_slots, self.h_ctx = h["ids"], h["pos"], h["slots"], h["ctx"]
        self.h_tables = h["tables"].reshape(b, width)
        self.h_temps, self.h_seeds, self.h_feed = h["temps"].view(np.float32)[:b], h["seeds"], h["feed"]
        self.ids, self.pos, self.slots, self.ctx = d["ids"], d["pos"], d["slots"], d["ctx"]
        self.tables = d["tables"].view(b, width)
        self.temps, self.seeds, self.feed = d["temps"].view(torch.float32)[:b], d["seeds"], d["feed"]
        self.h_state, self.state = h["state"], d["state"]
        self.work = WorkBuffers(h, d)
        self.h_slots[:] = -1  # every row starts as padding
        self.h_feed[:] = -1
        self.h_state[:] = pad_state
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def fill(
        self,
        hb: HostBatch,
        size: int,
        plan: DecodePlan | None,
        capacity: int,
        sample: tuple[list[float], list[int]] | None = None,
        feed: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """Rows [0, n) from the batch, rows [n, size) padding, the work list, the rows'
        (temperatures, seeds) if the graph's sampling is used (padding rows greedy), the
        (rows, source rows) of pending tokens the graph feeds itself; then one copy to the device."""
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
        if hb.state_slots is not None:
            self.h_state[:n] = hb.state_slots
        self.h_state[n:size] = self.pad_state
        if sample is not None:
            self.h_temps[:n], self.h_seeds[:n] = sample
            self.h_temps[n:size] = 0.0
        self.h_feed[:size] = -1
        if feed is not None:
            self.h_feed[feed[0]] = feed[1]
        self.work.fill(plan, capacity)
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


def capture(
    body: Callable[[], torch.Tensor], device: torch.device, pool: object | None
) -> tuple[torch.Tensor, torch.cuda.CUDAGraph, object]:
    """`body` (a step's device work on static buffers) captured as a graph in `pool`: (its
    output, the graph, the pool)."""
    # Warm up outside the graph: Triton compiles, cuBLAS picks its kernels and workspaces.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return out, graph, graph.pool()


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        max_batch: int,
        num_sms: int,
        device: torch.device,
        sample_in_graph: bool = False,
        pdl: bool = False,
    ):
        """sample_in_graph: the graphs end with the fused sampler (kernels/sampling.py) over every
        row; the engine sets it where its own sampler is the fused one. pdl: the sampler's launches
        use PDL (the forward's follow CausalLM's own setting)."""
        self.model, self.kv, self.device = model, kv, device
        self.sizes = ladder(max_batch)
        self.width = -(-kv.max_seq_len // kv.block_size)
        # Programs per work item and keys-per-row cap of the model's decode kernel (GQA or MLA).
        self.n_kv_heads, self.key_cap = decode_layout(model.config)
        self.num_sms = num_sms
        self.sample_in_graph, self.pdl = sample_in_graph, pdl
        self.capacity = {size: item_capacity(size, self.n_kv_heads, num_sms) for size in self.sizes}
        b = self.sizes[-1]
        states = kv.states
        self.buf = InputBuffers(
            b, self.width, self.capacity[b], device, -1 if states is None else states.pad_slot
        )
        # Keyed (size, ragged): one program per row, or the ragged work list (module docstring).
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}  # each graph's logits [size, vocab]
        self.arange = torch.arange(b, device=device)
        # The sampled tokens (row 0) and their float32 log-probs (row 1's first half), shared by
        # every size: a graph feeds pending tokens from here, then overwrites it. One D2H copy a
        # step into one of two pinned buffers: the host reads step N's while N+1's copy is queued.
        self.result = torch.zeros(2, b, dtype=torch.int64, device=device)
        self.tokens, self.logprobs = self.result[0], self.result[1].view(torch.float32)[:b]
        pinned = device.type == "cuda"
        self.result_host = [torch.zeros(2, b, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.result_ready = [torch.cuda.Event() for _ in range(2)] if pinned else [None, None]
        self._parity = 0
        self.pool: object | None = None  # the graphs' memory pool, once captured
        self.last_key: tuple[int, bool] | None = None  # the graph the last step replayed (benches)

    def static_batch(self, size: int, ragged: bool) -> ForwardBatch:
        b = self.buf
        work = b.work.work(size, self.capacity[size]) if ragged else None
        decode = DecodeMeta(self.arange[:size], b.tables[:size], b.ctx[:size], work)
        state = None
        if self.kv.states is not None:  # every row a one-token span on its static slot
            state = StateMeta(self.arange[:0], self.arange[:size], b.state[:size], [])
        # padded: the ragged work list covers only the real rows, so the padding rows' attention
        # output is zeros rather than uninitialised memory (NaN there reaches an MoE router or FP8
        # activation scales, and a hybrid model's padding state slot).
        paged = PagedMeta(decode, None, padded=True)
        return ForwardBatch(b.ids[:size], b.pos[:size], b.slots[:size], [], self.arange[:size], paged, state)

    def body(self, size: int, ragged: bool) -> torch.Tensor:
        """The device work of a decode step of `size` rows on the static buffers (what a graph
        captures; CPU tests run it eagerly): the logits [size, vocab]."""
        from ops.pdl import scope as pdl_scope

        b = self.buf
        if self.sample_in_graph:
            from services.engine.kernels.feed import feed_tokens
            from services.engine.kernels.sampling import fused_sample

            feed_tokens(b.ids[:size], b.feed[:size], self.tokens)
        logits = self.model.logits(self.model(self.static_batch(size, ragged), self.kv))
        if self.sample_in_graph:
            with pdl_scope(self.pdl):
                fused_sample(
                    logits, b.temps[:size], b.seeds[:size], out=(self.tokens[:size], self.logprobs[:size])
                )
        return logits

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all in one memory pool (a smaller graph reuses the larger one's blocks).
        The buffers hold padding only (slot -1, context 0, no items, no feed), so capture neither
        reads nor writes KV."""
        self.buf.dev.copy_(self.buf.host)
        pool = None
        for key in sorted(((size, ragged) for size in self.sizes for ragged in (False, True)), reverse=True):
            self.outputs[key], self.graphs[key], pool = capture(
                lambda key=key: self.body(*key), self.device, pool
            )
        self.pool = pool
        torch.cuda.synchronize(self.device)

    def can_run(self, hb: HostBatch) -> bool:
        return hb.decode_only and len(hb.ids) <= self.sizes[-1]

    def feeds_itself(self, feed: Feed | None) -> bool:
        """True if `feed`'s tokens are this graphs' token buffer (the step in flight sampled in a
        graph): the next graph then reads them itself."""
        return (
            self.sample_in_graph
            and feed is not None
            and feed.tokens.device == self.tokens.device
            and feed.tokens.data_ptr() == self.tokens.data_ptr()
        )

    def run(
        self, hb: HostBatch, feed: Feed | None = None, sample: tuple[list[float], list[int]] | None = None
    ) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only batch (row i: span i). `feed`: rows whose token is
        still on the device (overlap scheduling). `sample`: the rows' (temperatures, seeds) for
        the graph's own sampling (sample_in_graph; read it with `pending`), else None."""
        n = len(hb.ids)
        size = padded_size(n, self.sizes)
        assert size is not None and hb.decode_only
        assert sample is None or self.sample_in_graph
        n_rows = len(hb.ctx_lens)
        plan = plan_decode(
            capped(hb.ctx_lens, self.key_cap), np.arange(n_rows), self.n_kv_heads, self.num_sms
        )
        inside = self.feeds_itself(feed)
        self.buf.fill(
            hb, size, plan, self.capacity[size], sample, (feed.dst, feed.src) if inside and feed else None
        )
        if not inside:
            feed_pending(self.buf.ids, feed)
        self.reset_fresh_states(hb)
        key = self.last_key = (size, plan is not None)
        graph = self.graphs.get(key)
        if graph is None:  # never captured (CPU tests): the same work, eagerly
            return self.body(*key)[:n]
        graph.replay()
        return self.outputs[key][:n]

    def reset_fresh_states(self, hb: HostBatch) -> None:
        """Zero the state slots of rows at position 0 (a one-token prompt's first step): the
        graph's Mamba-2 layers continue every row's state."""
        states = self.kv.states
        if states is None or hb.state_slots is None:
            return
        fresh = hb.state_slots[hb.positions == 0]
        if len(fresh):
            states.reset(host_to_device(torch.from_numpy(fresh), self.device))

    def pending(self, n: int) -> PendingSample:
        """The tokens the last replay sampled for its first n rows, on their way to the host."""
        self._parity ^= 1
        host, ready = self.result_host[self._parity], self.result_ready[self._parity]
        host.copy_(self.result, non_blocking=True)
        if ready is not None:
            ready.record()
        return PendingSample(
            self.tokens[:n],
            self.logprobs[:n],
            None,
            n,
            ready,
            (host[0, :n], host[1].view(torch.float32)[:n]),
        )


def token_ladder(max_tokens: int, smallest: int = 64) -> list[int]:
    """Captured token counts of mixed steps: powers of two from `smallest` and the midpoints 1.5x
    between them, ending at max_tokens (a step's token budget). Padding costs at most half the
    step's own size, in GEMM rows only (attention and the KV writes skip padding rows): with
    powers of two alone a 2,112-token step ran the 4,096 graph, 11.9 ms against 9.7 ms eager on
    an idle H200 host."""
    sizes = []
    size = smallest
    while size < max_tokens:
        sizes.append(size)
        if size * 3 // 2 < max_tokens and size >= 2 * smallest:
            sizes.append(size * 3 // 2)
        size *= 2
    return [*sizes, max_tokens]


class MixedBuffers:
    """Static inputs of mixed steps (decodes + prefill chunks) for the largest token count, and
    the fixed-shape batch each token count's graph runs on. Device-agnostic (CPU tests run the
    static batches eagerly under the Triton interpreter); one pinned host mirror, one copy a step.

    A size-T batch has T token rows (real ones first, then padding: slot -1, so nothing is stored),
    up to min(T, max_decode) decode rows (padding: query row -1 and context 0: nothing read or
    written) and `max_prefill` prefill spans whose query blocks the prefill kernel takes from a
    block list (kernels/paged_attention.py, BLOCK_MAP) sized T / BLOCK_M + max_prefill, enough
    for any split of T tokens over that many spans."""

    def __init__(
        self,
        sizes: list[int],
        max_decode: int,
        max_prefill: int,
        width: int,
        block_m: int,
        n_kv_heads: int,
        num_sms: int,
        device: torch.device,
    ):
        self.sizes, self.max_decode, self.max_prefill = sizes, max_decode, max_prefill
        self.width, self.block_m = width, block_m
        self.n_kv_heads, self.num_sms = n_kv_heads, num_sms
        t, d, p = sizes[-1], self.decode_rows(sizes[-1]), max_prefill
        nb = self.num_blocks(t)
        parts = {
            "ids": t, "pos": t, "slots": t, "last": d + p,
            "dec_qloc": d, "dec_ctx": d, "dec_tables": d * width,
            "pre_qstart": p, "pre_qlens": p, "pre_ctx": p, "pre_tables": p * width,
            "blocks": 2 * nb, **WorkBuffers.sizes(d, self.capacity(t)),
        }  # fmt: skip
        self.host, self.dev, self.h, self.d = carve(parts, device)
        for name, rows in (("dec_tables", d), ("pre_tables", p), ("blocks", 2)):
            self.h[name] = self.h[name].reshape(rows, -1)
            self.d[name] = self.d[name].view(rows, -1)
        self.work = WorkBuffers(self.h, self.d)
        self.h["slots"][:] = -1
        self.h["dec_qloc"][:] = -1
        self.h["blocks"][0] = -1
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def capacity(self, size: int) -> int:
        """The decode work list's items in the size-`size` graph."""
        return item_capacity(self.decode_rows(size), self.n_kv_heads, self.num_sms)

    def decode_rows(self, size: int) -> int:
        return min(size, self.max_decode)

    def num_blocks(self, size: int) -> int:
        return size // self.block_m + self.max_prefill

    def fits(self, hb: HostBatch) -> int | None:
        """The token count whose graph can run this batch, or None."""
        t = len(hb.ids)
        size = padded_size(t, self.sizes)
        if size is None or hb.tables.shape[1] > self.width:
            return None
        n_pre = int((hb.q_lens > 1).sum())
        if n_pre > self.max_prefill or len(hb.q_lens) - n_pre > self.decode_rows(size):
            return None
        return size

    def static_batch(self, size: int, ragged: bool) -> ForwardBatch:
        d, nd = self.d, self.decode_rows(size)
        work = self.work.work(nd, self.capacity(size)) if ragged else None
        decode = DecodeMeta(d["dec_qloc"][:nd], d["dec_tables"][:nd], d["dec_ctx"][:nd], work)
        prefill = PrefillMeta(
            d["pre_qstart"],
            d["pre_qlens"],
            d["pre_tables"],
            d["pre_ctx"],
            0,
            d["blocks"][:, : self.num_blocks(size)],
        )
        return ForwardBatch(
            d["ids"][:size], d["pos"][:size], d["slots"][:size], [], d["last"],
            PagedMeta(decode, prefill, padded=True),
        )  # fmt: skip

    def fill(self, hb: HostBatch, size: int, plan: DecodePlan | None) -> torch.Tensor:
        """Write the batch and the decode rows' work list into the host mirror (padding past
        them), copy it to the device; returns the device row of each span's last token."""
        h = self.h
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has read the host mirror
        t, p = len(hb.ids), hb.tables.shape[1]
        h["ids"][:t], h["pos"][:t], h["slots"][:t] = hb.ids, hb.positions, hb.slots
        h["ids"][t:size], h["pos"][t:size], h["slots"][t:size] = 0, 0, -1
        dec = np.flatnonzero(hb.q_lens == 1)
        pre = np.flatnonzero(hb.q_lens > 1)
        nd, npre, dmax = len(dec), len(pre), self.decode_rows(size)
        h["dec_qloc"][:nd], h["dec_ctx"][:nd] = hb.q_start[dec], hb.ctx_lens[dec]
        h["dec_qloc"][nd:dmax], h["dec_ctx"][nd:dmax] = -1, 0
        h["dec_tables"][:nd, :p] = hb.tables[dec]  # columns past p: stale, never read (ctx bounds)
        h["pre_qstart"][:npre], h["pre_qlens"][:npre] = hb.q_start[pre], hb.q_lens[pre]
        h["pre_ctx"][:npre] = hb.ctx_lens[pre]
        h["pre_tables"][:npre, :p] = hb.tables[pre]
        per_span = -(-hb.q_lens[pre] // self.block_m)
        nb, cap = int(per_span.sum()), self.num_blocks(size)
        first = np.cumsum(per_span) - per_span
        h["blocks"][0, :nb] = np.repeat(np.arange(npre), per_span)
        h["blocks"][1, :nb] = np.arange(nb) - np.repeat(first, per_span)
        h["blocks"][0, nb:cap] = -1
        self.work.fill(plan, self.capacity(size))
        s = len(hb.q_lens)
        h["last"][:s] = hb.q_start + hb.q_lens - 1
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return self.d["last"][:s]


class MixedGraphs:
    """CUDA graphs for steps that carry prefill tokens, one per size of token_ladder: eagerly such
    a step is launch-bound (~320 kernel launches from Python for a 28-layer model, ~9 ms on an
    idle H200 host, ~14.5 ms on a busy one, 25-46 ms beside KV imports, for ~2 ms of GPU work).
    Captured after the decode graphs, in their memory pool (one graph runs at a time)."""

    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        max_tokens: int,
        max_decode: int,
        max_prefill: int,
        num_sms: int,
        device: torch.device,
    ):
        from services.engine.kernels.paged_attention import PREFILL_TUNING

        self.model, self.kv, self.device = model, kv, device
        sizes = token_ladder(max_tokens)
        width = -(-kv.max_seq_len // kv.block_size)
        self.buf = MixedBuffers(
            sizes, max_decode, max_prefill, width, PREFILL_TUNING["block_m"], model.config.n_kv_heads,
            num_sms, device,
        )  # fmt: skip
        # Keyed (size, ragged), as DecodeGraphs.
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self, pool: object | None = None) -> None:
        """Largest first, in `pool` (the decode graphs'). The buffers hold padding only: no KV
        is read or written."""
        self.buf.dev.copy_(self.buf.host)
        for key in sorted(
            ((size, ragged) for size in self.buf.sizes for ragged in (False, True)), reverse=True
        ):
            batch = self.buf.static_batch(*key)
            self.outputs[key], self.graphs[key], pool = capture(
                lambda batch=batch: self.model(batch, self.kv), self.device, pool
            )
        torch.cuda.synchronize(self.device)

    def can_run(self, hb: HostBatch) -> bool:
        return not hb.decode_only and self.buf.fits(hb) is not None

    def load(self, hb: HostBatch, feed: Feed | None = None) -> tuple[tuple[int, bool], torch.Tensor]:
        """Write the batch into the static inputs: the key (size, ragged) of the graph that runs
        it, and the device row of each span's last token."""
        size = self.buf.fits(hb)
        assert size is not None
        dec = hb.q_lens == 1
        plan = None
        if dec.any():
            plan = plan_decode(hb.ctx_lens[dec], hb.q_start[dec], self.buf.n_kv_heads, self.buf.num_sms)
        last = self.buf.fill(hb, size, plan)
        feed_pending(self.buf.d["ids"], feed)
        return (size, plan is not None), last

    def run(self, hb: HostBatch, feed: Feed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [size, dim] with the batch's rows first, each span's last row)."""
        key, last = self.load(hb, feed)
        self.graphs[key].replay()
        return self.outputs[key], last


__all__ = [
    "DecodeGraphs",
    "InputBuffers",
    "MixedBuffers",
    "MixedGraphs",
    "ladder",
    "padded_size",
    "token_ladder",
]
