"""The gateway's bulk data plane: page put / prefix get over a plain TCP connection.

Why not the HTTP routes: a 112 MiB body through uvicorn's h11 parser and starlette (64 KiB flow
control windows, body joins) and httpx's h11 reader moved 40-100 MB/s on the 2-core dev machine and
~190 MB/s on the GPU host, 20-40x slower than recomputing the KV on an H200. Here a body is read
with `recv_into` straight into one preallocated buffer and pages are sent with `sendall` from the
stored bytes (no join, no per-page copy on either side), one round trip per batch, on persistent
connections. The HTTP routes stay (same frames, wire.py) for tools and as the client's fallback.

Framing, both directions (little-endian): `b"RKVD" | u16 op-or-status | u16 0 | u64 body length`,
then the body. A connection opens with op 3 HELLO (body: the run token, services/common/auth.py)
-> status 200, or 401 and the connection is closed; nothing else is served before it. Requests: op 1 PUT (body: a pages frame) -> status 200, body a PutReply (JSON);
op 2 GET_PREFIX (body: a keys frame) -> status 200, body a pages frame of the longest prefix of the
keys the store holds (stops at the first miss: a hash chain is only usable from its head).
Errors: status 400 (malformed body or unknown op), 413 (over kvstore.max_request_bytes; the body
is read and dropped), 500, with a UTF-8 message that starts with the field ("body: ...", "op: ...").
"""

from __future__ import annotations

import hmac
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from prometheus_client import Counter

from services.common.auth import token_from_env
from services.kvstore.tiers import TieredStore
from services.kvstore.wire import (
    _HEAD,
    KEY_BYTES,
    PAGES_MAGIC,
    FrameError,
    PutReply,
    decode_keys,
    decode_pages,
)

log = logging.getLogger(__name__)

MAGIC = b"RKVD"
HEADER = struct.Struct("<4sHHQ")
OP_PUT, OP_GET_PREFIX, OP_HELLO = 1, 2, 3
OK, BAD_REQUEST, UNAUTHORIZED, TOO_LARGE, SERVER_ERROR = 200, 400, 401, 413, 500
MAX_HELLO_BYTES = 1024
# Socket buffers: big enough that a 1.75 MiB page moves in few syscalls.
SOCK_BUF = 8 << 20
# A server connection keeps its receive buffer for the next request (page faults of a fresh one
# halve throughput), but not one above this: a few 512 MiB bodies would otherwise pin that much per
# connection, outside kvstore.ram_bytes.
KEEP_RX_BYTES = 64 << 20

DP_BYTES = Counter("relay_kvstore_dataplane_bytes", "page bytes moved by the data plane", ["op"])
DP_REQUESTS = Counter("relay_kvstore_dataplane_requests", "data plane requests", ["op", "status"])
_OP_NAMES = {OP_PUT: "put", OP_GET_PREFIX: "get_prefix"}


# Gives a writable buffer of at least n bytes (bytearray, a numpy array's memory, ...).
Allocator = Callable[[int], "bytearray | memoryview"]


class ProtocolError(ConnectionError):
    """The peer sent something that is not this protocol, or the connection broke mid-message."""


def recv_exact(sock: socket.socket, buf: bytearray | memoryview) -> None:
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ProtocolError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def _discard(sock: socket.socket, n: int) -> None:
    scratch = bytearray(min(n, 1 << 20))
    while n > 0:
        got = sock.recv_into(scratch, min(n, len(scratch)))
        if got == 0:
            raise ProtocolError("connection closed inside a discarded body")
        n -= got


def recv_header(sock: socket.socket) -> tuple[int, int]:
    head = bytearray(HEADER.size)
    recv_exact(sock, head)
    return parse_header(head)


def parse_header(head: bytes | bytearray) -> tuple[int, int]:
    magic, code, _pad, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"data plane magic {bytes(magic)!r}, expected {MAGIC!r}")
    return code, length


def send_parts(sock: socket.socket, code: int, parts: Sequence[bytes | memoryview]) -> None:
    """Header + parts, each sent from its own memory (sendall on a view: no join)."""
    total = sum(len(p) for p in parts)
    small = [HEADER.pack(MAGIC, code, 0, total)]
    for p in parts:
        if len(p) < 65536:
            small.append(bytes(p))  # coalesce small pieces (frame heads, keys) into one send
            continue
        sock.sendall(b"".join(small))
        small = []
        sock.sendall(p)
    if small:
        sock.sendall(b"".join(small))


