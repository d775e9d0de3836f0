"""Lean step orders (services/engine/parallel/orders.py) in-process: rank 0's ledger and a worker's
book, each order pickled between them as the broadcast does, through a sequence's life as the
scheduler changes its page table (admission with cached pages, growth, preemption and resumption
on other pages, a fork sharing its parent's prompt pages, finishing): after every order the
worker's tables equal rank 0's; the orders carry only changes; a diverged mirror raises. The
engine runs with the same check on every step in tests/test_parallel_engine.py."""

from __future__ import annotations

import pickle

import pytest

from services.common.schemas import GenerateRequest, SamplingParams
from services.engine.batch import Span
from services.engine.parallel.orders import Book, LeanStep, Ledger
from services.engine.sequence import RequestState, Sequence, Status


def request(n: int) -> RequestState:
    req = GenerateRequest(input_ids=[1, 2, 3, 4, 5], sampling=SamplingParams(n=n, max_tokens=4, seed=1))
    return RequestState("r", req)


def step(ledger: Ledger, book: Book, running: list[Sequence], sample: list[Sequence]) -> LeanStep:
    spans = [Span(s.block_table, 0, [7], s.state_slot) for s in running]
    rows = [running.index(s) if s in running else 0 for s in sample]
    lean = ledger.order(spans, running, rows, sample, [0.5] * len(sample))
    wire = pickle.loads(pickle.dumps(lean))
    got, params = book.apply(wire)
    assert [sp.block_table for sp in got] == [s.block_table for s in running]
    assert params == [s.params for s in sample]
    live = {e.key: e.seq.block_table for e in ledger.entries.values()}
    assert {k: book.tables[k] for k in live} == live and set(book.tables) == set(live)
    return lean


def test_a_workers_tables_follow_rank_0s_through_a_sequences_life() -> None:
    ledger, book = Ledger(check=True), Book()
    parent, child = request(2).seqs
    other = request(1).seqs[0]
    parent.block_table = [4, 9]  # admitted: a cached page and a new one
    other.block_table = [11]
    first = step(ledger, book, [parent, other], [parent, child])
    assert first.tables == {0: [4, 9], 1: [11], 2: []} and len(first.params) == 3
    child.block_table = [4] + [12]  # the fork: the parent's full prompt page and its own copy
    parent.block_table.append(13)  # a decode step crossed into a new page
    lean = step(ledger, book, [parent, child, other], [parent, child, other])
    assert lean.grow == {0: [13]} and lean.tables == {2: [4, 12]} and not lean.params
    lean = step(ledger, book, [parent, child, other], [parent, child, other])
    assert not lean.tables and not lean.grow and not lean.drop  # a plain decode step: no tables
    other.block_table = []  # preempted: its pages freed
    lean = step(ledger, book, [parent, child], [parent, child])
    assert lean.tables == {1: []}
    other.block_table = [20, 21]  # resumed on other pages
    lean = step(ledger, book, [parent, child, other], [other])
    assert lean.tables == {1: [20, 21]}
    parent.status, parent.block_table = Status.FINISHED, []
    lean = step(ledger, book, [child, other], [child, other])
    assert lean.drop == [0] and 0 not in book.tables and 0 not in book.params
    # A mirror that lost a page fails the next order's check.
    book.tables[2].pop()
    with pytest.raises(RuntimeError, match="page tables differ"):
        step(ledger, book, [child, other], [child])
