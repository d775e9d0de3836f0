"""Client side of the KV store gateway: batched page get/put, gateway discovery with back-off,
and the background publisher that decode and prefill engines hand their finished pages to.

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

import httpx

from services.kvstore.wire import (
    MEDIA_TYPE,
    FrameError,
    PutReply,
    StoreStats,
    decode_pages,
    encode_keys,
    encode_uniform_pages,
)

log = logging.getLogger(__name__)

# Pages per HTTP call: bounds one body (a 0.6B-model page of 16 tokens is ~1.8 MB in bf16).
MAX_PAGES_PER_CALL = 64


class KVStoreClient:
    """Synchronous client of one gateway (or of whichever one `locate()` returns)."""

    def __init__(
        self,
        url: str | Callable[[], str | None],
        timeout_s: float = 10.0,
        retry_after_s: float = 5.0,
        max_call_bytes: int = 64 << 20,
    ):
        self.max_call_bytes = max_call_bytes  # a put body stays under the gateway's max_request_bytes
        self._locate = (lambda: url) if isinstance(url, str) else url
        self.retry_after_s = retry_after_s
        self.http = httpx.Client(timeout=timeout_s, headers={"content-type": MEDIA_TYPE})
        self._down_until = 0.0
        self.failures = 0

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

    def get_prefix(self, keys: list[bytes]) -> tuple[list[bytes], bytes]:
        """The longest prefix of `keys` (a hash chain) the store has: (its keys, their bytes
        concatenated). A chain is only usable from its head, so lookup stops at the first miss."""
        url = self.url()
        if url is None or not keys:
            return [], b""
        got_keys: list[bytes] = []
        chunks: list[bytes] = []
        try:
            for start in range(0, len(keys), MAX_PAGES_PER_CALL):
                want = keys[start : start + MAX_PAGES_PER_CALL]
                r = self.http.post(f"{url}/v1/pages/get", content=encode_keys(want))
                r.raise_for_status()
                pages = dict(decode_pages(r.content))
                for k in want:
                    page = pages.get(k)
                    if page is None:
                        return got_keys, b"".join(chunks)
                    got_keys.append(k)
                    chunks.append(bytes(page))
        except (httpx.HTTPError, FrameError) as e:
            self._failed("get", e)
            return [], b""
        return got_keys, b"".join(chunks)

    def put(self, keys: list[bytes], data: bytes, page_bytes: int) -> int:
        """Store len(keys) pages of page_bytes each; returns how many the gateway stored (0 when
        it is unreachable)."""
        url = self.url()
        if url is None or not keys:
            return 0
        stored = 0
        view = memoryview(data)
        # Header, keys and lengths are 20 bytes a page on top of the page itself.
        per_call = max(1, min(MAX_PAGES_PER_CALL, (self.max_call_bytes - 8) // (page_bytes + 20)))
        try:
            for start in range(0, len(keys), per_call):
                ks = keys[start : start + per_call]
                chunk = view[start * page_bytes : (start + len(ks)) * page_bytes]
                r = self.http.put(
                    f"{url}/v1/pages", content=encode_uniform_pages(ks, bytes(chunk), page_bytes)
                )
                r.raise_for_status()
                stored += PutReply.model_validate_json(r.content).stored
        except httpx.HTTPError as e:
            self._failed("put", e)
        return stored

    def stats(self) -> StoreStats:
        url = self.url()
        if url is None:
            raise ConnectionError("no kv store gateway")
        r = self.http.get(f"{url}/v1/stats")
        r.raise_for_status()
        return StoreStats.model_validate_json(r.content)

    def close(self) -> None:
        self.http.close()


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
        self._q: queue.Queue[tuple[list[bytes], bytes, list[str]] | None] = queue.Queue()
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

    def __call__(self, keys: list[bytes], data: bytes, finished: list[str]) -> None:
        """The engine's page sink (kv_transfer.PageSink)."""
        with self._lock:
            full = bool(data) and self._queued_bytes + len(data) > self.max_queue_bytes
            if not full:
                self._queued_bytes += len(data)
        if full:
            self.batches_dropped += 1
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
            with self._lock:
                self._queued_bytes -= len(data)
            self._resolve(finished, stored)
            self._q.task_done()

    def flush(self) -> None:
        """Wait until everything handed over so far is stored (or given up)."""
        self._q.join()

    def close(self, timeout_s: float = 5.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)
