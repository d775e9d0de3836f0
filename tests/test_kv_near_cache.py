"""The near KV tier (services/kvstore/near_cache.py): an in-process LRU of KV pages in (on CUDA
pinned) host memory in front of the KV store gateway, with real gateways (the data plane over a
real socket on a real tiered store; a real gateway process for the restart) and real engines:

- LRU under a byte budget, chain heads evicted last, held slots never reused;
- write-through put, then a get served with zero gateway round trips;
- a partial near hit gets the rest from the gateway, in chain order, and fills the tier;
- pages survive a gateway restart through the near tier; a gateway that is down still leaves them;
- a weight update (salted keys) never serves a stale page;
- the pull policy estimates near and remote pulls separately;
- an engine's second turn is served from the near tier (exported straight into its slots) and gives
  the same tokens as recomputing.
"""

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
import torch
from helpers.debug_weights import random_model_dir
from helpers.service_process import start_service
from prometheus_client import REGISTRY, generate_latest

from services.common.bus import Bus
from services.common.config import EngineConfig, KVNearSection, KVPullSection, ModelConfig, RunConfig
from services.common.schemas import GenerateRequest, GenerateResponse, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_cache import KVCache
from services.engine.kv_transfer import export_pages, import_pages, page_nbytes
from services.kvstore.client import KVStoreClient, PagePublisher
from services.kvstore.dataplane import DataPlaneServer
from services.kvstore.near_cache import NearCache, near_budget
from services.kvstore.pull_policy import PullPolicy
from services.kvstore.router import attach_near, engine_policy, prompt_keys, pull_prefix
from services.kvstore.tiers import MemoryTier, TieredStore

MB = 1 << 20
PAGE = 16 * 112 * 1024  # a Qwen3-0.6B page in bf16
FAKE_URL = "http://127.0.0.1:9"  # nothing listens there: re-discovery of the data plane fails


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def pages(n: int, size: int) -> bytes:
    return os.urandom(n * size)


class Gateway:
    """A real tiered store behind a real data plane socket, in this process (the gateway's bulk
    path); `client()` makes a KVStoreClient pointed at it."""

    def __init__(self) -> None:
        self.store = TieredStore([MemoryTier(64 * MB)])
        self.server = DataPlaneServer(lambda: self.store, "127.0.0.1", max_request_bytes=64 * MB).start()

    def client(self, near: NearCache | None = None) -> KVStoreClient:
        c = KVStoreClient(FAKE_URL, timeout_s=10, retry_after_s=30.0, near=near)
        c._planes[FAKE_URL] = ("127.0.0.1", self.server.port)
        return c

    @property
    def lookups(self) -> int:
        """Page lookups the store answered (every gateway get asks it for at least one)."""
        return self.store.stats().gets

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    gw = Gateway()
    try:
        yield gw
    finally:
        gw.close()


# ---------------------------------------------------------------------- the LRU


