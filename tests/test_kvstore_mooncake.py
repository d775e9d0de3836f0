"""The Mooncake Store tier with a real `mooncake_master` (started the way the launcher starts it,
`python -m services.kvstore.master`) and two gateway processes as store clients over TCP: a page one
gateway puts (directly, or demoted from its RAM tier) is read by the other. Installs the `kv` extra
and its apt libraries on demand (services/kvstore/install_mooncake.sh); skips only where it cannot."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.service_process import start_with_config, wait_registered

from services.common.bus import Bus
from services.common.config import REPO_ROOT, RunConfig
from services.kvstore.client import KVStoreClient

INSTALL = REPO_ROOT / "services" / "kvstore" / "install_mooncake.sh"


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def page(i: int, n: int) -> bytes:
    return bytes([i % 256]) * n


def start_gateway(tmp: Path, redis_url: str, cfg: RunConfig, name: str) -> subprocess.Popen[bytes]:
    return start_with_config("services.kvstore", cfg, redis_url, tmp, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mooncake_cfg(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunConfig, Path]]:
    proc = subprocess.run(["bash", str(INSTALL), sys.executable], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(f"cannot install the Mooncake tier here: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"install_mooncake.sh failed:\n{proc.stdout}\n{proc.stderr}"
    tmp = tmp_path_factory.mktemp("mooncake")
    cfg = RunConfig()
    cfg.redis.prefix = f"test-mooncake-{uuid.uuid4().hex[:8]}"
    cfg.redis.heartbeat_s = 0.2
    cfg.kvstore.enabled = True
    mc = cfg.kvstore.mooncake
    mc.enabled = True
    mc.rpc_port, mc.metadata_port = free_port(), free_port()
    mc.segment_bytes, mc.buffer_bytes, mc.budget_bytes = 16 << 20, 8 << 20, 8 << 20
    (tmp / "config.json").write_text(cfg.dump())
    with open(tmp / "master.log", "wb") as out:
        master = subprocess.Popen(
            [sys.executable, "-m", "services.kvstore.master", "--config", str(tmp / "config.json")],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield cfg, tmp
    finally:
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(15)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()


def test_pages_cross_gateway_processes_through_the_pool(
    redis_url: str, mooncake_cfg: tuple[RunConfig, Path]
) -> None:
    base, tmp = mooncake_cfg
    bus = Bus(redis_url, base.redis.prefix)
    a_cfg = base.model_copy(deep=True)
    a_cfg.kvstore.ram_bytes = 3000  # small: most of A's pages are demoted into the pool
    b_cfg = base.model_copy(deep=True)
    b_cfg.kvstore.ram_bytes = 0  # B keeps nothing itself: every read is a pool read
    a = start_gateway(tmp, redis_url, a_cfg, "gw-a")
    b = start_gateway(tmp, redis_url, b_cfg, "gw-b")
    try:
        urls = wait_registered(bus, "kvstore", a, tmp / "gw-a.log", n=2, timeout_s=90)
        url_a = next(u for u in urls if httpx.get(f"{u}/health").json()["id"].endswith(str(a.pid)))
        url_b = next(u for u in urls if u != url_a)
        ca, cb = KVStoreClient(url_a), KVStoreClient(url_b)
        keys = [key(5000 + i) for i in range(10)]
        data = b"".join(page(i, 1000) for i in range(10))
        assert ca.put(keys, data, 1000) == 10
        sa = ca.stats()
        assert [t.name for t in sa.tiers] == ["ram", "mooncake"]
        assert sa.tiers[0].demotions >= 7 and sa.tiers[1].pages >= 7  # demoted into the pool

        # B never saw a put of these pages: it finds the demoted ones in the shared pool.
        in_pool = [k for k in keys if k not in set(keys[-3:])]
        got, blob = cb.get_prefix(in_pool)
        assert got == in_pool and blob == data[: len(in_pool) * 1000]
        sb = cb.stats()
        assert sb.tiers[1].name == "mooncake" and sb.tiers[1].hits == len(in_pool)

        # A put straight into the pool (B has no RAM budget) is read back by A.
        k2 = [key(7000 + i) for i in range(4)]
        assert cb.put(k2, page(7, 4 * 2000), 2000) == 4
        assert cb.stats().tiers[1].puts == 4
        got, blob = ca.get_prefix(k2)
        assert got == k2 and blob == page(7, 4 * 2000)
    finally:
        for p in (a, b):
            p.send_signal(signal.SIGTERM)
        for p in (a, b):
            assert p.wait(20) == 0
