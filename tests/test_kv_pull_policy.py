"""Pull-or-recompute (services/kvstore/pull_policy.py) and the gateway's bulk data plane
(services/kvstore/dataplane.py):

- the decision: a fast pull is taken, a slow one is not (recompute), priors are conservative, a
  probe keeps the pull estimate fresh, modes always/never, estimates and counts in /metrics;
- the data plane: put / prefix get over a real socket against a real tiered store, 400/413 naming
  the field, the client's pooled connections and reused receive buffers;
- a real decode process + gateway (+ Redis) on CPU still pulls a prefix when that pays (a model
  whose KV is small for its compute), with the same tokens as computing it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from helpers.debug_weights import random_model_dir
from helpers.service_process import start_service
from prometheus_client import REGISTRY, generate_latest

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import EngineConfig, KVPullSection, ModelConfig, RunConfig
from services.common.schemas import GenerateRequest, GenerateResponse, SamplingParams, WeightsInfo
from services.engine import LLMEngine
from services.engine.kv_cache import KVCache
from services.engine.kv_transfer import StagingBuffers, export_pages, import_pages, page_nbytes
from services.kvstore.client import KVStoreClient, PagePublisher
from services.kvstore.dataplane import (
    OP_GET_PREFIX,
    OP_PUT,
    DataPlaneConnection,
    DataPlaneError,
    DataPlaneServer,
    parse_pages_reply,
)
from services.kvstore.pull_policy import PullPolicy
from services.kvstore.tiers import MemoryTier, TieredStore
from services.kvstore.wire import encode_keys, encode_uniform_pages

MB = 1 << 20
PAGE = 16 * 112 * 1024  # a Qwen3-0.6B page in bf16 (16 tokens x 112 KiB)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------- the decision


def test_fast_pull_is_taken_and_slow_pull_recomputes() -> None:
    clock = Clock()
    policy = PullPolicy(KVPullSection(probe_interval_s=60.0), clock=clock)
    policy.observe_prefill(80_000, 1.0)  # the engine prefills 80k tokens/s (an H200, 0.6B)
    policy.observe_import(10_000 * MB, 1.0)
    # Fast pulls (5 GB/s, 2 ms latency): 100 pages (183 MB) cost ~0.055 s with the import, but
    # the engine recomputes their 1,600 tokens in 0.02 s: recompute. At 8k tok/s (0.2 s) pull.
    policy.observe_pull(0, 0.002)
    policy.observe_pull(500 * MB, 0.002 + 0.1)
    d = policy.decide(100, PAGE, 16)
    assert d.action == "recompute" and d.pages == 0
    assert d.recompute_s == pytest.approx(1600 / 80_000)
    policy = PullPolicy(KVPullSection(probe_interval_s=60.0), clock=clock)
    policy.observe_prefill(8_000, 1.0)
    policy.observe_import(10_000 * MB, 1.0)
    policy.observe_pull(0, 0.002)
    policy.observe_pull(500 * MB, 0.002 + 0.1)
    d = policy.decide(100, PAGE, 16)
    assert d.action == "pull" and d.pages == 100 and d.pull_s < d.recompute_s
    assert policy.pull_bw.value == pytest.approx(500 * MB / 0.1)
    # The pulls get slow (190 MB/s, what the first H200 run measured): recompute from then on.
    for _ in range(10):
        policy.observe_pull(190 * MB, 1.0 + 0.002)
    d = policy.decide(100, PAGE, 16)
    assert d.action == "recompute" and d.pages == 0 and d.pull_s > d.recompute_s
    assert policy.counts == {"pull": 1, "recompute": 1, "probe": 0}


def test_priors_are_conservative_and_a_probe_refreshes_the_estimate() -> None:
    clock = Clock()
    cfg = KVPullSection(probe_interval_s=30.0, probe_pages=4)
    policy = PullPolicy(cfg, clock=clock)
    # Nothing measured, GPU-sized pages: the priors say recompute, but a small probe is pulled.
    d = policy.decide(600, PAGE, 16)
    assert (d.action, d.pages) == ("probe", 4)
    assert policy.decide(600, PAGE, 16).action == "recompute"  # one probe per interval
    clock.t += 31
    assert policy.decide(600, PAGE, 16).action == "probe"
    policy.observe_pull(0, 0.002)  # a probe that found nothing measures the latency
    clock.t += 31
    assert policy.decide(600, PAGE, 16).action == "probe"
    policy.observe_pull(4 * PAGE, 0.002 + 0.004)  # this one moved 7 MB in 4 ms: ~1.8 GB/s
    assert policy.pull_bw.value == pytest.approx(4 * PAGE / 0.004)
    # 600 pages (1.1 GB) now cost ~0.6 s pulled + 0.55 s imported, 9,600 tokens 0.48 s at the prior
    # 20k tok/s: still recompute. The engine turns out slow (1k tok/s, 9.6 s): pulling pays.
    assert policy.decide(600, PAGE, 16).action == "recompute"
    policy.observe_prefill(1000, 1.0)
    d = policy.decide(600, PAGE, 16)
    assert d.action == "pull" and d.pages == 600
    assert policy.decide(0, PAGE, 16).action == "recompute"  # nothing missing: nothing to pull


def test_modes_and_engine_counters() -> None:
    counters = {"prefill": (0.0, 0.0), "import": (0.0, 0.0)}
    always = PullPolicy(KVPullSection(mode="always"))
    assert always.decide(1000, PAGE, 16).action == "pull"
    never = PullPolicy(KVPullSection(mode="never"))
    assert never.decide(1, 100, 16).action == "recompute"
    policy = PullPolicy(
        KVPullSection(),
        prefill_counters=lambda: counters["prefill"],
        import_counters=lambda: counters["import"],
    )
    counters["prefill"] = (30.0, 0.01)  # too few tokens for a sample: ignored
    policy.refresh()
    assert policy.prefill.samples == 0
    counters["prefill"] = (5030.0, 1.01)
    counters["import"] = (4000.0 * MB, 2.0)
    policy.refresh()
    assert policy.prefill.value == pytest.approx(5030 / 1.01)
    assert policy.import_bw.value == pytest.approx(2000 * MB)
    counters["prefill"] = (15030.0, 2.01)
    policy.refresh()  # EWMA: 0.7 * old + 0.3 * new sample (10k tokens in 1 s)
    assert policy.prefill.value == pytest.approx(0.7 * 5030 / 1.01 + 0.3 * 10_000)


class SlowClock(Clock):
    """A clock whose every read yields the GIL for a moment, so threads interleave inside decide."""

    def __call__(self) -> float:
        time.sleep(0.001)
        return self.t


def test_concurrent_decisions_probe_once_and_fold_counters_once() -> None:
    """Pulls run in worker threads: the probe check-and-set and the counter refresh are one step."""
    clock = SlowClock()
    reads = {"n": 0}

    def prefill_counters() -> tuple[float, float]:
        reads["n"] += 1
        time.sleep(0.001)  # let another thread in between the read and the fold-in
        return (5000.0, 1.0) if reads["n"] > 1 else (0.0, 0.0)

    policy = PullPolicy(
        KVPullSection(probe_interval_s=30.0, probe_pages=4), prefill_counters=prefill_counters, clock=clock
    )
    actions: list[str] = []
    threads = [
        threading.Thread(target=lambda: actions.append(policy.decide(600, PAGE, 16).action)) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(actions) == ["probe"] + ["recompute"] * 7
    assert policy.prefill.samples == 1  # one delta of 5,000 tokens, folded in once
    assert policy.counts == {"pull": 0, "recompute": 7, "probe": 1}


def test_metrics_expose_estimates_and_decisions() -> None:
    policy = PullPolicy(KVPullSection(mode="always"))
    policy.observe_pull(64 * MB, 0.05)
    policy.decide(8, PAGE, 16)
    text = generate_latest(REGISTRY).decode()
    assert 'relay_kv_pull_decisions_total{decision="pull"}' in text
    for name in (
        'relay_kv_pull_estimate_seconds{path="pull"}',
        'relay_kv_pull_estimate_seconds{path="recompute"}',
        "relay_kv_pull_bandwidth_bytes_per_second",
        "relay_kv_pull_latency_seconds",
        "relay_kv_import_bandwidth_bytes_per_second",
        "relay_kv_prefill_tokens_per_second",
    ):
        assert name in text


# ---------------------------------------------------------------------- the data plane


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def plane() -> Iterator[tuple[DataPlaneServer, TieredStore]]:
    store = TieredStore([MemoryTier(64 * MB)])
    server = DataPlaneServer(lambda: store, "127.0.0.1", max_request_bytes=8 * MB).start()
    try:
        yield server, store
    finally:
        server.close()


def test_dataplane_put_and_prefix_get(plane: tuple[DataPlaneServer, TieredStore]) -> None:
    server, store = plane
    conn = DataPlaneConnection("127.0.0.1", server.port, timeout_s=10)
    keys = [key(i) for i in range(20)]
    data = os.urandom(20 * 70_000)
    frame = encode_uniform_pages(keys, data, 70_000)
    assert (
        conn.call(OP_PUT, [frame[: 8 + 20 * 20], memoryview(data)]).tobytes()
        == b'{"stored":20,"bytes":1400000}'
    )
    assert store.get_many([key(3)]) == [data[3 * 70_000 : 4 * 70_000]]
    # The chain stops at the first miss (key 99); the reply goes into a caller's buffer.
    buf = bytearray(4 * MB)
    body = conn.call(OP_GET_PREFIX, [encode_keys(keys[:5] + [key(99)] + keys[5:])], lambda n: buf)
    got, lengths, pages = parse_pages_reply(body)
    assert got == keys[:5] and lengths == [70_000] * 5 and pages.tobytes() == data[: 5 * 70_000]
    assert pages.obj is buf  # received in place: no copy
    # Bad bodies: 400 naming the body; the connection keeps working.
    with pytest.raises(DataPlaneError, match="400: body: frame magic"):
        conn.call(OP_PUT, [b"nonsense-frame"])
    with pytest.raises(DataPlaneError, match="400: op: unknown"):
        conn.call(9, [b""])
    assert parse_pages_reply(conn.call(OP_GET_PREFIX, [encode_keys(keys[:2])]))[0] == keys[:2]
    # Over max_request_bytes: 413 naming the limit; the body is dropped, the connection lives on.
    with pytest.raises(DataPlaneError, match="413: body: .* kvstore.max_request_bytes"):
        conn.call(OP_PUT, [b"\0" * (9 * MB)])
    assert parse_pages_reply(conn.call(OP_GET_PREFIX, [encode_keys(keys[:1])]))[0] == keys[:1]
    conn.close()


def test_client_uses_the_dataplane_with_pooled_connections(
    plane: tuple[DataPlaneServer, TieredStore],
) -> None:
    """KVStoreClient over the data plane (its address is what GET /v1/dataplane would say)."""
    server, _store = plane
    client = KVStoreClient("http://127.0.0.1:9", timeout_s=10, max_call_bytes=1 * MB)
    client._planes["http://127.0.0.1:9"] = ("127.0.0.1", server.port)
    keys = [key(100 + i) for i in range(40)]
    data = os.urandom(40 * 50_000)
    assert client.put(keys, data, 50_000) == 40  # 1 MB calls: split in two
    buffers = StagingBuffers(pin=False)
    taken: list[torch.Tensor] = []

    def alloc(n: int) -> memoryview:
        taken.append(buffers.take(n))
        return memoryview(taken[-1].numpy())

    got, blob = client.get_prefix(keys, alloc)
    assert got == keys and bytes(blob) == data and len(taken) == 1
    assert len(client._idle[("127.0.0.1", server.port)]) == 1  # one connection, reused
    buffers.give(taken[0])
    again = buffers.take(len(data))
    assert again is taken[0]  # the staging buffer is reused, not reallocated
    client.close()


def test_dataplane_drops_large_receive_buffers_and_joins_its_threads() -> None:
    store = TieredStore([MemoryTier(8 * MB)])
    server = DataPlaneServer(lambda: store, "127.0.0.1", max_request_bytes=128 * MB).start()
    conn = DataPlaneConnection("127.0.0.1", server.port, timeout_s=30)
    try:
        with pytest.raises(DataPlaneError, match="400: body"):
            conn.call(OP_GET_PREFIX, [b"\0" * MB])
        assert server.buffered_bytes == MB  # kept for the next request
        with pytest.raises(DataPlaneError, match="400: body"):
            conn.call(OP_GET_PREFIX, [b"\0" * (65 * MB)])
        assert server.buffered_bytes == 0  # above KEEP_RX_BYTES: not kept
        assert parse_pages_reply(conn.call(OP_GET_PREFIX, [encode_keys([key(1)])]))[0] == []
        threads = list(server._threads)
        assert len(threads) == 1 and threads[0].is_alive()
    finally:
        server.close()
        conn.close()
    # close() returned after the connection threads ended: none is still inside the store.
    assert not threads[0].is_alive() and not server._threads


def test_staging_buffers_grow_geometrically_and_stay_bounded() -> None:
    """A multi-turn context grows every turn: its pulls must not allocate (pin) a buffer each time."""
    buffers = StagingBuffers(pin=False, keep_bytes=256 * MB)
    for turn in range(1, 60):
        buf = buffers.take(turn * 2 * MB)
        assert buf.numel() >= turn * 2 * MB
        buffers.give(buf)
    assert buffers.allocations <= 10
    assert buffers.idle_bytes <= 256 * MB


def test_import_from_a_staging_slice_with_scattered_pages() -> None:
    """import_pages from a tensor slice (what a pull stages) into pages that are not consecutive."""
    kv = KVCache(3, 12, 4, 48, 2, 8, torch.float32, torch.device("cpu"))
    src = KVCache(3, 12, 4, 48, 2, 8, torch.float32, torch.device("cpu"))
    src.k.normal_()
    src.v.normal_()
    data = export_pages(src, [5, 6, 7, 1])
    # Take pages 0, 2, 4 so the import gets a fragmented free list.
    held = [kv.blocks.allocate() for _ in range(5)]
    for b in held[1::2]:
        kv.blocks.release(b)
    staging = torch.zeros(len(data) + 100, dtype=torch.uint8)
    staging[100:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    keys = [key(i) for i in range(4)]
    assert import_pages(kv, keys, staging[100:]) == 4
    pages = [kv.blocks.lookup(k) for k in keys]
    assert export_pages(kv, pages) == data  # bitwise, whatever pages they landed in
    assert page_nbytes(kv) * 4 == len(data)


# ---------------------------------------------------------------------- decode + gateway


# Compute-heavy, KV-light: 1 KiB of KV per token (one KV head of 64, two layers, float32) against
# ~4 MFLOP per token, so on CPU a pull (~1 MB for 1k tokens) is far cheaper than recomputing.
PULL_PAYS = ModelConfig(
    arch="qwen3",
    vocab_size=1024,
    dim=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=1,
    head_dim=64,
    hidden_dim=1024,
    max_seq_len=2048,
    tie_embeddings=True,
    qk_norm=True,
)
ENGINE = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=2048, block_size=16, num_kv_blocks=256)


def wait_url(bus: Bus, kind: str, proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{kind} exited: {log.read_text()[-3000:]}"
        for s in bus.services(kind):
            if s.pid == proc.pid and s.version >= 0:
                return s.url
        time.sleep(0.1)
    raise TimeoutError(f"{kind} not ready: {log.read_text()[-3000:]}")


# A gateway and a decode process on two shared cores: ~15 s.
def test_real_decode_pulls_when_it_pays(redis_url: str, tmp_path: Path) -> None:
    weights = random_model_dir(PULL_PAYS, tmp_path / "weights" / "step_0")
    cfg = RunConfig(model=PULL_PAYS)
    cfg.redis.prefix = f"test-kvpull-{uuid.uuid4().hex[:8]}"
    cfg.redis.heartbeat_s = 0.2
    cfg.decode.engine = ENGINE
    cfg.kvstore.enabled = True
    cfg.prefill.min_new_tokens = 1 << 30  # no prefill service: decode pulls or computes itself
    assert cfg.kvstore.pull.mode == "auto"  # the cost model decides
    (tmp_path / "config.json").write_text(cfg.dump())
    bus = Bus(redis_url, cfg.redis.prefix)
    bus.publish_weights(WeightsInfo(version=0, path=str(weights)))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, module in (("kvstore", "services.kvstore"), ("decode", "services.decode")):
        procs[name] = start_service(module, tmp_path / "config.json", redis_url, tmp_path / f"{name}.log")
    try:
        gw = wait_url(bus, "kvstore", procs["kvstore"], tmp_path / "kvstore.log")
        dec = wait_url(bus, "decode", procs["decode"], tmp_path / "decode.log")
        assert httpx.get(f"{gw}/v1/dataplane").json()["port"] > 0

        def generate(r: GenerateRequest) -> GenerateResponse:
            resp = httpx.post(
                f"{dec}/v1/generate", json=r.model_dump(mode="json"), timeout=300, headers=auth_headers()
            )
            assert resp.status_code == 200, resp.text
            return GenerateResponse.model_validate_json(resp.content)

        # Decode measures its own prefill throughput on a first prompt (nothing stored for it).
        generate(
            GenerateRequest(
                input_ids=[(3 * i) % 1000 for i in range(600)], sampling=SamplingParams(max_tokens=2)
            )
        )
        # Another engine (same weights and layout) computes a long prompt and publishes its pages.
        prompt = [(7 * i + 1) % 1000 for i in range(1201)]  # 75 full pages + 1 token
        sampling = SamplingParams(temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)
        local = LLMEngine(weights, ENGINE, version=0)
        client = KVStoreClient(gw, timeout_s=30)
        publisher = PagePublisher(client, page_nbytes(local.kv))
        local.pages.sink = publisher
        ref = local.generate([GenerateRequest(input_ids=prompt, sampling=sampling)])[0]
        publisher.flush()
        assert publisher.pages_published >= 75
        publisher.close()
        client.close()

        before = httpx.get(f"{dec}/health").json()["kv"]
        out = generate(GenerateRequest(input_ids=prompt, sampling=sampling))
        kv = httpx.get(f"{dec}/health").json()["kv"]
        assert out.choices[0].output_ids == ref.choices[0].output_ids
        assert out.choices[0].logprobs == pytest.approx(ref.choices[0].logprobs, abs=1e-4)
        assert kv["pull_decisions_pull"] - before["pull_decisions_pull"] == 1
        assert kv["pulled_pages"] - before["pulled_pages"] == 75
        assert kv["imported_pages"] - before["imported_pages"] == 75
        # Only the last prompt token and the decodes were computed (the prefix was pulled).
        assert kv["computed_tokens"] - before["computed_tokens"] == 1 + 3
        # Both estimates are measured now, and the pull was the cheaper one.
        assert kv["prefill_tokens_per_s"] != RunConfig().kvstore.pull.prior_prefill_tokens_per_s
        metrics = httpx.get(f"{dec}/metrics").text
        assert 'relay_kv_pull_decisions_total{decision="pull"}' in metrics
        assert "relay_kv_prefill_tokens_per_second" in metrics
        pull_s = float(
            next(
                ln
                for ln in metrics.splitlines()
                if ln.startswith('relay_kv_pull_estimate_seconds{path="pull"}')
            ).split()[-1]
        )
        recompute_s = float(
            next(
                ln
                for ln in metrics.splitlines()
                if ln.startswith('relay_kv_pull_estimate_seconds{path="recompute"}')
            ).split()[-1]
        )
        assert pull_s < recompute_s
        # The pages went over the gateway's data plane, not its HTTP routes.
        gw_metrics = httpx.get(f"{gw}/metrics").text
        line = next(
            ln
            for ln in gw_metrics.splitlines()
            if ln.startswith('relay_kvstore_dataplane_bytes_total{op="get_prefix"}')
        )
        assert float(line.split()[-1]) >= 75 * page_nbytes(local.kv)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for name, p in procs.items():
            assert p.wait(30) == 0, f"{name} did not exit cleanly"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Two gateway starts on two shared cores: ~10 s.
def test_client_pulls_again_right_after_a_gateway_restart(redis_url: str, tmp_path: Path) -> None:
    """The gateway restarts on its fixed HTTP port with a new (ephemeral) data plane port: the
    client's pooled connection is dead and its data plane address stale. The first pull after the
    restart already succeeds (retried once on a fresh connection to the new address)."""
    cfg = RunConfig()
    cfg.redis.prefix = f"test-kvrestart-{uuid.uuid4().hex[:8]}"
    cfg.redis.heartbeat_s = 0.2
    cfg.kvstore.enabled = True
    cfg.kvstore.port = free_port()
    (tmp_path / "config.json").write_text(cfg.dump())
    bus = Bus(redis_url, cfg.redis.prefix)
    keys = [key(500 + i) for i in range(8)]
    data = os.urandom(8 * 20_000)

    def start() -> tuple[subprocess.Popen[bytes], str, int]:
        proc = start_service(
            "services.kvstore", tmp_path / "config.json", redis_url, tmp_path / "kvstore.log"
        )
        url = wait_url(bus, "kvstore", proc, tmp_path / "kvstore.log")
        return proc, url, httpx.get(f"{url}/v1/dataplane").json()["port"]

    def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0

    proc, url, port = start()
    client = KVStoreClient(url, timeout_s=10, retry_after_s=30.0)
    try:
        assert client.put(keys, data, 20_000) == 8
        assert client.get_prefix(keys) == (keys, data)
        assert len(client._idle[("127.0.0.1", port)]) == 1  # a pooled connection to the old port
        stop(proc)
        proc, url2, port2 = start()
        assert url2 == url and port2 != port
        # The new gateway's RAM tier is empty: the first pull finds nothing, but it is a real round
        # trip (timed, not a failure that would mark the gateway down for retry_after_s).
        client.take_call_seconds()
        assert client.get_prefix(keys) == ([], b"")
        assert client.failures == 0 and client.take_call_seconds() is not None
        assert client.put(keys, data, 20_000) == 8
        got, blob = client.get_prefix(keys, page_bytes=20_000)
        assert (got, bytes(blob)) == (keys, data) and client.failures == 0
        assert client._planes[url] == ("127.0.0.1", port2)
        assert ("127.0.0.1", port) not in client._idle  # the dead connections were dropped
        # A refused connect (an address that is no longer listening, no pooled connection) is
        # retried at the address the gateway advertises now.
        client._planes[url] = ("127.0.0.1", free_port())
        assert client.get_prefix(keys)[0] == keys and client.failures == 0
        # The HTTP fallback path times its round trips too (the pull estimate's input).
        http = KVStoreClient(url, timeout_s=10, dataplane=False)
        assert http.get_prefix(keys) == (keys, data)
        seconds = http.take_call_seconds()
        assert seconds is not None and seconds > 0
        http.close()
    finally:
        client.close()
        stop(proc)