def test_lru_byte_budget_eviction_order_and_held_slots() -> None:
    size = 1000
    # 5.5 pages of budget -> 5 slots, in chunks of 2 (three chunks, the last one partly used).
    near = NearCache(5 * size + 500, size, pin=False, chunk_bytes=2 * size)
    assert near.capacity == 5 and near.budget_bytes == 5 * size and near.allocated_slots == 0
    a, b, c = [key(i) for i in range(3)], [key(10 + i) for i in range(2)], [key(20 + i) for i in range(2)]
    da, db, dc = pages(3, size), pages(2, size), pages(2, size)
    assert near.put(a, da) == 3 and near.put(b, db) == 2
    assert near.used_bytes == 5 * size and near.allocated_slots == 5
    # Full: chain c evicts the least recently used pages, which are chain a's tail (a chain is
    # touched tail first, so its head is evicted last).
    assert near.put(c, dc) == 2
    assert near.evictions == 2 and near.used_bytes == 5 * size
    assert near.run_length(a) == 1 and a[1] not in near and a[2] not in near
    assert near.run_length(b) == 2 and near.run_length(c) == 2
    run = near.acquire(a + b)  # stops at the first miss: a[1]
    assert run.keys == [a[0]] and run.tobytes() == da[:size]
    assert near.stats()["near_hits"] == 1 and near.stats()["near_misses"] == 4
    # A held page is evicted from the index but its slot is not reused until released.
    d = [key(30 + i) for i in range(5)]
    dd = pages(5, size)
    assert near.put(d, dd) == 4  # 5 slots, one held: the chain's head is kept, the tail dropped
    assert near.run_length(d) == 4 and a[0] not in near and near.dropped == 1
    assert run.tobytes() == da[:size]  # still the evicted page's bytes
    run.release()
    run.release()  # idempotent
    assert near.put([key(99)], dd[:size]) == 1  # the released slot is free again: no eviction
    assert near.run_length(d) == 4 and near.used_bytes == 5 * size
    assert near.put([key(98)], dd[:size]) == 1  # now the LRU page goes: d's tail
    assert near.run_length(d) == 3 and key(99) in near and near.used_bytes == 5 * size
    got = near.acquire(d[:3])
    assert got.tobytes() == dd[: 3 * size]
    got.release()
    near.clear()
    assert len(near) == 0 and near.used_bytes == 0
    with pytest.raises(ValueError, match="bytes for 2 pages"):
        near.put([key(1), key(2)], b"x" * size)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA does")
def test_a_tier_that_cannot_pin_stores_nothing_and_fails_nothing(gateway: Gateway) -> None:
    """Pinned memory on a host without CUDA is refused: the tier stops growing (puts store
    nothing), and the client's put and get still work through the gateway."""
    near = NearCache(8 * 1000, 1000, pin=True)
    client = gateway.client(near)
    keys, data = [key(900 + i) for i in range(3)], pages(3, 1000)
    assert client.put(keys, data, 1000) == 3  # the gateway stored them
    assert len(near) == 0 and near.capacity == 0 and near.dropped == 3
    assert client.get_prefix(keys, page_bytes=1000) == (keys, data)
    client.close()


def test_near_budget_config_defaults() -> None:
    section = KVNearSection()
    assert near_budget(section, "cuda") == 4 << 30 and near_budget(section, "cpu") == 64 << 20
    assert near_budget(KVNearSection(bytes=0), "cuda") == 0
    # Chunks are allocated as the tier fills, or all at once by reserve() (before timed work).
    near = NearCache(5 * 1000, 1000, pin=False, chunk_bytes=2000)
    assert near.allocated_slots == 0 and near.reserve() == 5 and len(near._chunks) == 3
    # The config names the key on a bad value, and the near section is in every run config.
    with pytest.raises(ValueError, match="bytes"):
        KVNearSection(bytes=-1)
    assert '"near"' in RunConfig().dump()


# ---------------------------------------------------------------------- client + gateway


def test_write_through_put_then_get_with_zero_gateway_round_trips(gateway: Gateway) -> None:
    size = 20_000
    near = NearCache(64 * size, size, pin=False)
    client = gateway.client(near)
    keys, data = [key(i) for i in range(12)], pages(12, size)
    assert client.put(keys, data, size) == 12
    assert gateway.store.get_many(keys) == [data[i * size : (i + 1) * size] for i in range(12)]
    assert near.run_length(keys) == 12
    before = gateway.lookups
    run, got, rest = client.get_prefix_near(keys, page_bytes=size)
    assert run is not None and run.keys == keys and got == [] and bytes(rest) == b""
    assert run.tobytes() == data
    run.release()
    # The joined form (what non-engine callers use) is served from the near tier too.
    assert client.get_prefix(keys, page_bytes=size) == (keys, data)
    assert gateway.lookups == before  # not one round trip to the gateway
    assert client.near_stats()["near_hits"] == 24 and client.failures == 0
    client.close()


