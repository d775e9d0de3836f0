"""Same-host prefill -> decode KV handoff through the prefill's shared near tier.

Prefill side (`HandoffLeases`): after a prefill, the prompt's pages are in the prefill's shared
near tier (near_cache.py with shared segments); their slots are held under a lease and their
segment names, slot ids and generations go back in the prefill response (`KVHandoff`). The
slots are let go when the decode POSTs the ack or the lease ends, whichever first: a crashed
decode costs only the lease, and the LRU never reuses a slot a reader may still be copying.

Decode side (`HandoffReader`): maps the named segments (once per name; a name that is not here,
another host's, is remembered as such), checks each page's stamp (generation and key), copies the
pages host -> device (one DMA from the registered mapping), and checks the stamps again: the
leading pages whose stamps held are used; from the first that changed on, the pages come from the
gateway or are recomputed. A stale page is never returned.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np
import torch
from prometheus_client import Counter

from services.common.prefill_schemas import HandoffSegment, KVHandoff
from services.engine.kv_transfer import copy_to_device
from services.kvstore.near_cache import NearCache, NearRun
from services.kvstore.shared_segment import SegmentUnavailable, SharedSegment

log = logging.getLogger(__name__)

HANDOFFS = Counter("relay_kv_handoffs", "same-host kv handoffs by the prefill service", ["outcome"])
HANDOFF_PAGES = Counter("relay_kv_handoff_pages", "pages a decode took from a handoff", ["outcome"])


class HandoffLeases:
    """Prefill side: handed-off slots held until acked or `lease_s` old. Thread-safe."""

    def __init__(self, lease_s: float, ack_url: str):
        self.lease_s, self.ack_url = lease_s, ack_url
        self._held: dict[str, tuple[NearRun, float]] = {}
        self._lock = threading.Lock()
        self.granted = self.acked = self.expired = 0

    def grant(
        self,
        run: NearRun,
        refs: Sequence[tuple[SharedSegment, int, int]],
        tier: Sequence[SharedSegment] = (),
        tail_tokens: int = 0,
    ) -> KVHandoff | None:
        """A handoff of `run` (held by the caller; this lease owns it from now), None if empty.
        `tier`: every segment of the near tier, listed too, so a reader maps (and registers) them
        all at its first handoff: one stall of its loop then, not one per segment later.
        `tail_tokens` > 0: the run's last page is the prompt's partial last page (that many
        tokens; KVHandoff.tail_tokens)."""
        if not refs:
            run.release()
            return None
        segments = segment_list([*tier, *(r[0] for r in refs)])
        names = {s.name: i for i, s in enumerate(segments)}
        seg_ix, slots, gens = [], [], []
        for seg, slot, gen in refs:
            seg_ix.append(names[seg.name])
            slots.append(slot)
            gens.append(gen)
        hid = uuid.uuid4().hex
        with self._lock:
            self._held[hid] = (run, time.monotonic() + self.lease_s)
            self.granted += 1
        HANDOFFS.labels("granted").inc()
        return KVHandoff(
            id=hid,
            page_bytes=run.page_bytes,
            segments=segments,
            seg=seg_ix,
            slots=slots,
            gens=gens,
            lease_s=self.lease_s,
            ack_url=self.ack_url,
            tail_tokens=tail_tokens,
        )

    def grant_prompt(
        self, near: NearCache, keys: Sequence[bytes], tail: bytes | None = None, tail_tokens: int = 0
    ) -> KVHandoff | None:
        """A handoff of a prompt's pages in the shared near tier `near`: the leading run of its
        full pages `keys`, and its partial last page (key `tail`, `tail_tokens` tokens) when every
        full page is there (a tail is only usable on top of all of them). None: nothing there."""
        if not near.shared or not (keys or tail is not None):
            return None
        run, refs = near.handoff([*keys, tail] if tail is not None else list(keys))
        with_tail = tail is not None and len(refs) == len(keys) + 1
        return self.grant(run, refs, near.shared_segments, tail_tokens if with_tail else 0)

    def ack(self, hid: str) -> bool:
        """Let the slots of handoff `hid` go; False if it is unknown (already expired or acked)."""
        with self._lock:
            held = self._held.pop(hid, None)
            if held is not None:
                self.acked += 1
        if held is None:
            return False
        held[0].release()
        HANDOFFS.labels("acked").inc()
        return True

    def expire(self, now: float | None = None) -> int:
        """Let go of every lease past its end; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            done = [hid for hid, (_, end) in self._held.items() if end <= now]
            runs = [self._held.pop(hid)[0] for hid in done]
            self.expired += len(runs)
        for run in runs:
            run.release()
        if runs:
            HANDOFFS.labels("expired").inc(len(runs))
        return len(runs)

    @property
    def held_pages(self) -> int:
        with self._lock:
            return sum(len(run) for run, _ in self._held.values())

    def close(self) -> None:
        self.expire(float("inf"))

    def stats(self) -> dict[str, int]:
        return {
            "handoffs_granted": self.granted,
            "handoffs_acked": self.acked,
            "handoffs_expired": self.expired,
            "handoff_held_pages": self.held_pages,
        }


