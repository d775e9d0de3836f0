"""Client side of the KV store gateway: batched page get/put, gateway discovery with back-off,
and the background publisher that decode and prefill engines hand their finished pages to.

With a near tier (`client.near`, near_cache.py: pinned host RAM in this process) in front of the
gateway, a put is written through to it and a get is served from it first: only the pages after
its leading run are asked of the gateway, and those fill it on the way back.

Every call is best effort by design: a gateway that is down, slow or missing pages means the
engine computes those tokens itself, never that a request fails. A failed gateway is skipped for
`retry_after_s` so requests do not each wait out a timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from urllib.parse import urlsplit

import httpx

from services.common.auth import bearer, token_from_env
from services.kvstore.dataplane import (
    OP_GET_PREFIX,
    OP_PUT,
    Allocator,
    DataPlaneConnection,
    DataPlaneError,
    ProtocolError,
    parse_pages_reply,
)
from services.kvstore.near_cache import NearCache, NearRun
from services.kvstore.wire import (
    _HEAD,
    MEDIA_TYPE,
    PAGES_MAGIC,
    DataPlaneInfo,
    FrameError,
    PutReply,
    StoreStats,
    decode_pages,
    encode_keys,
    encode_uniform_pages,
)

log = logging.getLogger(__name__)

# Pages per HTTP call (the fallback path): bounds one body (a 0.6B-model page of 16 tokens is
# ~1.8 MB in bf16). The data plane sends a whole prefix get in one round trip.
MAX_PAGES_PER_CALL = 64
# Errors that mean "this gateway is not usable now": the caller computes instead.
_TRANSPORT_ERRORS = (httpx.HTTPError, FrameError, DataPlaneError, ProtocolError, OSError)


class KVStoreClient:
    """Synchronous client of one gateway (or of whichever one `locate()` returns). Thread-safe:
    the page publisher's thread and request threads share it.

    Bulk transfers go over the gateway's data plane (dataplane.py: raw TCP, bodies received into
    one buffer, pages sent from memory, one round trip per batch, pooled connections) when the
    gateway advertises one at GET /v1/dataplane; otherwise over the HTTP routes."""

    def __init__(
        self,
        url: str | Callable[[], str | None],
        timeout_s: float = 10.0,
        retry_after_s: float = 5.0,
        max_call_bytes: int = 64 << 20,
        dataplane: bool = True,
        near: NearCache | None = None,
        token: str | None = None,
    ):
        self.max_call_bytes = max_call_bytes  # a put body stays under the gateway's max_request_bytes
        self._locate = (lambda: url) if isinstance(url, str) else url
        self.retry_after_s, self.timeout_s = retry_after_s, timeout_s
        self.token = token or token_from_env()  # the run's (services/common/auth.py)
        self.http = httpx.Client(
            timeout=timeout_s, headers={"content-type": MEDIA_TYPE, **bearer(self.token)}
        )
        self.use_dataplane = dataplane
        self._planes: dict[str, tuple[str, int] | None] = {}  # gateway URL -> data plane address
        self._idle: dict[tuple[str, int], list[DataPlaneConnection]] = {}
        self._pool_lock = threading.Lock()
        self._tls = threading.local()  # per thread: seconds of its last data plane round trip
        self._down_until = 0.0
        self.failures = 0
        # In-process tier in front of the gateway (None: off); set by whoever knows the engine's
        # page layout (services/kvstore/router.py, near_cache.near_for_engine).
        self.near = near

    def url(self) -> str | None:
        if time.monotonic() < self._down_until:
            return None
        try:
            return self._locate()
        except Exception as e:  # noqa: BLE001 - discovery (Redis) failing is the same as no gateway
            log.warning(f"kv store discovery failed: {e}")
            return None

    def _failed(self, what: str, e: Exception) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + self.retry_after_s
        log.warning(
            f"kv store {what} failed ({type(e).__name__}: {e}); local compute for {self.retry_after_s}s"
        )

    # ------------------------------------------------------------------ data plane

    def _plane(self, url: str) -> tuple[str, int] | None:
        """The gateway's data plane address, asked once per URL; None: HTTP only (an older
        gateway without the route)."""
        if not self.use_dataplane:
            return None
        if url not in self._planes:
            r = self.http.get(f"{url}/v1/dataplane")
            if r.status_code == 404:
                self._planes[url] = None
            else:
                r.raise_for_status()
                host = urlsplit(url).hostname or "127.0.0.1"
                self._planes[url] = (host, DataPlaneInfo.model_validate_json(r.content).port)
        return self._planes[url]

    def _call(
        self,
        addr: tuple[str, int],
        url: str,
        op: int,
        parts: list[bytes | memoryview],
        alloc: Allocator | None = None,
    ) -> memoryview:
        """One request over a pooled (else new) connection. A failure before any reply byte (a
        pooled connection the gateway dropped, a refused connect: a restarted gateway listens on
        a new data plane port) is retried once, on a fresh connection to the address the gateway
        advertises now; both ops are idempotent (a put stores content-addressed pages)."""
        for attempt in (0, 1):
            with self._pool_lock:
                idle = self._idle.setdefault(addr, [])
                conn = idle.pop() if idle else None
            try:
                if conn is None:
                    conn = DataPlaneConnection(*addr, timeout_s=self.timeout_s, token=self.token)
                t0 = time.perf_counter()
                body = conn.call(op, parts, alloc)
                self._tls.call_s = time.perf_counter() - t0
            except BaseException as e:
                replied = conn is not None and conn.replied
                if conn is not None:
                    conn.close()  # mid-message or broken: not reusable
                if not isinstance(e, (OSError, DataPlaneError)):
                    raise  # not the gateway's doing (e.g. alloc failed): its address still holds
                self._forget(addr, url)
                # A timeout is not retried: a hung gateway would cost the caller twice the wait.
                retry = isinstance(e, OSError) and not isinstance(e, TimeoutError) and not replied
                if attempt == 0 and retry:
                    fresh = self._plane(url)
                    if fresh is not None:
                        log.info(f"kv data plane {addr} failed before replying ({e}); retrying at {fresh}")
                        addr = fresh
                        continue
                raise
            with self._pool_lock:
                self._idle.setdefault(addr, []).append(conn)
            return body
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _forget(self, addr: tuple[str, int], url: str) -> None:
        """Drop what is known about a failed data plane: its idle connections (the peer is likely
        gone for all of them) and the address (asked again next time: a restarted gateway has a
        new data plane port)."""
        with self._pool_lock:
            stale = self._idle.pop(addr, [])
        for c in stale:
            c.close()
        self._planes.pop(url, None)

    def take_call_seconds(self) -> float | None:
        """Seconds of this thread's last data plane round trip (request sent -> reply received),
        then forgotten; None if there was none. Unlike the caller's wall time it leaves out
        one-off costs (discovery, connecting), which must not be mistaken for pull latency."""
        seconds = getattr(self._tls, "call_s", None)
        self._tls.call_s = None
        return seconds

    # ------------------------------------------------------------------ pages

    def get_prefix(
        self, keys: list[bytes], alloc: Allocator | None = None, page_bytes: int | None = None
    ) -> tuple[list[bytes], bytes | memoryview]:
        """The longest prefix of `keys` (a hash chain) the store has: (its keys, their bytes
        concatenated). A chain is only usable from its head, so lookup stops at the first miss.
        Over the data plane the bytes are a view into the one buffer the reply was received into:
        `alloc(n)` supplies it (a reused staging buffer), else a new bytearray; the page bytes are
        that buffer's last len(bytes) of its first n bytes (a prefix of them if truncated).
        `page_bytes`: the prefix also stops at the first page of another length (a page cut short
        by a gateway crash, or of another layout), which an engine could not import.
        With a near tier, its leading run is joined in front of the gateway's pages (a copy: an
        engine pulls with `get_prefix_near`, which hands near pages over without one)."""
        run, got, data = self.get_prefix_near(keys, alloc, page_bytes)
        if run is None or not len(run):
            if run is not None:
                run.release()
            return got, data
        try:
            near = run.tobytes()
        finally:
            run.release()
        return [*run.keys, *got], near + bytes(data)

    def get_prefix_near(
        self,
        keys: list[bytes],
        alloc: Allocator | None = None,
        page_bytes: int | None = None,
        near_limit: int | None = None,
    ) -> tuple[NearRun | None, list[bytes], bytes | memoryview]:
        """The longest prefix of `keys` available: (the near tier's leading run, held: release it
        once copied; the keys after it the gateway had; their bytes, as in `_get_remote`). The
        gateway is asked only for the keys after the near run, so a fully near prefix costs no
        round trip, and a gateway that is down still leaves the near run. The remote pages are
        stored in the near tier too. `near_limit`: take at most that many pages from the near
        tier (the rest are asked of the gateway)."""
        run = None
        near = self.near
        if near is not None and (page_bytes is None or page_bytes == near.page_bytes):
            run = near.acquire(keys if near_limit is None else keys[:near_limit])
        rest = keys[len(run) :] if run is not None else keys
        try:
            got, data = self._get_remote(rest, alloc, page_bytes)
        except BaseException:
            if run is not None:
                run.release()
            raise
        if near is not None and got and run is not None and len(data) == len(got) * near.page_bytes:
            near.put(got, data)  # fill: the next turn's pull of these pages is a near hit
        return run, got, data

    def _get_remote(
        self, keys: list[bytes], alloc: Allocator | None, page_bytes: int | None
    ) -> tuple[list[bytes], bytes | memoryview]:
        url = self.url()
        if url is None or not keys:
            return [], b""
        try:
            addr = self._plane(url)
            if addr is None:
                t0 = time.perf_counter()
                got, data, lengths = self._get_prefix_http(url, keys)
                self._tls.call_s = time.perf_counter() - t0  # the round trips, as on the data plane
            else:
                body = self._call(addr, url, OP_GET_PREFIX, [encode_keys(keys)], alloc)
                got, lengths, data = parse_pages_reply(body)
                if got != keys[: len(got)]:
                    raise FrameError("gateway answered keys that are not a prefix of the request")
        except _TRANSPORT_ERRORS as e:
            self._failed("get", e)
            return [], b""
        if page_bytes is not None:
            good = next((i for i, n in enumerate(lengths) if n != page_bytes), len(lengths))
            if good < len(got):
                log.warning(
                    f"kv store page {good} of {len(got)} is {lengths[good]} bytes, not {page_bytes}: "
                    "using the pages before it"
                )
                got, data = got[:good], data[: good * page_bytes]
        return got, data

    def _get_prefix_http(self, url: str, keys: list[bytes]) -> tuple[list[bytes], bytes, list[int]]:
        lengths: list[int] = []
        got, data = http_get_prefix(self.http, url, keys, lengths=lengths)
        return got, data, lengths

    def put(self, keys: list[bytes], data: bytes | bytearray | memoryview | NearRun, page_bytes: int) -> int:
        """Store len(keys) pages of page_bytes each; returns how many the gateway stored (0 when
        it is unreachable). Written through to the near tier first (also when the gateway is
        down: this process can still reuse them). `data` may be a NearRun (pages an engine
        exported into the near tier, hold_export): sent from its slots, not copied."""
        size = data.nbytes if isinstance(data, NearRun) else len(data)
        if size != len(keys) * page_bytes:
            raise ValueError(f"{size} bytes for {len(keys)} pages of {page_bytes} bytes")
        if (
            self.near is not None
            and keys
            and page_bytes == self.near.page_bytes
            and not isinstance(data, NearRun)
        ):
            self.near.put(keys, data)
        url = self.url()
        if url is None or not keys:
            return 0
        stored = 0
        view = memoryview(data).cast("B") if not isinstance(data, NearRun) else None
        # Header, keys and lengths are 20 bytes a page on top of the page itself.
        per_call = max(1, (self.max_call_bytes - _HEAD.size) // (page_bytes + 20))
        try:
            addr = self._plane(url)
            if addr is None:
                per_call = min(per_call, MAX_PAGES_PER_CALL)
            for start in range(0, len(keys), per_call):
                ks = keys[start : start + per_call]
                if view is not None:
                    chunks = [view[start * page_bytes : (start + len(ks)) * page_bytes]]
                else:
                    assert isinstance(data, NearRun)
                    chunks = data.byte_views(start, len(ks))
                if addr is None:
                    frame = encode_uniform_pages(ks, b"".join(chunks), page_bytes)
                    r = self.http.put(f"{url}/v1/pages", content=frame)
                    r.raise_for_status()
                    body: bytes = r.content
                else:
                    # The frame's head, then the caller's bytes as they are (no copy).
                    head = _HEAD.pack(PAGES_MAGIC, len(ks)) + b"".join(ks)
                    lengths = struct_lengths(len(ks), page_bytes)
                    body = bytes(self._call(addr, url, OP_PUT, [head + lengths, *chunks]))
                stored += PutReply.model_validate_json(body).stored
        except _TRANSPORT_ERRORS as e:
            self._failed("put", e)
        return stored

    def near_stats(self) -> dict[str, int]:
        """The near tier's counters (empty when it is off)."""
        return self.near.stats() if self.near is not None else {}

    def stats(self) -> StoreStats:
        url = self.url()
        if url is None:
            raise ConnectionError("no kv store gateway")
        r = self.http.get(f"{url}/v1/stats")
        r.raise_for_status()
        return StoreStats.model_validate_json(r.content)

    def close(self) -> None:
        with self._pool_lock:
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in conns:
            c.close()
        self.http.close()