def test_partial_near_hit_fills_the_rest_from_the_gateway_in_order(gateway: Gateway) -> None:
    size = 20_000
    keys, data = [key(100 + i) for i in range(10)], pages(10, size)
    writer = gateway.client()  # another process published the chain
    assert writer.put(keys, data, size) == 10
    near = NearCache(64 * size, size, pin=False)
    near.put(keys[:4], data[: 4 * size])
    client = gateway.client(near)
    before = gateway.lookups
    run, got, rest = client.get_prefix_near(keys, page_bytes=size)
    assert run is not None and run.keys == keys[:4] and got == keys[4:]
    assert run.tobytes() + bytes(rest) == data  # chain order: near run, then the gateway's pages
    run.release()
    assert gateway.lookups - before == 6  # the gateway was asked only for the pages after the run
    assert near.run_length(keys) == 10  # filled on the way back
    # The gateway lacks a page in the middle: the run stops there (a chain is usable from its head).
    more, more_data = [key(200 + i) for i in range(6)], pages(6, size)
    assert writer.put(more[:2] + more[3:], more_data[: 2 * size] + more_data[3 * size :], size) == 5
    near.put(more[:1], more_data[:size])
    got_keys, joined = client.get_prefix(more, page_bytes=size)
    assert got_keys == more[:2] and joined == more_data[: 2 * size]
    assert near.run_length(more) == 2 and more[3] not in near
    writer.close()
    client.close()


def test_gateway_down_still_serves_near_hits(gateway: Gateway) -> None:
    size = 20_000
    near = NearCache(64 * size, size, pin=False)
    client = gateway.client(near)
    keys, data = [key(300 + i) for i in range(8)], pages(8, size)
    assert client.put(keys, data, size) == 8
    gateway.close()  # the gateway goes away (its data plane refuses connections)
    extra = [key(399)]
    run, got, _ = client.get_prefix_near(keys + extra, page_bytes=size)
    assert run is not None and run.keys == keys and got == [] and run.tobytes() == data
    run.release()
    assert client.failures == 1  # the page after the run was asked of the gateway, which failed
    # While the gateway is skipped (retry_after_s), puts still land in the near tier.
    later, later_data = [key(400 + i) for i in range(3)], pages(3, size)
    assert client.put(later, later_data, size) == 0
    assert client.get_prefix(later, page_bytes=size) == (later, later_data)
    client.close()


