"""The KV store gateway: wire frames, tiers (budgets, LRU demotion and promotion, stats, the disk
tier surviving a restart) and the gateway as a real subprocess over HTTP (batched binary get/put,
stats, /health, /metrics, 4xx naming the field, SIGTERM exit 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.service_process import start_with_config, wait_registered

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import RunConfig
from services.kvstore.client import KVStoreClient
from services.kvstore.tiers import DiskTier, MemoryTier, TieredStore
from services.kvstore.wire import (
    FrameError,
    decode_keys,
    decode_pages,
    encode_keys,
    encode_pages,
    encode_uniform_pages,
)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def page(i: int, n: int = 100) -> bytes:
    return bytes([i % 256]) * n


# ---------------------------------------------------------------------- wire


def test_frames_roundtrip_and_reject_garbage() -> None:
    keys = [key(i) for i in range(3)]
    pages = [page(1, 5), page(2, 0), page(3, 7)]
    got = decode_pages(encode_pages(keys, pages))
    assert [(k, bytes(p)) for k, p in got] == list(zip(keys, pages, strict=True))
    assert decode_keys(encode_keys(keys)) == keys
    uniform = decode_pages(encode_uniform_pages(keys, page(9, 12), 4))
    assert [bytes(p) for _, p in uniform] == [page(9, 4)] * 3
    # A frame is its header + raw bytes: no per-page encoding overhead beyond key and length.
    assert len(encode_pages(keys, pages)) == 8 + 3 * (16 + 4) + 12
    for bad in (b"", b"XXXX\x01\x00\x00\x00", encode_keys(keys)[:-1]):
        with pytest.raises(FrameError):
            decode_keys(bad)
    with pytest.raises(FrameError, match="lengths add up"):
        decode_pages(encode_pages(keys, pages) + b"x")
    with pytest.raises(FrameError, match="expected 16"):
        encode_keys([b"short"])


# ---------------------------------------------------------------------- tiers


def test_ram_over_budget_demotes_lru_to_disk_and_reads_promote(tmp_path: Path) -> None:
    store = TieredStore([MemoryTier(300), DiskTier(tmp_path, 500)])
    for i in range(5):
        assert store.put(key(i), page(i))
    ram, disk = store.tiers
    assert ram.used_bytes <= 300 and disk.used_bytes <= 500
    assert [key(i) in ram for i in range(5)] == [False, False, True, True, True]
    assert [key(i) in disk for i in range(5)] == [True, True, False, False, False]
    # Reading a disk page promotes it to RAM, which demotes RAM's least recently used (page 2).
    assert store.get_many([key(0)]) == [page(0)]
    assert key(0) in ram and key(0) not in disk and key(2) in disk
    # Disk over budget: its LRU pages fall off the bottom (no tier below).
    for i in range(5, 12):
        store.put(key(i), page(i))
    st = store.stats()
    assert st.tiers[0].demotions >= 7 and st.tiers[1].evictions > 0
    assert st.tiers[0].used_bytes <= 300 and st.tiers[1].used_bytes <= 500
    assert st.tiers[1].promotions == 1 and st.tiers[1].hits == 1
    assert store.get_many([key(1)]) == [None] and store.stats().misses == 1
    # Whatever is still stored reads back byte-exact.
    for i in range(12):
        got = store.get_many([key(i)])[0]
        assert got is None or got == page(i)


def test_page_bigger_than_ram_goes_to_disk_and_disk_survives_restart(tmp_path: Path) -> None:
    store = TieredStore([MemoryTier(50), DiskTier(tmp_path, 10_000)])
    store.put(key(1), page(1, 200))
    assert key(1) in store.tiers[1] and store.stats().tiers[1].puts == 1
    store.put(key(2), page(2, 40))
    store.close()
    again = TieredStore([MemoryTier(1000), DiskTier(tmp_path, 10_000)])
    assert len(again.tiers[1]) == 1 and again.tiers[1].used_bytes == 200
    assert again.get_many([key(1), key(2)]) == [page(1, 200), None]  # RAM is gone, disk is not


# ---------------------------------------------------------------------- the service


def start_gateway(
    tmp: Path, redis_url: str, cfg: RunConfig, name: str = "kvstore"
) -> subprocess.Popen[bytes]:
    return start_with_config("services.kvstore", cfg, redis_url, tmp, name)


@pytest.fixture(scope="module")
def gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Bus, Path]]:
    tmp = tmp_path_factory.mktemp("kvstore")
    cfg = RunConfig()
    cfg.redis.prefix = f"test-kvstore-{uuid.uuid4().hex[:8]}"
    cfg.redis.heartbeat_s = 0.2
    cfg.kvstore.enabled = True
    cfg.kvstore.ram_bytes = 4000
    cfg.kvstore.disk_bytes = 100_000
    cfg.kvstore.max_request_bytes = 50_000
    bus = Bus(redis_url, cfg.redis.prefix)
    proc = start_gateway(tmp, redis_url, cfg)
    try:
        [url] = wait_registered(bus, "kvstore", proc, tmp / "kvstore.log")
        yield url, bus, tmp
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
        assert not bus.services("kvstore")  # deregistered on the way out


def test_gateway_batched_put_get_and_stats(gateway: tuple[str, Bus, Path]) -> None:
    url, _bus, tmp = gateway
    client = KVStoreClient(url, max_call_bytes=20_000)  # the gateway takes 50 kB a call: split
    keys = [key(1000 + i) for i in range(60)]
    data = b"".join(page(i, 1000) for i in range(60))
    assert client.put(keys, data, 1000) == 60
    # The chain is served from its head up to the first missing page.
    got, blob = client.get_prefix(keys[:10] + [key(5)] + keys[10:])
    assert got == keys[:10] and blob == data[:10_000]
    got, blob = client.get_prefix(keys)
    assert got == keys and blob == data
    st = client.stats()
    ram, disk = st.tiers
    assert (ram.name, disk.name) == ("ram", "disk")
    assert ram.used_bytes <= 4000 and ram.demotions > 0 and disk.promotions > 0
    assert ram.pages + disk.pages == 60
    assert (tmp / "kvstore" / "disk").is_dir()  # default disk_dir: RUN_DIR/kvstore/disk
    metrics = httpx.get(f"{url}/metrics").text
    assert 'relay_kvstore_tier_used_bytes{tier="disk"}' in metrics
    assert 'relay_kvstore_tier_demotions_total{tier="ram"}' in metrics
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["tiers"]["ram"]["pages"] == ram.pages


def test_gateway_rejects_bad_bodies_naming_the_field(gateway: tuple[str, Bus, Path]) -> None:
    url = gateway[0]
    r = httpx.put(f"{url}/v1/pages", content=b"nonsense", headers=auth_headers())
    assert r.status_code == 400 and r.json()["detail"].startswith("body:")
    r = httpx.post(f"{url}/v1/pages/get", content=encode_pages([key(1)], [b"x"]), headers=auth_headers())
    assert r.status_code == 400 and "magic" in r.json()["detail"]
    r = httpx.put(f"{url}/v1/pages", content=b"\0" * 60_000, headers=auth_headers())
    assert r.status_code == 413 and "max_request_bytes" in r.json()["detail"]


def test_client_falls_back_when_gateway_is_unreachable() -> None:
    client = KVStoreClient("http://127.0.0.1:9", timeout_s=1.0, retry_after_s=30.0)
    assert client.get_prefix([key(1)]) == ([], b"")
    assert client.failures == 1
    t0 = time.monotonic()
    assert client.put([key(1)], page(1, 4), 4) == 0  # skipped at once while marked down
    assert time.monotonic() - t0 < 0.1 and client.failures == 1


def test_sigterm_while_idle_exits_zero(redis_url: str, tmp_path: Path) -> None:
    cfg = RunConfig()
    cfg.redis.prefix = f"test-kvstore-{uuid.uuid4().hex[:8]}"
    cfg.kvstore.enabled = True
    bus = Bus(redis_url, cfg.redis.prefix)
    proc = start_gateway(tmp_path, redis_url, cfg)
    wait_registered(bus, "kvstore", proc, tmp_path / "kvstore.log")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(20) == 0


# ---------------------------------------------------------------------- launcher


def test_launcher_starts_kv_processes_only_when_configured() -> None:
    from sbatch.local import LocalRun
    from services.common.config import ConfigError, load_config
    from services.kvstore.launch import kv_plan, resolve_ports

    plain = [name for name, _ in LocalRun.describe(load_config("debug"))]
    assert plain == [
        "redis",
        "sandbox.0",
        "decode.0",
        "trainer",
        "orchestrator",
    ]  # the debug run is unchanged
    cfg = load_config(
        "debug", ["--kvstore.enabled=true", "--prefill.replicas=2", "--kvstore.mooncake.enabled=true"]
    )
    plan = LocalRun.describe(cfg)
    names = [name for name, _ in plan]
    # Master before the gateway before prefill before decode: each finds the previous one running.
    assert names[2:6] == ["mooncake_master", "kvstore", "prefill.0", "prefill.1"] and names[6] == "decode.0"
    argv = dict(plan)["prefill.1"]
    assert argv[1:3] == ["-m", "services.prefill"] and argv[-2:] == ["--index", "1"]
    ports = resolve_ports(cfg).kvstore.mooncake
    assert ports.rpc_port > 0 and ports.metadata_port > 0 and ports.rpc_port != ports.metadata_port
    with pytest.raises(ConfigError, match="kvstore.enabled"):
        kv_plan(load_config("debug", ["--prefill.replicas=1"]))


def test_publisher_resolves_per_request_and_bounds_its_queue(gateway: tuple[str, Bus, Path]) -> None:
    from services.kvstore.client import PagePublisher

    client = KVStoreClient(gateway[0])
    pub = PagePublisher(client, page_bytes=100)
    fut = pub.expect("r1")
    pub([key(9000), key(9001)], page(1, 200), ["r1"])  # what an engine's sink call looks like
    assert fut.result(timeout=10) == 2
    pub([], b"", [])  # nothing new: nothing sent
    pub.flush()
    assert pub.pages_published == 2
    assert client.get_prefix([key(9000), key(9001)])[1] == page(1, 200)
    pub.close()

    tiny = PagePublisher(
        KVStoreClient("http://127.0.0.1:9", timeout_s=1.0), page_bytes=100, max_queue_bytes=150
    )
    fut = tiny.expect("r2")
    tiny([key(1), key(2)], page(2, 200), ["r2"])  # over the byte bound: dropped, not queued
    assert tiny.batches_dropped == 1 and fut.result(timeout=1) == 0
    tiny.close()


def test_slurm_plan_puts_master_and_gateway_on_the_head(tmp_path: Path) -> None:
    from sbatch import slurm
    from services.common.config import load_config

    assert "kvstore" not in [
        s.name for s in slurm.build_plan(load_config("debug"), tmp_path).components[0].services[0]
    ]
    cfg = load_config("debug", ["--kvstore.enabled=true", "--kvstore.mooncake.enabled=true"])
    plan = slurm.build_plan(cfg, tmp_path)
    head = [s.name for s in plan.components[0].services[0]]
    assert head.index("mooncake_master") < head.index("kvstore") < head.index("orchestrator")
    assert slurm.missing_modules(plan) == []
    res = slurm.resolved_config(cfg, plan, "redis://h:1/0")
    assert res.kvstore.host == res.prefill.host == "0.0.0.0"
    assert res.kvstore.mooncake.rpc_port and res.kvstore.mooncake.metadata_port
    master = next(s for s in plan.components[0].services[0] if s.name == "mooncake_master")
    assert slurm.service_command(master, cfg, plan, "redis://h:1/0")[1:3] == ["-m", "services.kvstore.master"]
