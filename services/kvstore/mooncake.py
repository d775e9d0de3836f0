"""The Mooncake Store tier: KV pages pooled across nodes in a real Mooncake Store over TCP.

A `mooncake_master` (started by the launcher: `python -m services.kvstore.master`) keeps the object
index; every gateway is a store client that contributes `segment_bytes` of its RAM to the pool and
reads and writes pages by key. Any gateway can read a page another one wrote, which is what makes
the pool span nodes. Data lives in the contributing clients' segments: a page survives the gateway
that reads it, not the one whose segment holds it.

The `mooncake` module comes from the optional `kv` extra (services/kvstore/install_mooncake.sh).
"""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

from services.common.config import MooncakeSection
from services.kvstore.tiers import IndexedTier


class MooncakeUnavailable(RuntimeError):
    """The extra is not installed or the master cannot be reached."""


def master_binary() -> str:
    """mooncake_master next to this Python (the venv's bin), else on PATH."""
    local = Path(sys.executable).parent / "mooncake_master"
    if local.exists():
        return str(local)
    found = shutil.which("mooncake_master")
    if found is None:
        raise MooncakeUnavailable(
            "mooncake_master not found: run services/kvstore/install_mooncake.sh (installs the kv extra)"
        )
    return found


def master_argv(sec: MooncakeSection) -> list[str]:
    return [master_binary(), *master_flags(sec)]


def master_flags(sec: MooncakeSection) -> list[str]:
    """The master's flags. It authenticates no one, so it listens on `master_host` only (loopback
    by default: the gateway that uses it runs on the same host; docs/security.md)."""
    argv = [
        f"--rpc_port={sec.rpc_port}",
        f"--rpc_address={sec.master_host}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={sec.master_host}",
        f"--http_metadata_server_port={sec.metadata_port}",
        # Pages are read once per admission: a short lease lets an over-budget gateway remove them.
        "--default_kv_lease_ttl=1000",
    ]
    if sec.metrics_port:
        argv.append(f"--metrics_port={sec.metrics_port}")
    return argv


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MooncakeTier(IndexedTier):
    """LRU over the pages this gateway put, under `budget_bytes`; lookups also find pages other
    gateways put (the pool is shared), and a page read is copied up, never removed from the pool."""

    exclusive = False

    def __init__(self, sec: MooncakeSection, local_host: str = "127.0.0.1"):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise MooncakeUnavailable(
                f"mooncake is not installed ({e}): run services/kvstore/install_mooncake.sh"
            ) from None
        if not sec.rpc_port or not sec.metadata_port:
            raise MooncakeUnavailable(
                "kvstore.mooncake.rpc_port/metadata_port are not set (the launcher sets them)"
            )
        super().__init__("mooncake", sec.budget_bytes)
        self.store = MooncakeDistributedStore()
        # With the HTTP metadata server every client needs its own host:port (its TCP endpoint).
        rc = self.store.setup(
            f"{local_host}:{_free_port(local_host)}",
            f"http://{sec.master_host}:{sec.metadata_port}/metadata",
            sec.segment_bytes,
            sec.buffer_bytes,
            "tcp",
            "",
            f"{sec.master_host}:{sec.rpc_port}",
        )
        if rc != 0:
            raise MooncakeUnavailable(
                f"mooncake store setup failed ({rc}) with master {sec.master_host}:{sec.rpc_port}"
            )

    @staticmethod
    def _key(key: bytes) -> str:
        return "relay-kv-" + key.hex()

    def get(self, key: bytes) -> bytes | None:
        data = self.store.get(self._key(key))
        if not data:
            self._forget(key)  # evicted by the pool itself (or never here)
            return None
        if key in self._index:
            self._index.move_to_end(key)
        return bytes(data)

    def put(self, key: bytes, data: bytes) -> bool:
        if key in self._index:
            self._index.move_to_end(key)
            return True
        rc = self.store.put(self._key(key), data)
        if rc != 0:
            # Another gateway may have put the same page first: then it is there all the same.
            return bool(self.store.is_exist(self._key(key)) == 1)
        self._remember(key, len(data))
        return True

    def discard(self, key: bytes) -> None:
        if key in self._index:
            self.store.remove(self._key(key), True)
            self._forget(key)

    def pop_lru(self) -> tuple[bytes, bytes] | None:
        """Drop this gateway's least recently used page from the pool (the last tier: nothing is
        below it, so the page's bytes are not read back)."""
        if not self._index:
            return None
        key = next(iter(self._index))
        self.store.remove(self._key(key), True)
        self._forget(key)
        return key, b""

    def close(self) -> None:
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 - closing at shutdown: nothing left to do about it
            pass