def segment_list(segs: Sequence[SharedSegment]) -> list[HandoffSegment]:
    """The wire form of `segs` (names and tokens), each segment once, in order."""
    out: list[HandoffSegment] = []
    seen: set[str] = set()
    for seg in segs:
        if seg.name not in seen:
            seen.add(seg.name)
            out.append(HandoffSegment(name=seg.name, token=seg.token.hex()))
    return out


MAX_TAKEN_BUFFERS = 8  # device buffers handed out and not yet released that may come back
MAX_FREE_BUFFERS = 2  # kept for reuse: two pulls in flight at once, then new allocations


class HandoffReader:
    """Decode side: maps prefill segments (cached per name) and copies validated pages out.
    Thread-safe (pulls run in worker threads)."""

    def __init__(self) -> None:
        self._maps: dict[str, SharedSegment | None] = {}  # None: not mappable here
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._active = 0  # fetches in progress: a mapping is only dropped when none is
        self.copied = self.stale = self.unmapped = 0
        self.tails_copied = 0  # partial last prompt pages (counted apart from the full pages)
        self.premapped = 0  # segments mapped ahead of any handoff (map_segments)
        # Device staging buffers, reused (_buffer / release). Insertion-ordered: the oldest
        # unreleased one is forgotten first (its holder still frees it the usual way).
        self._free: list[torch.Tensor] = []
        self._taken: dict[int, torch.Tensor] = {}

    def _segment(self, s: HandoffSegment, page_bytes: int, pin: bool) -> SharedSegment | None:
        with self._lock:
            if s.name in self._maps:
                seg = self._maps[s.name]
                if seg is None or seg.token.hex() == s.token:
                    return seg
            try:
                # Registering (pinning) a mapping is paid once per segment, here: later copies
                # from it are single DMAs.
                seg = SharedSegment.attach(s.name, bytes.fromhex(s.token), page_bytes, pin)
            except SegmentUnavailable as e:
                log.info(f"kv handoff segment not mappable here ({e}): using the store")
                seg = None
            old = self._maps.get(s.name)
            if old is not None:
                old.close()  # a stale file of the same name: replaced
            self._maps[s.name] = seg
            return seg

    def map_segments(self, segments: Sequence[HandoffSegment], page_bytes: int, pin: bool) -> int:
        """Map (and with `pin` register) a same-host prefill's segments before any handoff names
        them (its GET /v1/handoff/segments), so the first handoff does not pay the mapping and
        pinning on the serving path. Returns how many were newly mapped; a segment already mapped
        or not mappable here is left as it is."""
        with self._lock:
            if not self._active:
                self._drop_unlinked()  # a restarted prefill's old segments: let them go first
            known = {n: seg.token.hex() for n, seg in self._maps.items() if seg is not None}
        new = 0
        for s in segments:
            if known.get(s.name) == s.token:
                continue
            if self._segment(s, page_bytes, pin) is not None:
                new += 1
        self.premapped += new
        return new

    def _drop_unlinked(self) -> None:
        """Unmap segments whose owner unlinked them (a prefill that exited or restarted): the
        mapping alone would keep their memory (and its pinning) for as long as this process
        lives. Lock held, no fetch in progress (one may be reading such a segment)."""
        for name, seg in list(self._maps.items()):
            if seg is not None and not seg.path.exists():
                seg.close()
                del self._maps[name]

    def fetch(
        self, h: KVHandoff, keys: Sequence[bytes], first: int, device: torch.device, tail: bool = False
    ) -> tuple[int, torch.Tensor | None]:
        """Pages first .. first+len(keys) of handoff `h` (keys[i] is page first+i's key): the
        leading run of them that copied intact, as (count, [count, page_bytes] uint8 tensor on
        `device`). A page whose stamp differs before or after the copy ends the run. Only full
        pages are read, unless `tail` (keys = [the tail's key], first = its index)."""
        with self._lock:
            if not self._active:
                self._drop_unlinked()
            self._active += 1
        try:
            return self._fetch(h, keys, first, device, tail)
        finally:
            with self._lock:
                self._active -= 1

    def _fetch(
        self, h: KVHandoff, keys: Sequence[bytes], first: int, device: torch.device, tail: bool
    ) -> tuple[int, torch.Tensor | None]:
        n = max(0, min(len(keys), (len(h.slots) if tail else h.full_pages) - first))
        pin = device.type == "cuda"
        # Every listed segment (the prefill's whole tier), mapped now if new: the registrations of
        # a first contact happen together, not one per segment over later pulls.
        segs = [self._segment(s, h.page_bytes, pin) for s in h.segments]
        want: list[tuple[SharedSegment, int, int, bytes]] = []
        for i in range(n):
            j = first + i
            seg = segs[h.seg[j]]
            if seg is None:
                self.unmapped += n - i
                HANDOFF_PAGES.labels("unmapped").inc(n - i)
                break
            if not 0 <= h.slots[j] < seg.slots:
                break
            want.append((seg, h.slots[j], h.gens[j], keys[i]))
        ok = _intact(want)
        if ok < len(want):
            self._stale(len(want) - ok)
        if not ok:
            return 0, None
        out = self._copy(want[:ok], h.page_bytes, device)
        good = _intact(want[:ok])  # the seqlock's second read: after the copy has landed
        if good < ok:
            self._stale(ok - good)
        if tail:
            self.tails_copied += good
        else:
            self.copied += good
        HANDOFF_PAGES.labels("tail_copied" if tail else "copied").inc(good)
        return good, (out[:good] if good else None)

    def _stale(self, pages: int) -> None:
        self.stale += pages
        HANDOFF_PAGES.labels("stale").inc(pages)

    def _copy(
        self, want: list[tuple[SharedSegment, int, int, bytes]], page_bytes: int, device: torch.device
    ) -> torch.Tensor:
        if device.type == "cuda":
            buf = self._buffer(len(want) * page_bytes, device)
            out = buf[: len(want) * page_bytes].view(len(want), page_bytes)
            with self._lock:
                self._taken[out.data_ptr()] = buf
                while len(self._taken) > MAX_TAKEN_BUFFERS:
                    self._taken.pop(next(iter(self._taken)))
        else:
            out = torch.empty((len(want), page_bytes), dtype=torch.uint8, device=device)
        runs: list[tuple[SharedSegment, int, int, int]] = []  # segment, first slot, dst row, count
        for row, (seg, slot, _gen, _key) in enumerate(want):
            last = runs[-1] if runs else None
            if last is not None and last[0] is seg and last[1] + last[3] == slot:
                runs[-1] = (seg, last[1], last[2], last[3] + 1)
            else:
                runs.append((seg, slot, row, 1))
        if device.type != "cuda":
            for seg, slot, row, m in runs:
                out[row : row + m].copy_(seg.data[slot : slot + m])
            return out
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # `out` is allocated on that stream
        with torch.cuda.stream(stream):
            for seg, slot, row, m in runs:
                copy_to_device(out[row : row + m], seg.data[slot : slot + m])
        stream.synchronize()  # the copy must have landed before the stamps are read again
        return out

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A device buffer of at least nbytes, reused across pulls. A fresh [1024 x page] tensor
        per long pull went through the caching allocator, and, once the engine's own allocations
        had split its cached block, through cudaMalloc (or cudaFree under memory pressure, which
        synchronises the device): the decode steps overlapping a pull's start took 7-12 ms.
        Grown to the largest pull seen, then kept."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.device == device and b.numel() >= nbytes]
            if fits:  # by index: list.remove would compare tensors elementwise
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def release(self, pages: torch.Tensor) -> None:
        """Give back the buffer behind pages from fetch() once nothing reads them any more (the
        engine's import has landed). Pages not from a reused buffer are ignored."""
        with self._lock:
            buf = self._taken.pop(pages.data_ptr(), None)
            if buf is not None and len(self._free) < MAX_FREE_BUFFERS:
                self._free.append(buf)

    def close(self) -> None:
        with self._lock:
            for seg in self._maps.values():
                if seg is not None:
                    seg.close()
            self._maps.clear()

    def stats(self) -> dict[str, int]:
        return {
            "handoff_pages_copied": self.copied,
            "handoff_pages_stale": self.stale,
            "handoff_pages_unmapped": self.unmapped,
            "handoff_tail_pages_copied": self.tails_copied,
            "handoff_segments_premapped": self.premapped,
        }


