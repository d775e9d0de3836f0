"""One forward pass's inputs: a flat token batch plus what attention needs per sequence.

A step feeds each scheduled sequence a *span* of new tokens (a prompt chunk for a prefill, one
token for a decode); its K/V pages are named by the sequence's block table (kv_cache.py). Their tokens are concatenated into one flat batch, so embeddings, MLPs and
projections see no padding. Attention is computed per *group* of spans with padded queries; the
decodes (1 query each) and the prefills (many) form separate groups so that one long prompt does
not pad hundreds of single-token decodes to its length.

Attention shapes are rounded up to buckets (batch and query length to powers of two, context to
1/8-octave steps of at least 64). Kernels such as cuDNN's build an execution plan per shape, which
costs tens of ms; with exact shapes the context grows every decode step and every step would pay
it. Padding rows and positions are masked and their outputs dropped.

The GPU path (attention backend "triton") builds a different batch: no groups and no gathered
copies, but per-sequence metadata (`PagedMeta`: block tables, context lengths, query rows) that the
paged kernels (kernels/paged_attention.py) read directly. It is built with numpy from a handful of
per-span values and moved to the device in one copy (`HostBatch`), since at a batch of 256 a decode
step is a few ms and per-token Python would be a visible share of it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain

import numpy as np
import torch

from services.common.config import ModelConfig

DECODE_BLOCK_N = 64  # keys per tile in the paged decode kernel (4 pages of 16)
MLA_BLOCK_H = 16  # query heads per program of the MLA decode kernel (kernels/mla_decode.py)


def decode_layout(m: ModelConfig) -> tuple[int, int]:
    """(programs per work item, keys-per-row cap) of model m's decode kernel, what plan_decode
    sizes the work list by: GQA runs one program per KV head over every key; MLA one per block
    of MLA_BLOCK_H query heads (all heads share the one latent); with DSA (index_topk) a row
    attends at most index_topk selected keys (cap 0: none)."""
    if m.is_mla:
        return -(-m.n_heads // MLA_BLOCK_H), m.index_topk
    return m.n_kv_heads, 0


def host_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the stream: a plain `.to(cuda)` copy is
    followed by a stream sync, which would wait for the step in flight (overlap scheduling) and
    for everything queued before it. Pinned + non_blocking on CUDA; as is elsewhere."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~1 us a span, 256 per decode step
class Span:
    """New tokens of one sequence for this step: `tokens` sit at positions start.., and position p
    lives in page block_table[p // block_size] (the table covers start + len(tokens) positions)."""

    block_table: list[int]
    start: int
    tokens: list[int]
    state_slot: int = -1  # the sequence's Mamba-2 state slot (state_cache.py); -1: none


@dataclass
class StateMeta:
    """What a hybrid model's Mamba-2 layers need of a step (state_cache.py): each span's state
    slot, the slots to zero first (spans starting at position 0), the one-token spans advanced
    together by the recurrent step, and the longer ones scanned one by one."""

    fresh: torch.Tensor  # [F] slots of spans whose first token is position 0
    decode_rows: torch.Tensor  # [D] flat row of each one-token span
    decode_slots: torch.Tensor  # [D] its slot
    prefill: list[tuple[int, int, int]]  # (first flat row, tokens, slot) of each longer span

    @staticmethod
    def build(spans: list[Span], device: torch.device) -> StateMeta:
        fresh: list[int] = []
        rows: list[int] = []
        slots: list[int] = []
        prefill: list[tuple[int, int, int]] = []
        row = 0
        for s in spans:
            if s.state_slot < 0:
                raise ValueError("a hybrid model's span needs its sequence's state slot")
            if s.start == 0:
                fresh.append(s.state_slot)
            if len(s.tokens) == 1:
                rows.append(row)
                slots.append(s.state_slot)
            else:
                prefill.append((row, len(s.tokens), s.state_slot))
            row += len(s.tokens)

        def t(x: list[int]) -> torch.Tensor:
            return host_to_device(torch.tensor(x, dtype=torch.long), device)

        return StateMeta(t(fresh), t(rows), t(slots), prefill)


@dataclass
class AttnGroup:
    block_tables: torch.Tensor  # [B, n_pages] KV pages of each sequence (padded with a valid page)
    q_index: torch.Tensor  # [B, Lq] flat index of each query token (padding: any valid index)
    q_valid: torch.Tensor  # [B, Lq] False on padding
    out_index: torch.Tensor  # [N] flat indices of the valid queries, in q_valid order
    mask: torch.Tensor  # [B, 1, Lq, ctx] key j visible to query i iff j <= position(i)
    ctx_len: int  # keys read per sequence: n_pages * block_size (bucketed max of start + len)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache row of each token: page * block_size + offset
    groups: list[AttnGroup]
    last_index: torch.Tensor  # [S] flat index of each span's last token: its next-token logits
    paged: PagedMeta | None = None  # set: attention runs the paged kernels instead of groups
    state: StateMeta | None = None  # set for a hybrid model: its Mamba-2 layers' spans

    @staticmethod
    def build(spans: list[Span], device: torch.device, max_ctx: int, block_size: int) -> ForwardBatch:
        """max_ctx: the longest possible sequence (bucketed context lengths never exceed it)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        for s in spans:
            offsets.append(len(ids))
            ids.extend(s.tokens)
            pos.extend(range(s.start, s.start + len(s.tokens)))
            slots.extend(
                s.block_table[p // block_size] * block_size + p % block_size
                for p in range(s.start, s.start + len(s.tokens))
            )
        decode = [i for i, s in enumerate(spans) if len(s.tokens) == 1]
        prefill = [i for i, s in enumerate(spans) if len(s.tokens) > 1]
        groups = [
            _group([spans[i] for i in g], [offsets[i] for i in g], device, max_ctx, block_size)
            for g in (decode, prefill)
            if g
        ]

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        last = [o + len(s.tokens) - 1 for o, s in zip(offsets, spans, strict=True)]
        return ForwardBatch(t(ids), t(pos), t(slots), groups, t(last))


def prefill_groups(spans: list[Span], device: torch.device, max_ctx: int, block_size: int) -> list[AttnGroup]:
    """The torch path's attention group of the spans feeding several tokens (flat rows in span
    order, as in a paged batch): MLA's expanded prefill route on the paged path (layers/mla.py)."""
    offsets, at = [], 0
    for s in spans:
        offsets.append(at)
        at += len(s.tokens)
    pre = [i for i, s in enumerate(spans) if len(s.tokens) > 1]
    if not pre:
        return []
    return [_group([spans[i] for i in pre], [offsets[i] for i in pre], device, max_ctx, block_size)]


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def ctx_bucket(n: int, limit: int) -> int:
    """Round n up to a multiple of max(64, ~n/8): at most ~12.5% padding, 8 sizes per doubling."""
    step = max(64, next_pow2(n + 1) // 16)
    return min(-(-n // step) * step, limit)


def _group(
    spans: list[Span], offsets: list[int], device: torch.device, max_ctx: int, block_size: int
) -> AttnGroup:
    lq = next_pow2(max(len(s.tokens) for s in spans))
    index: list[list[int]] = []
    pos: list[list[int]] = []
    valid: list[list[bool]] = []
    for s, off in zip(spans, offsets, strict=True):
        n, pad = len(s.tokens), lq - len(s.tokens)
        index.append(list(range(off, off + n)) + [off] * pad)  # padding reads a real token
        pos.append(list(range(s.start, s.start + n)) + [0] * pad)
        valid.append([True] * n + [False] * pad)
    ctx = ctx_bucket(max(s.start + len(s.tokens) for s in spans), max_ctx)
    n_pages = -(-ctx // block_size)
    # Tables padded with the sequence's first page: those positions lie past its length and are
    # masked. Padding sequences re-read the first sequence's pages at position 0 and are dropped.
    tables = [s.block_table[:n_pages] + [s.block_table[0]] * (n_pages - len(s.block_table)) for s in spans]
    for _ in range(next_pow2(len(spans)) - len(spans)):
        index.append([offsets[0]] * lq)
        pos.append([0] * lq)
        valid.append([False] * lq)
        tables.append(tables[0])
    q_index = torch.tensor(index, dtype=torch.long)
    q_pos = torch.tensor(pos, dtype=torch.long, device=device)
    q_valid = torch.tensor(valid, dtype=torch.bool)
    ctx = n_pages * block_size
    # Causal mask over cache positions. Padding rows (at position 0) see key 0 only, so softmax
    # never meets an all-masked row (which would give NaN); their outputs are discarded anyway.
    mask = torch.arange(ctx, device=device)[None, None, None, :] <= q_pos[:, None, :, None]
    return AttnGroup(
        block_tables=torch.tensor(tables, dtype=torch.long, device=device),
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        out_index=q_index[q_valid].to(device),
        mask=mask,
        ctx_len=ctx,
    )


# ----------------------------------------------------------------------------- GPU (paged kernels)


@dataclass
class DecodeWork:
    """A decode step's ragged work list: each program of the decode kernel attends one query row
    over one partition of that row's context (keys [start, end)). A row of c keys has
    cdiv(c, partition) items, consecutive from row_first[row]; a row with one item writes its
    output directly, the others write partials that the merge kernel combines. So a 16k-token row
    beside 63 short ones is cut into many items while the short rows keep one each; a uniform
    split count gave every short row the long row's (empty) splits too.
    Every value is computed on the host (plan_decode), so a program's loads before its PDL wait
    do not depend on each other."""

    item_row: torch.Tensor  # [W] the row of each program (-1: unused, a CUDA graph's spare slot)
    item_qloc: torch.Tensor  # [W] that row's query (and output) row, q_loc[item_row]
    item_start: torch.Tensor  # [W] first key of the item
    item_end: torch.Tensor  # [W] one past its last key
    item_merge: torch.Tensor  # [W] 0: the row's only item writes the output; 1: a partial
    row_first: torch.Tensor  # [B] each row's first item (where its partials start)
    row_items: torch.Tensor  # [B] items of the row (0 for padding rows; <= 1: no merge)


@dataclass
class DecodeMeta:
    """Sequences feeding one token this step."""

    q_loc: torch.Tensor  # [B] flat row of each sequence's query (and output)
    block_tables: torch.Tensor  # [B, P] page ids; entries past a sequence's pages are never read
    ctx_lens: torch.Tensor  # [B] keys of each sequence, this step's token included (0: padding row)
    # None: one program per (row, KV head) over the row's whole context, no merge.
    work: DecodeWork | None = None


@dataclass
class PrefillMeta:
    """Sequences feeding several tokens this step: each one's queries are contiguous flat rows."""

    q_start: torch.Tensor  # [S] flat row of each sequence's first query
    q_lens: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [S, P]
    ctx_lens: torch.Tensor  # [S] keys after this step: the last query sits at position ctx - 1
    max_q_len: int  # host copy: sizes the grid
    # Set for a fixed grid (a CUDA graph's, cuda_graphs.MixedGraphs): [2, n] int64 (unit stride
    # along n), the span of each query block of BLOCK_M queries and its block index within the
    # span (span -1: an unused program). The grid is n blocks x heads.
    blocks: torch.Tensor | None = None


@dataclass
class PagedMeta:
    decode: DecodeMeta | None
    prefill: PrefillMeta | None
    padded: bool = False  # token rows past the real ones (a CUDA graph's fixed size): see attend


# Keys one program may walk before a batch that already fills the GPU is split: past this a
# long row makes every step wait for its few programs (a 16k row next to 63 short ones took ~13 ms
# a step with one program per row).
LONG_PARTITION_KEYS = 2048


def target_items(batch: int, n_kv_heads: int, num_sms: int) -> int:
    """How many (row, partition) items a decode step aims at: enough programs (x KV heads) to
    fill the GPU about twice, and never fewer than the rows."""
    return max(batch, -(-2 * num_sms // n_kv_heads))


def item_capacity(batch: int, n_kv_heads: int, num_sms: int) -> int:
    """The most items plan_decode makes for `batch` rows: the target plus one per row (each row's
    last partition may be partial). A CUDA graph's fixed grid for that batch size."""
    return batch + target_items(batch, n_kv_heads, num_sms)


@dataclass
class DecodePlan:
    """plan_decode's host arrays (int64), what DecodeWork holds on the device."""

    partition: int
    item_row: np.ndarray  # [n]
    item_qloc: np.ndarray  # [n]
    item_start: np.ndarray  # [n]
    item_end: np.ndarray  # [n]
    item_merge: np.ndarray  # [n]
    row_first: np.ndarray  # [B]
    row_items: np.ndarray  # [B]

    def arrays(self) -> list[np.ndarray]:
        """In DecodeWork's field order (the names are the same)."""
        return [getattr(self, f.name) for f in fields(DecodeWork)]


def plan_decode(ctx: np.ndarray, q_loc: np.ndarray, n_kv_heads: int, num_sms: int) -> DecodePlan | None:
    """The work list for rows of these context lengths (0: a padding row, no item) and query rows,
    or None when one program per row is as good: every row fits one partition, or the rows alone fill the GPU
    and none is longer than LONG_PARTITION_KEYS (one split, no merge kernel: W1's large batches).
    The partition spreads the total context over target_items programs (a multiple of
    DECODE_BLOCK_N), so the items number at most item_capacity(len(ctx))."""
    b = len(ctx)
    max_ctx = int(ctx.max()) if b else 0
    if b * n_kv_heads >= 2 * num_sms and max_ctx <= LONG_PARTITION_KEYS:
        return None
    want = -(-int(ctx.sum()) // target_items(b, n_kv_heads, num_sms))
    partition = max(1, -(-want // DECODE_BLOCK_N)) * DECODE_BLOCK_N
    if max_ctx <= partition:
        return None
    n = -(-ctx // partition)  # 0 for padding rows
    first = np.cumsum(n) - n
    row = np.repeat(np.arange(b, dtype=np.int64), n)
    start = (np.arange(len(row), dtype=np.int64) - first[row]) * partition
    end = np.minimum(start + partition, ctx[row])
    merge = (n[row] > 1).astype(np.int64)
    return DecodePlan(partition, row, q_loc[row], start, end, merge, first, n.astype(np.int64))


def capped(ctx: np.ndarray, key_cap: int) -> np.ndarray:
    """Keys each row's decode attends: its context, or at most key_cap selected ones (DSA)."""
    return np.minimum(ctx, key_cap) if key_cap else ctx


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors: sizes the decode split."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton interpreter (CPU): small, so tests exercise several splits and the merge


@dataclass
class HostBatch:
    """A step's inputs as host int64 arrays (what the device copies are made from)."""

    ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T]
    q_start: np.ndarray  # [S] flat row of each span's first token
    q_lens: np.ndarray  # [S]
    ctx_lens: np.ndarray  # [S] start + len
    tables: np.ndarray  # [S, P] block tables, zero-padded
    state_slots: np.ndarray | None = None  # [S] a hybrid model's Mamba-2 state slots (Span.state_slot)

    @property
    def decode_only(self) -> bool:
        return bool(len(self.ids) == len(self.q_lens))

    @staticmethod
    def build(spans: list[Span], block_size: int, tables: BlockTables | None = None) -> HostBatch:
        """tables: the engine's persistent host copy of block tables (only new pages are copied);
        without it every entry is converted, ~0.1 us each (10k+ entries at a batch of 256)."""
        n = len(spans)
        lens = np.fromiter((len(s.tokens) for s in spans), np.int64, n)
        starts = np.fromiter((s.start for s in spans), np.int64, n)
        total = int(lens.sum())
        ids = np.fromiter(chain.from_iterable(s.tokens for s in spans), np.int64, total)
        q_start = np.zeros(n, np.int64)
        np.cumsum(lens[:-1], out=q_start[1:])
        if tables is not None:
            table = tables.gather([s.block_table for s in spans])
        else:
            tlens = np.fromiter((len(s.block_table) for s in spans), np.int64, n)
            table = np.zeros((n, int(tlens.max())), np.int64)
            flat = np.fromiter(chain.from_iterable(s.block_table for s in spans), np.int64, int(tlens.sum()))
            table[np.arange(table.shape[1])[None, :] < tlens[:, None]] = flat
        if total == n:  # decode-only: one token per span, no per-token expansion needed
            seq, positions = np.arange(n), starts
        else:
            seq = np.repeat(np.arange(n), lens)
            positions = starts[seq] + np.arange(total) - q_start[seq]
        slots = table[seq, positions // block_size] * block_size + positions % block_size
        states = None
        if n and spans[0].state_slot >= 0:
            states = np.fromiter((s.state_slot for s in spans), np.int64, n)
        return HostBatch(ids, positions, slots, q_start, lens, starts + lens, table, states)

    def to_forward_batch(
        self, device: torch.device, n_kv_heads: int, num_sms: int, key_cap: int = 0
    ) -> ForwardBatch:
        """The eager paged batch: decode spans (1 token) go to the decode kernel, the rest to the
        prefill kernel; everything reaches the device in one copy. n_kv_heads, key_cap: the
        decode kernel's programs per item and keys-per-row cap (decode_layout)."""
        dec = np.flatnonzero(self.q_lens == 1)
        pre = np.flatnonzero(self.q_lens > 1)
        parts = [
            self.ids,
            self.positions,
            self.slots,
            self.q_start + self.q_lens - 1,  # last_index
            self.q_start[dec],
            self.ctx_lens[dec],
            self.tables[dec].ravel(),
            self.q_start[pre],
            self.q_lens[pre],
            self.ctx_lens[pre],
            self.tables[pre].ravel(),
        ]
        plan = None
        if len(dec):
            plan = plan_decode(capped(self.ctx_lens[dec], key_cap), self.q_start[dec], n_kv_heads, num_sms)
        if plan is not None:
            parts += plan.arrays()
        # Each part starts 16-byte aligned (even int64 count before it): Triton specialises kernels
        # on pointer alignment, so a varying alignment would mean recompiles mid-run.
        sizes = [len(x) for x in parts]
        padded = [x if len(x) % 2 == 0 else np.append(x, 0) for x in parts]
        buf = host_to_device(torch.from_numpy(np.concatenate(padded)), device)
        views = [v[:n] for v, n in zip(torch.split(buf, [len(x) for x in padded]), sizes, strict=True)]
        t, s, p = len(self.ids), len(self.q_lens), self.tables.shape[1]
        decode = prefill = None
        if len(dec):
            work = DecodeWork(*views[11:]) if plan is not None else None
            decode = DecodeMeta(views[4], views[6].view(len(dec), p), views[5], work)
        if len(pre):
            prefill = PrefillMeta(
                views[7], views[8], views[10].view(len(pre), p), views[9], int(self.q_lens[pre].max())
            )
        assert len(views[0]) == t and len(views[3]) == s
        return ForwardBatch(views[0], views[1], views[2], [], views[3], PagedMeta(decode, prefill))


class BlockTables:
    """A persistent host copy of the block tables of the sequences in recent steps.

    A decode step adds at most one page per sequence, so re-converting every table entry each step
    (~0.1 us per Python int) is waste; this keeps one numpy row per live table and copies only the
    entries appended since the last step. Keyed by the identity of the table's list, which stays
    alive as long as it is cached here (so its id cannot be reused). The scheduler only ever appends
    to a table in place and replaces it otherwise (new list object); a table that shrank or whose
    last synced entry changed is re-copied whole, as a guard against in-place edits.
    """

    def __init__(self, width: int, rows: int = 64):
        self.width = width
        self.table = np.zeros((rows, width), np.int64)
        self.entries: dict[int, list] = {}  # id(list) -> [list, row, entries synced, last entry]
        self.free = list(range(rows - 1, -1, -1))

    def gather(self, tables: list[list[int]]) -> np.ndarray:
        """[len(tables), longest] copy of the given tables (zero past each one's end); entries
        of tables absent from this call are dropped."""
        live: dict[int, list] = {}
        rows: list[int] = []
        get = self.entries.get
        longest = 1
        new = 0
        for bt in tables:
            key = id(bt)
            e = get(key)
            k = len(bt)
            # Fast path (most tables, most steps): same length and last entry as last time.
            if e is None or e[2] != k or (k and bt[-1] != e[3]):
                new += e is None
                e = self._sync(bt, e)
            live[key] = e
            rows.append(e[1])
            if k > longest:
                longest = k
        # No new table and as many as last call: the same set, nothing to free (the common decode
        # step), so the scan over every entry is skipped.
        if new or len(live) != len(self.entries):
            for key, e in self.entries.items():
                if key not in live:
                    self.table[e[1], : e[2]] = 0  # free rows are all zero (see _sync)
                    self.free.append(e[1])
        self.entries = live
        # Each row is zero past its table's end (kept so by _sync and the frees above): no masking.
        return self.table[np.array(rows, np.int64), :longest]

    def _sync(self, bt: list[int], e: list | None) -> list:
        """Copy the entries appended since the last sync (all of them for a new or edited table)."""
        k = len(bt)
        if k > self.width:
            raise ValueError(f"block table of {k} pages exceeds the width {self.width}")
        if e is None:
            e = [bt, self._alloc(), 0, None]
        synced = e[2]
        if k < synced or (synced and self.table[e[1], synced - 1] != bt[synced - 1]):
            self.table[e[1], k:synced] = 0  # keep the row zero past the table's end
            synced = 0  # shrunk or edited in place: copy it whole
        if k > synced:
            self.table[e[1], synced:k] = bt[synced:k]
        e[2], e[3] = k, (bt[-1] if k else None)
        return e

    def _alloc(self) -> int:
        if not self.free:
            # Rows held by entries not yet seen in this call may be freed at its end; grow instead.
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.free = list(range(2 * old - 1, old - 1, -1))
        return self.free.pop()