def wait_url(bus: Bus, proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"gateway exited: {log.read_text()[-3000:]}"
        for s in bus.services("kvstore"):
            if s.pid == proc.pid:
                return s.url
        time.sleep(0.1)
    raise TimeoutError(f"gateway not ready: {log.read_text()[-3000:]}")


# Two starts of a real gateway process on two shared cores: ~10 s.
def test_pages_survive_a_gateway_restart_through_the_near_tier(redis_url: str, tmp_path: Path) -> None:
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cfg = RunConfig()
    cfg.redis.prefix = f"test-kvnear-{uuid.uuid4().hex[:8]}"
    cfg.redis.heartbeat_s = 0.2
    cfg.kvstore.enabled = True
    cfg.kvstore.port = port
    (tmp_path / "config.json").write_text(cfg.dump())
    bus = Bus(redis_url, cfg.redis.prefix)
    log = tmp_path / "kvstore.log"

    def start() -> tuple[subprocess.Popen[bytes], str]:
        proc = start_service("services.kvstore", tmp_path / "config.json", redis_url, log)
        return proc, wait_url(bus, proc, log)

    def stop(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0

    size = 20_000
    keys, data = [key(500 + i) for i in range(8)], pages(8, size)
    proc, url = start()
    near = NearCache(64 * size, size, pin=False)
    client = KVStoreClient(url, timeout_s=10, retry_after_s=30.0, near=near)
    try:
        assert client.put(keys, data, size) == 8
        stop(proc)
        proc, url2 = start()  # a fresh gateway: its RAM tier is empty
        assert url2 == url
        stats = httpx.get(f"{url}/v1/stats").json()
        assert sum(t["pages"] for t in stats["tiers"]) == 0
        assert client.get_prefix(keys, page_bytes=size) == (keys, data)  # from the near tier
        assert httpx.get(f"{url}/v1/stats").json()["gets"] == 0  # the gateway was not asked
        # Pages the near tier lacks still come from the (new) gateway.
        other, other_data = [key(600 + i) for i in range(4)], pages(4, size)
        plain = KVStoreClient(url, timeout_s=10)
        assert plain.put(other, other_data, size) == 4
        plain.close()
        assert client.get_prefix(other, page_bytes=size) == (other, other_data)
        assert client.failures == 0
    finally:
        client.close()
        stop(proc)


# ---------------------------------------------------------------------- the decision


def test_policy_estimates_near_and_remote_pulls_separately() -> None:
    # A slow gateway (100 MB/s), a fast prefill (100k tokens/s), a fast near tier (20 GB/s).
    cfg = KVPullSection(
        prior_pull_bytes_per_s=1e8,
        prior_prefill_tokens_per_s=1e5,
        prior_near_bytes_per_s=2e10,
        probe_pages=0,
    )
    policy = PullPolicy(cfg)
    d = policy.decide(100, PAGE, 16, near=60)
    # The near run (60 x 1.8 MB at 20 GB/s: 5.5 ms) beats recomputing its 960 tokens (9.6 ms); the
    # remote rest (40 pages at 100 MB/s: 0.7 s) loses to recomputing 640 tokens (6.4 ms).
    assert (d.action, d.pages, d.near) == ("pull", 60, 60)
    assert d.near_s == pytest.approx(60 * PAGE / 2e10)
    assert d.near_s < 60 * 16 / 1e5 < d.pull_s
    assert policy.decide(100, PAGE, 16, near=100).pages == 100
    assert policy.decide(100, PAGE, 16, near=0).action == "recompute"  # all remote: as before
    assert policy.near_counts == {"all": 0, "only": 2}
    assert policy.counts == {"pull": 2, "recompute": 1, "probe": 0}
    # A fast gateway (latency, bandwidth and import measured): pull the near run and the rest.
    policy.observe_pull(1000, 1e-4)
    policy.observe_pull(64 * MB, 1e-4 + 64 * MB / 5e10)
    policy.observe_import(64 * MB, 64 * MB / 5e10)
    d = policy.decide(100, PAGE, 16, near=60)
    assert (d.action, d.pages, d.near) == ("pull", 100, 60) and policy.near_counts["all"] == 1
    # A near tier slower than recomputing (measured through the engine's near import counters):
    # recompute, and while recompute wins a probe takes a few near pages (the near estimate stays
    # measured), then one asks the gateway for a few (the near run skipped: it measures the gateway).
    counters = [0.0, 0.0]
    slow = PullPolicy(
        KVPullSection(prior_pull_bytes_per_s=1e8, prior_prefill_tokens_per_s=1e5, probe_interval_s=30.0),
        near_import_counters=lambda: (counters[0], counters[1]),
    )
    counters[:] = [100 * MB, 10.0]  # 10 MB/s
    d = slow.decide(100, PAGE, 16, near=60)
    assert slow.near_bw.value == pytest.approx(100 * MB / 10.0)
    assert (d.action, d.pages, d.near) == ("probe", 4, 4)
    d = slow.decide(100, PAGE, 16, near=60)
    assert (d.action, d.pages, d.near) == ("probe", 4, 0)
    assert slow.decide(100, PAGE, 16, near=60).action == "recompute"  # one of each per interval
    # Modes: never recomputes even near pages; always pulls all.
    assert PullPolicy(KVPullSection(mode="never")).decide(10, PAGE, 16, near=10).action == "recompute"
    d = PullPolicy(KVPullSection(mode="always")).decide(10, PAGE, 16, near=3)
    assert (d.pages, d.near) == (10, 3)
    text = generate_latest(REGISTRY).decode()
    for name in (
        'relay_kv_pull_estimate_seconds{path="near"}',
        "relay_kv_near_bandwidth_bytes_per_second",
        'relay_kv_near_decisions_total{remote="no"}',
        "relay_kv_near_hits_total",
        "relay_kv_near_evictions_total",
        "relay_kv_near_used_bytes",
    ):
        assert name in text


# ---------------------------------------------------------------------- engines

TINY = ModelConfig(
    arch="qwen3",
    vocab_size=512,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    hidden_dim=128,
    max_seq_len=1024,
    tie_embeddings=True,
    qk_norm=True,
)
# A small pool (40 pages of 8 tokens): another prompt evicts a turn's pages from the prefix cache.
ENGINE = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=512, block_size=8, num_kv_blocks=40)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kvnear")
    return (
        random_model_dir(TINY, root / "step_0", 0, 0, std=0.05),
        random_model_dir(TINY, root / "step_1", 1, 1, std=0.05),
    )


def generate(eng: LLMEngine, prompt: list[int], seed: int) -> GenerateResponse:
    sampling = SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)
    return eng.generate([GenerateRequest(input_ids=prompt, sampling=sampling)])[0]