def http_get_prefix(
    http: httpx.Client,
    url: str,
    keys: list[bytes],
    pages_per_call: int = MAX_PAGES_PER_CALL,
    copy_pages: bool = False,
    lengths: list[int] | None = None,
) -> tuple[list[bytes], bytes]:
    """The longest prefix of `keys` the gateway at `url` has, over its HTTP routes
    (`pages_per_call` pages a call): (its keys, their bytes concatenated). `lengths`, if given,
    gets each page's length appended. `copy_pages` copies each page into bytes of its own before
    the join (a baseline that measures what the copies cost)."""
    got_keys: list[bytes] = []
    chunks: list[bytes | memoryview] = []
    for start in range(0, len(keys), pages_per_call):
        want = keys[start : start + pages_per_call]
        r = http.post(f"{url}/v1/pages/get", content=encode_keys(want))
        r.raise_for_status()
        pages = dict(decode_pages(r.content))
        for k in want:
            page = pages.get(k)
            if page is None:
                return got_keys, b"".join(chunks)
            got_keys.append(k)
            chunks.append(bytes(page) if copy_pages else page)
            if lengths is not None:
                lengths.append(len(page))
    return got_keys, b"".join(chunks)


def struct_lengths(count: int, page_bytes: int) -> bytes:
    """`count` little-endian u32 lengths of `page_bytes` (a uniform pages frame's length table)."""
    return page_bytes.to_bytes(4, "little") * count


