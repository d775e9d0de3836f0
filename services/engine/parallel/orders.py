"""Lean step orders: what rank 0 sends each step, and how a worker rebuilds the step from it.

A sequence's page table and sampling parameters change rarely next to how often it steps: a
decode step appends a page once every `block_size` tokens. So rank 0 keeps, per attention group,
a `Ledger` of what that group's workers know (each tracked sequence under a small integer key:
its table as last sent, its parameters) and sends a `LeanStep` of changes only: a sequence's whole
table when first seen or when the scheduler replaced it (admission, preemption, a fork's shared
prompt pages), the pages appended since the last order, the keys of finished sequences to forget.
Each worker keeps the mirror (`Book`) and rebuilds the `StepOrder` its runner takes.

The scheduler grows a table only by appending to the same list and replaces the list whenever it
changes otherwise (scheduler.py: `_grow`, `_admit`, `_free_pages`, `finish_forks`), so "the same
list object, longer" is the whole test for an append. `check` mode sends a digest of every tracked
table each step and the worker raises on a mismatch (tests run with it).

With data-parallel attention every group has its own ledger and each rank receives only its
group's order (`send_each`: a scatter); an idle group's order carries no spans, only its
bookkeeping (page copies, forgotten keys), and the ranks join the MoE exchanges with no tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.schemas import SamplingParams
from services.engine.batch import Span
from services.engine.parallel.group import EngineGroups
from services.engine.sequence import Sequence, Status


@dataclass
class LeanStep:
    """One group's step as sent (pickled: host data only)."""

    spans: list[tuple[int, int, list[int], int]] = field(default_factory=list)  # (key, start, tokens, slot)
    tables: dict[int, list[int]] = field(default_factory=dict)  # key -> whole table, replacing any
    grow: dict[int, list[int]] = field(default_factory=dict)  # key -> pages appended
    drop: list[int] = field(default_factory=list)  # keys to forget
    params: dict[int, SamplingParams] = field(default_factory=dict)  # key -> its sampling parameters
    rows: list[int] = field(default_factory=list)  # the span each sample reads
    keys: list[int] = field(default_factory=list)  # the sampling sequence of each row
    draws: list[float] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    routing: bool = False
    graph: int | None = None
    digest: int | None = None  # check mode: Book.digest() rank 0 expects after applying


def digest(tables: dict[int, list[int]]) -> int:
    # Python's hash of int tuples is the same in every process (no string hashing involved).
    return hash(tuple(sorted((k, tuple(t)) for k, t in tables.items())))


@dataclass
class _Entry:
    key: int
    seq: Sequence
    table: list[int] | None  # the list object whose first `n` pages the workers hold
    n: int


class Ledger:
    """Rank 0's record of what one attention group's workers know."""

    def __init__(self, check: bool = False) -> None:
        self.check = check
        self.entries: dict[int, _Entry] = {}  # id(seq) -> entry (the entry holds seq: ids stay unique)
        self.next_key = 0

    def _entry(self, seq: Sequence, out: LeanStep) -> _Entry:
        e = self.entries.get(id(seq))
        if e is None:
            e = self.entries[id(seq)] = _Entry(self.next_key, seq, None, 0)
            self.next_key += 1
            out.params[e.key] = seq.params
        return e

    @staticmethod
    def _sync(e: _Entry, out: LeanStep) -> None:
        table = e.seq.block_table
        if table is e.table and len(table) >= e.n:
            if len(table) > e.n:
                out.grow[e.key] = table[e.n :]
        else:
            out.tables[e.key] = list(table)
            e.table = table
        e.n = len(table)

    def order(
        self,
        spans: list[Span],
        span_seqs: list[Sequence],
        rows: list[int],
        seqs: list[Sequence],
        draws: list[float],
    ) -> LeanStep:
        """The LeanStep of `spans` (one per sequence of `span_seqs`) with samples `seqs` at `rows`;
        page copies and the rest are the caller's to fill in."""
        out = LeanStep(rows=rows, draws=draws)
        for span, seq in zip(spans, span_seqs, strict=True):
            e = self._entry(seq, out)
            self._sync(e, out)
            out.spans.append((e.key, span.start, span.tokens, span.state_slot))
        out.keys = [self._entry(s, out).key for s in seqs]
        # Sequences not stepping now: forget the finished, resend a replaced table (a preempted
        # sequence's is empty) so the workers' mirror equals rank 0's tables at every order.
        for sid, e in list(self.entries.items()):
            if e.seq.status is Status.FINISHED:
                out.drop.append(e.key)
                del self.entries[sid]
            elif e.seq.block_table is not e.table:
                self._sync(e, out)
        if self.check:
            out.digest = digest({e.key: e.seq.block_table for e in self.entries.values()})
        return out


class Book:
    """A worker's mirror of its group's ledger: rebuilds each step's spans and parameters."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}
        self.params: dict[int, SamplingParams] = {}

    def apply(self, lean: LeanStep) -> tuple[list[Span], list[SamplingParams]]:
        for k in lean.drop:
            self.tables.pop(k, None)
            self.params.pop(k, None)
        self.params.update(lean.params)
        self.tables.update(lean.tables)
        for k, pages in lean.grow.items():
            self.tables[k].extend(pages)
        if lean.digest is not None:
            known = {k: self.tables.get(k, []) for k in self.params}
            if digest(known) != lean.digest:
                raise RuntimeError("a worker's page tables differ from rank 0's")
        spans = [Span(self.tables[k], start, toks, slot) for k, start, toks, slot in lean.spans]
        return spans, [self.params[k] for k in lean.keys]


def split_orders(groups: EngineGroups) -> bool:
    """Whether each attention group gets its own orders (data-parallel attention)."""
    return groups.world.size > groups.tp.size


def send(groups: EngineGroups, order: Any) -> None:
    """Rank 0: the same order to every rank."""
    if split_orders(groups):
        groups.world.scatter_object([order] * groups.world.size)
    else:
        groups.world.broadcast_object(order)


def send_each(groups: EngineGroups, per_group: list[Any]) -> None:
    """Rank 0: attention group g's ranks get per_group[g] (rank 0's own is not sent on)."""
    tp = groups.tp.size
    groups.world.scatter_object([per_group[r // tp] for r in range(groups.world.size)])


def receive(groups: EngineGroups) -> Any:
    """A worker: rank 0's next order."""
    if split_orders(groups):
        return groups.world.scatter_object(None)
    return groups.world.broadcast_object(None)