def pages_frame_parts(keys: Sequence[bytes], pages: Sequence[bytes]) -> list[bytes | memoryview]:
    """A pages frame (wire.py) as parts: its head, then every page as stored (not copied)."""
    head = _HEAD.pack(PAGES_MAGIC, len(keys)) + b"".join(keys)
    lengths = struct.pack(f"<{len(pages)}I", *(len(p) for p in pages))
    return [head + lengths, *pages]


def parse_pages_reply(body: memoryview) -> tuple[list[bytes], list[int], memoryview]:
    """(keys, page lengths, the pages' bytes concatenated as a view into `body`)."""
    view = memoryview(body)
    if len(view) < _HEAD.size:
        raise FrameError("pages frame shorter than its header")
    magic, count = _HEAD.unpack_from(view, 0)
    if magic != PAGES_MAGIC:
        raise FrameError(f"frame magic {bytes(magic)!r}, expected {PAGES_MAGIC!r}")
    keys_end = _HEAD.size + count * KEY_BYTES
    lens_end = keys_end + 4 * count
    if len(view) < lens_end:
        raise FrameError("pages frame truncated in its keys or lengths")
    keys = [bytes(view[_HEAD.size + i * KEY_BYTES : _HEAD.size + (i + 1) * KEY_BYTES]) for i in range(count)]
    lengths = list(struct.unpack_from(f"<{count}I", view, keys_end))
    if len(view) != lens_end + sum(lengths):
        raise FrameError("pages frame lengths do not match its body")
    return keys, lengths, view[lens_end:]