def same(a: GenerateResponse, b: GenerateResponse) -> None:
    assert a.choices[0].output_ids == b.choices[0].output_ids
    assert a.choices[0].logprobs == pytest.approx(b.choices[0].logprobs, abs=1e-5)


def near_engine(path: Path, version: int, gateway: Gateway) -> tuple[LLMEngine, KVStoreClient, PagePublisher]:
    """An engine wired as decode / prefill wire theirs (router.attach_near + a PagePublisher)."""
    eng = LLMEngine(path, ENGINE, version=version)
    client = gateway.client()
    cfg = RunConfig()
    cfg.kvstore.near = KVNearSection(bytes=1 * MB)
    attach_near(eng, client, cfg)
    assert client.near is not None and eng.pages.host_pages is not None
    publisher = PagePublisher(client, page_nbytes(eng.kv))
    eng.pages.sink = publisher
    return eng, client, publisher


def test_second_turn_is_served_from_the_near_tier_with_the_same_tokens(
    weights: tuple[Path, Path], gateway: Gateway
) -> None:
    eng, client, publisher = near_engine(weights[0], 0, gateway)
    near = client.near
    assert near is not None
    turn1 = [(5 * i + 3) % 500 for i in range(170)]
    out1 = generate(eng, turn1, seed=1)
    publisher.flush()
    # The finished sequence's pages went device -> near slots, and the gateway got the same bytes
    # (sent from those slots).
    keys1 = prompt_keys(eng, turn1)
    assert near.run_length(keys1) == len(keys1) == 21
    held = near.acquire(keys1, count=False)
    assert gateway.store.get_many(keys1) == [
        held.tobytes()[i * near.page_bytes : (i + 1) * near.page_bytes] for i in range(21)
    ]
    assert held.tobytes() == export_pages(eng.kv, [eng.kv.blocks.lookup(k) for k in keys1])
    held.release()
    # The tier's memory was allocated on the engine's loop thread (under inference_mode): other
    # threads still write into it (a pull's fill, a put's write-through).
    extra = [key(800 + i) for i in range(2)]
    assert near.put(extra, os.urandom(2 * near.page_bytes)) == 2
    # Another agent's turn evicts turn 1's pages from the engine's small pool.
    generate(eng, [(11 * i + 7) % 500 for i in range(312)], seed=2)  # 318 tokens: all 40 pages
    publisher.flush()
    history = turn1 + out1.choices[0].output_ids
    turn2 = history + [(13 * i + 1) % 500 for i in range(40)]
    keys2 = prompt_keys(eng, turn2)
    assert eng.kv.blocks.lookup(keys2[0]) is None  # the prefix cache lost the head
    near_pages = near.run_length(keys2)
    assert near_pages >= len(keys1)  # turn 1's prompt pages (and its output's full pages)
    ram_hits = gateway.store.stats().tiers[0].hits
    hits = near.hits
    policy = engine_policy(eng, KVPullSection(mode="auto"))
    pulled = pull_prefix(eng, client, keys2, policy)
    assert pulled >= near_pages and near.hits - hits == near_pages
    assert policy.near_counts["all"] + policy.near_counts["only"] == 1
    assert gateway.store.stats().tiers[0].hits == ram_hits  # no page came from the gateway
    before = eng.stats.computed_tokens_total
    out2 = generate(eng, turn2, seed=3)
    assert eng.pages.near_import_bytes_total == near_pages * page_nbytes(eng.kv)
    # Only the tokens after the near run were computed (plus the sampled tokens but the last).
    assert eng.stats.computed_tokens_total - before == len(turn2) - near_pages * 8 + 5
    # The same tokens as an engine that recomputes everything.
    same(out2, generate(LLMEngine(weights[0], ENGINE, version=0), turn2, seed=3))
    publisher.close()
    client.close()