def _size(data: bytes | bytearray | memoryview | NearRun) -> int:
    return data.nbytes if isinstance(data, NearRun) else len(data)


class PagePublisher:
    """Pushes pages to the gateway from a background thread, so an engine's loop thread only pays
    for the export copy. `expect(request_id)` before submitting gives a future that resolves once
    the pages exported when that request finished are stored (a prefill service answers only then).
    The queue is bounded in bytes: under back-pressure whole batches are dropped (the pages are
    recomputed when needed), never the engine stalled."""

    def __init__(self, client: KVStoreClient, page_bytes: int, max_queue_bytes: int = 4 << 30):
        self.client, self.page_bytes = client, page_bytes
        self.max_queue_bytes = max_queue_bytes
        self._queued_bytes = 0
        self._q: queue.Queue[tuple[list[bytes], bytes | NearRun, list[str]] | None] = queue.Queue()
        self._futures: dict[str, Future[int]] = {}
        self._lock = threading.Lock()
        self.pages_published = 0
        self.batches_dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-publisher", daemon=True)
        self._thread.start()

    def expect(self, request_id: str) -> Future[int]:
        fut: Future[int] = Future()
        with self._lock:
            self._futures[request_id] = fut
        return fut

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._futures.pop(request_id, None)

    def __call__(self, keys: list[bytes], data: bytes | NearRun, finished: list[str]) -> None:
        """The engine's page sink (kv_transfer.PageSink). `data` may be near-tier slots the pages
        were exported into (held: released once sent, or dropped)."""
        size = _size(data)
        with self._lock:
            full = size > 0 and self._queued_bytes + size > self.max_queue_bytes
            if not full:
                self._queued_bytes += size
        if full:
            self.batches_dropped += 1
            if isinstance(data, NearRun):
                data.release()  # the pages stay in the near tier; only the gateway misses them
            self._resolve(finished, 0)
            return
        self._q.put_nowait((keys, data, finished))

    def _resolve(self, request_ids: list[str], stored: int) -> None:
        with self._lock:
            futs = [self._futures.pop(r, None) for r in request_ids]
        for f in futs:
            if f is not None and not f.done():
                f.set_result(stored)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            keys, data, finished = item
            stored = 0
            try:
                stored = self.client.put(keys, data, self.page_bytes)
                self.pages_published += stored
            except Exception:  # noqa: BLE001 - best effort: never kill the publisher thread
                log.exception("publishing kv pages failed")
            finally:
                if isinstance(data, NearRun):
                    data.release()
            with self._lock:
                self._queued_bytes -= _size(data)
            self._resolve(finished, stored)
            self._q.task_done()

    def flush(self) -> None:
        """Wait until everything handed over so far is stored (or given up)."""
        self._q.join()

    def close(self, timeout_s: float = 5.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)
