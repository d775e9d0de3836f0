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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Span:
    """New tokens of one sequence for this step: `tokens` sit at positions start.., and position p
    lives in page block_table[p // block_size] (the table covers start + len(tokens) positions)."""

    block_table: list[int]
    start: int
    tokens: list[int]


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