def test_a_weight_update_never_serves_stale_near_pages(weights: tuple[Path, Path], gateway: Gateway) -> None:
    eng, client, publisher = near_engine(weights[0], 0, gateway)
    near = client.near
    assert near is not None
    prompt = [(3 * i + 2) % 500 for i in range(120)]
    generate(eng, prompt, seed=4)
    publisher.flush()
    old_keys = prompt_keys(eng, prompt)
    assert near.run_length(old_keys) == len(old_keys) > 0
    eng.load_weights(weights[1], 1)  # other weights, version 1: keys are salted with it
    new_keys = prompt_keys(eng, prompt)
    assert set(new_keys).isdisjoint(old_keys) and near.run_length(new_keys) == 0
    hits = near.hits
    assert pull_prefix(eng, client, new_keys, None) == 0  # "always" pull: nothing to take
    assert near.hits == hits
    # Even forced: version-0 pages imported under their own keys are never matched by v1 lookups.
    run = near.acquire(old_keys, count=False)
    eng.pages.stage(run.keys, run, release=run.release)
    eng.pages.drain()
    before = eng.stats.computed_tokens_total
    out = generate(eng, prompt, seed=4)
    assert eng.stats.computed_tokens_total - before == len(prompt) + 5  # everything recomputed
    same(out, generate(LLMEngine(weights[1], ENGINE, version=1), prompt, seed=4))
    publisher.close()
    client.close()


def test_import_of_near_pages_some_already_cached_is_bitwise() -> None:
    src = KVCache(3, 12, 4, 48, 2, 8, torch.float32, torch.device("cpu"))
    src.k.normal_()
    src.v.normal_()
    kv = KVCache(3, 12, 4, 48, 2, 8, torch.float32, torch.device("cpu"))
    per = page_nbytes(kv)
    data = export_pages(src, [0, 1, 2, 3, 4])
    keys = [key(700 + i) for i in range(5)]
    near = NearCache(16 * per, per, pin=False, chunk_bytes=3 * per)  # the run spans two chunks
    assert near.put(keys, data) == 5
    # Pages 1 and 3 are already in the cache: only 0, 2, 4 are copied (a gather of rows).
    assert import_pages(kv, [keys[1], keys[3]], data[per : 2 * per] + data[3 * per : 4 * per]) == 2
    run = near.acquire(keys)
    assert import_pages(kv, keys, run) == 3
    run.release()
    got = [kv.blocks.lookup(k) for k in keys]
    assert export_pages(kv, got) == data