class DataPlaneServer:
    """Accepts connections on its own port; one thread per connection (a handful of decode and
    prefill replicas per gateway). Socket I/O releases the GIL, so the HTTP side stays responsive."""

    def __init__(
        self,
        store: Callable[[], TieredStore | None],
        host: str,
        max_request_bytes: int,
        token: str | None = None,
    ):
        self.store, self.max_request_bytes = store, max_request_bytes
        self.token = token or token_from_env()
        self.sock = socket.create_server((host, 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()  # joined by close(), before the store closes
        self._rx: dict[socket.socket, int] = {}  # receive buffer bytes each connection holds
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kv-dataplane", daemon=True)

    def start(self) -> DataPlaneServer:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _addr = self.sock.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                conn.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
            t = threading.Thread(target=self._serve, args=(conn,), name="kv-dataplane-conn", daemon=True)
            with self._lock:
                if self._closed:  # close() already shut the others down: do not start another
                    conn.close()
                    return
                self._conns.add(conn)
                self._threads.add(t)
            t.start()

    def _hello(self, conn: socket.socket) -> bool:
        """The connection's first message must be HELLO with the run token."""
        op, length = recv_header(conn)
        if op != OP_HELLO or length > MAX_HELLO_BYTES:
            send_parts(conn, UNAUTHORIZED, [b"token: open the connection with HELLO and the run token"])
            return False
        got = bytearray(length)
        recv_exact(conn, got)
        if not hmac.compare_digest(bytes(got), self.token.encode()):
            send_parts(conn, UNAUTHORIZED, [b"token: not the run token"])
            return False
        send_parts(conn, OK, [])
        return True

    def _serve(self, conn: socket.socket) -> None:
        rx = bytearray()
        try:
            try:
                if not self._hello(conn):
                    DP_REQUESTS.labels("hello", str(UNAUTHORIZED)).inc()
                    return
            except (ProtocolError, OSError):
                return
            while True:
                try:
                    op, length = recv_header(conn)
                except (ProtocolError, OSError):
                    return  # the client went away (or spoke something else): drop the connection
                name = _OP_NAMES.get(op, "unknown")
                if length > self.max_request_bytes:
                    # Read the body and drop it, so the sender (blocked in its send) gets the answer
                    # and the connection stays in step; only this connection's thread pays.
                    _discard(conn, length)
                    msg = f"body: {length} bytes exceeds kvstore.max_request_bytes={self.max_request_bytes}"
                    DP_REQUESTS.labels(name, str(TOO_LARGE)).inc()
                    send_parts(conn, TOO_LARGE, [msg.encode()])
                    continue
                # One receive buffer per connection, reused: a fresh 100 MB bytearray costs its page
                # faults (measured: half the loopback throughput). Pages are copied out of it.
                if len(rx) < length:
                    rx = bytearray(length)
                body = memoryview(rx)[:length]
                recv_exact(conn, body)
                status, parts = self._handle(op, body)
                del body
                if len(rx) > KEEP_RX_BYTES:
                    rx = bytearray()  # parts never view rx (pages are the store's, replies new bytes)
                with self._lock:
                    self._rx[conn] = len(rx)
                DP_REQUESTS.labels(name, str(status)).inc()
                send_parts(conn, status, parts)
        except (ProtocolError, OSError) as e:
            log.debug(f"data plane connection ended: {e}")
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._rx.pop(conn, None)
                self._threads.discard(threading.current_thread())
            conn.close()

    @property
    def buffered_bytes(self) -> int:
        """Receive buffer bytes the open connections hold between requests."""
        with self._lock:
            return sum(self._rx.values())

    def _handle(self, op: int, body: memoryview) -> tuple[int, list[bytes | memoryview]]:
        store = self.store()
        if store is None:
            return SERVER_ERROR, [b"store: starting"]
        try:
            if op == OP_PUT:
                pages = decode_pages(body)
                stored = nbytes = 0
                for key, page in pages:
                    if store.put(key, bytes(page)):  # the one copy: the store owns its pages
                        stored += 1
                        nbytes += len(page)
                DP_BYTES.labels("put").inc(nbytes)
                return OK, [PutReply(stored=stored, bytes=nbytes).model_dump_json().encode()]
            if op == OP_GET_PREFIX:
                keys = decode_keys(bytes(body))
                pages = store.get_prefix(keys)
                DP_BYTES.labels("get_prefix").inc(sum(len(p) for p in pages))
                return OK, pages_frame_parts(keys[: len(pages)], pages)
            return BAD_REQUEST, [f"op: unknown data plane op {op}".encode()]
        except FrameError as e:
            return BAD_REQUEST, [f"body: {e}".encode()]
        except Exception as e:  # noqa: BLE001 - answer, keep serving; the store logs its tiers' errors
            log.exception("data plane request failed")
            return SERVER_ERROR, [f"store: {type(e).__name__}: {e}".encode()]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection and wait (up to timeout_s) for their threads, so
        none is still inside the store when the caller closes it."""
        with self._lock:
            self._closed = True
        # shutdown() wakes a thread blocked in accept(); close() alone does not on Linux.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in threads if t.is_alive()]
        if alive:
            log.warning(f"data plane close: {len(alive)} connection threads still running after {timeout_s}s")


class DataPlaneError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class DataPlaneConnection:
    """One persistent client connection. Not thread-safe: the client keeps a pool of them."""

    def __init__(self, host: str, port: int, timeout_s: float, token: str | None = None):
        # Whether any byte of the last call's reply arrived: if none did, the gateway never acted
        # on the request (or a restart dropped it) and the caller may safely send it again.
        self.replied = False
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        try:
            self.call(OP_HELLO, [(token or token_from_env()).encode()])
        except BaseException:
            self.sock.close()
            raise

    def call(
        self, op: int, parts: Sequence[bytes | memoryview], alloc: Allocator | None = None
    ) -> memoryview:
        """Send a request, receive its reply's body. `alloc(n)` gives the buffer an OK reply's body
        is received into (e.g. a reused pinned staging buffer), at least n bytes; default a new
        bytearray. Returns a view of the body (the buffer's first n bytes)."""
        self.replied = False
        send_parts(self.sock, op, parts)
        head = bytearray(HEADER.size)
        got = self.sock.recv_into(head)  # blocks until the reply starts
        if got == 0:
            raise ProtocolError("connection closed before the reply")
        self.replied = True
        recv_exact(self.sock, memoryview(head)[got:])
        status, length = parse_header(head)
        if status != OK:
            msg = bytearray(length)
            recv_exact(self.sock, msg)
            raise DataPlaneError(status, msg.decode(errors="replace"))
        body = memoryview(alloc(length) if alloc is not None else bytearray(length)).cast("B")[:length]
        recv_exact(self.sock, body)
        return body

    def close(self) -> None:
        self.sock.close()