def _intact(want: Sequence[tuple[SharedSegment, int, int, bytes]]) -> int:
    """How many leading pages still carry the (generation, key) the handoff recorded. Vectorised
    per segment: a 16k-token prompt's 1,024 stamps read one by one took ~2 ms of Python in the
    pull thread, twice per pull, and the decode loop waited for the GIL behind it (interference
    runs 10 and 12: 6-7 ms decode steps at each pull's start)."""
    n = len(want)
    if n == 0:
        return 0
    key_len = len(want[0][3])
    if any(len(w[3]) != key_len for w in want):  # mixed key sizes: one by one
        for i, (seg, slot, gen, key) in enumerate(want):
            if seg.stamp(slot) != (gen, key):
                return i
        return n
    slots = np.fromiter((w[1] for w in want), np.int64, n)
    gens = np.fromiter((w[2] for w in want), np.uint64, n)
    keys = np.frombuffer(b"".join(w[3] for w in want), np.uint8).reshape(n, key_len)
    ok = np.zeros(n, bool)
    segs = {id(w[0]): w[0] for w in want}
    seg_of = np.fromiter((id(w[0]) for w in want), np.int64, n)
    for sid, seg in segs.items():
        rows = np.flatnonzero(seg_of == sid)
        ok[rows] = seg.stamps_match(slots[rows], gens[rows], keys[rows])
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else n
