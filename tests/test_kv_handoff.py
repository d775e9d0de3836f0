"""Same-host prefill -> decode KV handoff (services/kvstore/shared_segment.py, handoff.py, the
shared near tier in near_cache.py), with a real writer process holding the shared tier:

- a second process copies the handed-off pages and gets identical bytes, across segments;
- a slot rewritten after the handoff (before the copy, or during it) is detected and not used;
- the lease and the ack release the held slots; a held slot is never reused;
- segments are unlinked on close, and a SIGKILLed owner's are swept by the next owner;
- a segment that is not mappable here (another host, a stale file) falls back (nothing copied).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from services.common.prefill_schemas import KVHandoff
from services.kvstore.handoff import HandoffLeases, HandoffReader
from services.kvstore.near_cache import NearCache
from services.kvstore.shared_segment import PREFIX, SHM_DIR, SegmentUnavailable, SharedSegment, sweep_dead

PAGE = 4096 + 320  # not a multiple of the OS page: slots must not assume alignment
CPU = torch.device("cpu")
ACK_URL = "http://127.0.0.1:9/v1/handoff/ack"  # never called here: acks go through the pipe


def keys_for(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]


def pages_for(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PAGE), dtype=torch.uint8, generator=g)


def _writer(conn: Connection, slots: int, n: int, pin: bool = False) -> None:
    """A prefill-like process: a shared near tier of `slots` slots (chunks of 4: several
    segments; `pin`: registered for DMA, as on CUDA) holding n pages, one handoff of them under
    a lease; then serves commands."""
    near = NearCache(slots * PAGE, PAGE, pin=pin, chunk_bytes=4 * PAGE, shared=True)
    leases = HandoffLeases(30.0, ACK_URL)
    keys = keys_for("prompt", n)
    near.put(keys, pages_for(0, n))
    run, refs = near.handoff(keys)
    handoff = leases.grant(run, refs)
    assert handoff is not None
    conn.send(handoff.model_dump_json())
    while True:
        cmd, arg = conn.recv()
        if cmd == "ack":
            conn.send(leases.ack(arg))
        elif cmd == "release":  # the lease ends (as if the decode never acked)
            conn.send(leases.expire(float("inf")))
        elif cmd == "rewrite":  # new pages: the LRU reuses the released slots
            conn.send(near.put(keys_for("other", arg), pages_for(1, arg)))
        elif cmd == "names":
            conn.send([s.name for s in near._segments if s is not None])
        elif cmd == "pinned":
            conn.send([s.pinned and s.data.is_pinned() for s in near._segments if s is not None])
        elif cmd == "exit":
            near.close()
            conn.send(True)
            return


class Writer:
    def __init__(self, slots: int, n: int, pin: bool = False):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_writer, args=(child, slots, n, pin), daemon=True)
        self.proc.start()
        assert self.conn.poll(60), "writer process did not start"
        self.handoff = KVHandoff.model_validate_json(self.conn.recv())
        self.exited = False

    def ask(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        assert self.conn.poll(30), f"writer did not answer {cmd}"
        self.exited = cmd == "exit"
        return self.conn.recv()


@pytest.fixture
def writer() -> Iterator[Writer]:
    w = Writer(slots=10, n=8)
    try:
        yield w
    finally:
        if not w.exited and w.proc.is_alive():
            w.ask("exit")
        w.proc.join(10)


def test_handoff_copies_identical_bytes_across_processes(writer: Writer) -> None:
    h = writer.handoff
    assert len(h.slots) == 8 and len(h.segments) == 2  # 8 pages over chunks of 4 slots
    reader = HandoffReader()
    keys = keys_for("prompt", 8)
    got, pages = reader.fetch(h, keys, 0, CPU)
    assert got == 8 and pages is not None
    assert torch.equal(pages, pages_for(0, 8))
    # From an offset (the decode already had a prefix cached): page i of keys is handoff page 3+i.
    got, pages = reader.fetch(h, keys[3:], 3, CPU)
    assert got == 5 and pages is not None and torch.equal(pages, pages_for(0, 8)[3:])
    assert reader.stats()["handoff_pages_copied"] == 13
    assert writer.ask("ack", h.id) is True
    assert writer.ask("ack", h.id) is False  # once
    reader.close()


def test_slot_rewritten_after_handoff_is_never_used(writer: Writer) -> None:
    h = writer.handoff
    assert writer.ask("release") == 1  # the lease ended: the slots may be reused
    # 10 slots, 8 used: 2 free ones first, then the LRU's 2 oldest (the chain's tail) are rewritten.
    assert writer.ask("rewrite", 4) == 4
    reader = HandoffReader()
    got, pages = reader.fetch(h, keys_for("prompt", 8), 0, CPU)
    assert got == 6 and pages is not None
    assert torch.equal(pages, pages_for(0, 8)[:6])  # the intact head only
    assert reader.stats()["handoff_pages_stale"] == 2
    reader.close()


class RewriteDuringCopy(HandoffReader):
    """A reader whose copy starts only after the writer has rewritten slots: the stamps were
    intact at the first check, so only the check after the copy can catch it."""

    def __init__(self, w: Writer):
        super().__init__()
        self.w = w

    def _copy(self, want: Any, page_bytes: int, device: torch.device) -> torch.Tensor:
        assert self.w.ask("release") == 1
        assert self.w.ask("rewrite", 4) == 4
        return super()._copy(want, page_bytes, device)


def test_slot_rewritten_during_copy_is_detected(writer: Writer) -> None:
    reader = RewriteDuringCopy(writer)
    got, pages = reader.fetch(writer.handoff, keys_for("prompt", 8), 0, CPU)
    assert got == 6 and pages is not None
    assert torch.equal(pages, pages_for(0, 8)[:6])
    assert reader.stats()["handoff_pages_stale"] == 2
    reader.close()


def test_lease_and_ack_release_held_slots() -> None:
    near = NearCache(4 * PAGE, PAGE, pin=False, shared=True)
    leases = HandoffLeases(30.0, ACK_URL)
    try:
        a, b = keys_for("a", 4), keys_for("b", 4)
        assert near.put(a, pages_for(0, 4)) == 4
        h = leases.grant(*near.handoff(a))
        assert h is not None and leases.held_pages == 4
        assert near.put(b, pages_for(1, 4)) == 0  # every slot is held by the lease: none reused
        assert leases.expire() == 0  # not yet
        assert leases.expire(float("inf")) == 1 and leases.held_pages == 0
        assert near.put(b, pages_for(1, 4)) == 4  # released: the LRU reuses them
        h2 = leases.grant(*near.handoff(b))
        assert h2 is not None
        assert near.put(a, pages_for(0, 4)) == 0
        assert leases.ack(h2.id) and not leases.ack(h2.id)
        assert near.put(a, pages_for(0, 4)) == 4
        assert leases.stats() == {
            "handoffs_granted": 2,
            "handoffs_acked": 1,
            "handoffs_expired": 1,
            "handoff_held_pages": 0,
        }
    finally:
        leases.close()
        near.close()


def test_segments_are_unlinked_on_close() -> None:
    near = NearCache(10 * PAGE, PAGE, pin=False, chunk_bytes=4 * PAGE, shared=True)
    near.put(keys_for("p", 10), pages_for(0, 10))
    names = [s.name for s in near._segments if s is not None]
    assert len(names) == 3 and all((SHM_DIR / n).exists() for n in names)
    near.close()
    assert not any((SHM_DIR / n).exists() for n in names)
    near.close()  # idempotent


def test_killed_owners_segments_are_swept() -> None:
    w = Writer(slots=10, n=8)
    names = w.ask("names")
    assert names and all((SHM_DIR / n).exists() for n in names)
    os.kill(w.proc.pid, signal.SIGKILL)
    w.proc.join(10)
    assert all((SHM_DIR / n).exists() for n in names)  # a killed owner cannot unlink
    assert sweep_dead() >= len(names)
    assert not any((SHM_DIR / n).exists() for n in names)
    # A live owner's segments are left alone.
    near = NearCache(4 * PAGE, PAGE, pin=False, shared=True)
    try:
        near.put(keys_for("p", 1), pages_for(0, 1))
        sweep_dead()
        assert all((SHM_DIR / s.name).exists() for s in near._segments if s is not None)
    finally:
        near.close()


def test_unmappable_segment_falls_back(writer: Writer) -> None:
    h = writer.handoff
    keys = keys_for("prompt", 8)
    # Another host's segment: the name does not exist here.
    foreign = h.model_copy(
        update={"segments": [s.model_copy(update={"name": f"{PREFIX}0-1-x"}) for s in h.segments]}
    )
    reader = HandoffReader()
    assert reader.fetch(foreign, keys, 0, CPU) == (0, None)
    assert reader.stats()["handoff_pages_unmapped"] == 8
    # A file of that name that is not the segment named (token differs).
    with pytest.raises(SegmentUnavailable):
        SharedSegment.attach(h.segments[0].name, b"\0" * 16, PAGE, pin=False)
    stale = h.model_copy(update={"segments": [s.model_copy(update={"token": "0" * 32}) for s in h.segments]})
    assert HandoffReader().fetch(stale, keys, 0, CPU) == (0, None)
    # Keys that are not the ones handed off (another prompt): nothing is used.
    assert reader.fetch(h, keys_for("elsewhere", 8), 0, CPU) == (0, None)
    reader.close()


def test_reader_unmaps_segments_their_owner_unlinked(writer: Writer) -> None:
    h = writer.handoff
    reader = HandoffReader()
    assert reader.fetch(h, keys_for("prompt", 8), 0, CPU)[0] == 8
    mapped = [s for s in reader._maps.values() if s is not None]
    assert len(mapped) == 2
    assert writer.ask("exit") is True  # the prefill exits: its segments are unlinked
    # The next fetch lets the dead owner's mappings go (else their memory stays) and finds nothing.
    assert reader.fetch(h, keys_for("prompt", 8), 0, CPU) == (0, None)
    assert all(s is None for s in reader._maps.values())
    assert all(s._mm is None for s in mapped)
    reader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_cuda_handoff_registers_segments_and_copies_to_the_device() -> None:
    """Both sides register the segments (cudaHostRegister); the pages land on the device intact,
    and a rewrite during the copy is still caught."""
    w = Writer(slots=10, n=8, pin=True)
    try:
        assert w.ask("pinned") == [True, True]
        reader = HandoffReader()
        dev = torch.device("cuda", 0)
        got, pages = reader.fetch(w.handoff, keys_for("prompt", 8), 0, dev)
        assert got == 8 and pages is not None and pages.device == dev
        assert torch.equal(pages.cpu(), pages_for(0, 8))
        assert all(s is not None and s.pinned and s.data.is_pinned() for s in reader._maps.values())
        reader.close()
        racing = RewriteDuringCopy(w)
        got, pages = racing.fetch(w.handoff, keys_for("prompt", 8), 0, dev)
        assert got == 6 and pages is not None and torch.equal(pages.cpu(), pages_for(0, 8)[:6])
        racing.close()
    finally:
        if not w.exited:
            w.ask("exit")
        w.proc.join(10)


def test_handoff_lists_the_whole_tier_and_the_reader_maps_it_at_once() -> None:
    near = NearCache(6 * PAGE, PAGE, pin=False, chunk_bytes=2 * PAGE, shared=True)
    leases = HandoffLeases(30.0, ACK_URL)
    reader = HandoffReader()
    try:
        assert near.reserve() == 6 and len(near.shared_segments) == 3
        keys = keys_for("p", 2)
        near.put(keys, pages_for(0, 2))
        h = leases.grant(*near.handoff(keys), near.shared_segments)
        assert h is not None and h.seg == [0, 0] and len(h.segments) == 3
        got, pages = reader.fetch(h, keys, 0, CPU)
        assert got == 2 and pages is not None and torch.equal(pages, pages_for(0, 2))
        assert sorted(reader._maps) == sorted(s.name for s in near.shared_segments)  # all three
    finally:
        reader.close()
        leases.close()
        near.close()
