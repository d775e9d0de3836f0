"""KV pages between engines (services/engine/kv_transfer.py) through a real tiered store, in process:
export -> store -> import gives the same tokens as computing, only the missing tokens are computed,
a weight update or another layout never reuses a page, a prefilled first token continues exactly.
(The same paths as services over HTTP: tests/test_kvstore_services.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from services.common.config import EngineConfig, KVPullSection, load_config
from services.common.schemas import GenerateRequest, GenerateResponse, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_transfer import (
    StagingBuffers,
    chain_hashes,
    export_pages,
    import_pages,
    layout_id,
    page_nbytes,
    reusable_pages,
)
from services.kvstore.client import KVStoreClient
from services.kvstore.dataplane import DataPlaneServer
from services.kvstore.pull_policy import PullPolicy
from services.kvstore.router import prompt_keys, pull_prefix
from services.kvstore.tiers import MemoryTier, TieredStore
from trainer.model import build_model, save_weights_dir

CFG = EngineConfig(device="cpu", max_batch_size=8, max_seq_len=128, block_size=4)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kvx")
    m = load_config("debug").model
    out = []
    for seed in (0, 1):
        state = build_model(m, seed=seed).state_dict()
        state["norm.weight"] = state["norm.weight"] * 0.3  # spread-out distributions
        out.append(save_weights_dir(m, state, root / f"step_{seed}", {"version": seed}))
    return out[0], out[1]


def req(prompt: list[int], **sampling: object) -> GenerateRequest:
    return GenerateRequest(input_ids=prompt, sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


def same(a: GenerateResponse, b: GenerateResponse) -> None:
    assert [c.output_ids for c in a.choices] == [c.output_ids for c in b.choices]
    for x, y in zip(a.choices, b.choices, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        assert x.finish_reason == y.finish_reason


class StoreSink:
    """An engine page sink writing straight into a TieredStore (what PagePublisher does over HTTP)."""

    def __init__(self, store: TieredStore, page_bytes: int):
        self.store, self.page_bytes = store, page_bytes
        self.finished: list[str] = []

    def __call__(self, keys: list[bytes], data: bytes, finished: list[str]) -> None:
        for i, k in enumerate(keys):
            assert self.store.put(k, data[i * self.page_bytes : (i + 1) * self.page_bytes])
        self.finished += finished


def pull(eng: LLMEngine, store: TieredStore, prompt: list[int]) -> int:
    keys = chain_hashes(prompt, eng.version, eng.layout, eng.kv.block_size, reusable_pages(len(prompt), 4))
    got = []
    for k, page in zip(keys, store.get_many(keys), strict=True):
        if page is None:
            break
        got.append((k, page))
    eng.pages.stage([k for k, _ in got], b"".join(p for _, p in got))
    return len(got)


PROMPT = [(7 * i + 3) % 60 for i in range(41)]  # 41 tokens: 10 full pages + 1


def test_export_import_roundtrip_is_bitwise(dirs: tuple[Path, Path]) -> None:
    a = LLMEngine(dirs[0], CFG)
    a.generate([req(PROMPT, temperature=0.0, max_tokens=3, ignore_eos=True)])
    keys = chain_hashes(PROMPT, a.version, a.layout, 4)
    pages = [a.kv.blocks.lookup(k) for k in keys]
    assert None not in pages
    blob = export_pages(a.kv, pages)  # type: ignore[arg-type]
    assert len(blob) == len(pages) * page_nbytes(a.kv)
    b = LLMEngine(dirs[0], CFG)
    assert import_pages(b.kv, keys, blob) == len(keys)
    assert import_pages(b.kv, keys, blob) == 0  # already cached: nothing imported twice
    for k, pa in zip(keys, pages, strict=True):
        pb = b.kv.blocks.lookup(k)
        assert pb is not None
        for ta, tb in ((a.kv.k, b.kv.k), (a.kv.v, b.kv.v)):
            assert torch.equal(ta[:, pa * 4 : pa * 4 + 4], tb[:, pb * 4 : pb * 4 + 4])
    # Imported pages sit in the evictable pool (ref 0): they never block admissions.
    assert b.kv.num_free == b.kv.num_blocks


def test_pulled_pages_give_same_tokens_and_compute_only_the_rest(dirs: tuple[Path, Path]) -> None:
    store = TieredStore([MemoryTier(64 << 20)])
    a = LLMEngine(dirs[0], CFG)
    a.pages.sink = StoreSink(store, page_nbytes(a.kv))
    r = req(PROMPT, temperature=1.0, seed=11, n=2, max_tokens=6, ignore_eos=True)
    first = a.generate([r])[0]
    assert a.pages.exported_pages_total > 0

    b = LLMEngine(dirs[0], CFG)  # a restarted decode: empty local cache
    assert pull(b, store, PROMPT) == 10
    again = b.generate([r])[0]
    same(again, first)
    assert b.stats.prefix_cache_hit_tokens == 40
    # 1 prompt token + 5 decode steps per sample (the 6th token is never fed)
    assert b.stats.computed_tokens_total == 1 + 5 * 2


def test_weight_update_never_reuses_stale_pages(dirs: tuple[Path, Path]) -> None:
    store = TieredStore([MemoryTier(64 << 20)])
    old = LLMEngine(dirs[0], CFG)
    old.pages.sink = StoreSink(store, page_nbytes(old.kv))
    r = req(PROMPT, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    old.generate([r])
    assert len(store.tiers[0]) >= 10

    new = LLMEngine(dirs[0], CFG)
    new.load_weights(dirs[1], 1)
    assert pull(new, store, PROMPT) == 0  # version-1 keys: the version-0 pages are never found
    # Even pages forced into the cache under their (version-0) keys are never hit at version 1.
    keys0 = chain_hashes(PROMPT, 0, new.layout, 4)
    new.pages.stage(keys0, b"".join(p for p in store.get_many(keys0) if p is not None))
    out = new.generate([r])[0]
    assert new.pages.imported_pages_total == 10
    assert new.stats.prefix_cache_hit_tokens == 0
    same(out, LLMEngine(dirs[1], CFG, version=1).generate([r])[0])
    assert out.choices[0].versions == [1] * 5


def test_layout_id_separates_models_dtypes_and_page_sizes(dirs: tuple[Path, Path]) -> None:
    base = LLMEngine(dirs[0], CFG)
    other_bs = LLMEngine(dirs[0], CFG.model_copy(update={"block_size": 8}))
    other_dtype = LLMEngine(dirs[0], CFG.model_copy(update={"dtype": "bfloat16"}))
    ids = {base.layout, other_bs.layout, other_dtype.layout}
    assert len(ids) == 3
    assert layout_id("llama3", base.kv) != base.layout  # another architecture of the same shape
    k = [chain_hashes(PROMPT, 0, e.layout, 4)[0] for e in (base, other_bs, other_dtype)]
    assert len(set(k)) == 3


def test_prefilled_first_token_continues_exactly(dirs: tuple[Path, Path]) -> None:
    """Disaggregation at engine level: a prefill engine samples the first token of each sample and
    publishes the prompt pages; a decode engine imports them and continues: same tokens as one engine."""
    store = TieredStore([MemoryTier(64 << 20)])
    for sampling in (
        dict(temperature=1.0, seed=5, n=3, max_tokens=7, ignore_eos=True),
        dict(temperature=0.0, max_tokens=4, ignore_eos=True),
        dict(temperature=0.8, top_k=10, seed=2, max_tokens=1, ignore_eos=True),
    ):
        r = req(PROMPT, **sampling)
        colocated = LLMEngine(dirs[0], CFG).generate([r])[0]

        pre = LLMEngine(dirs[0], CFG)
        pre.pages.sink = StoreSink(store, page_nbytes(pre.kv))
        one = r.model_copy(update={"sampling": r.sampling.model_copy(update={"max_tokens": 1})})
        first = pre.generate([one])[0]

        dec = LLMEngine(dirs[0], CFG)
        pull(dec, store, PROMPT)
        dec.pages.stage_first(
            "req-1", [(c.output_ids[0], c.logprobs[0], c.versions[0]) for c in first.choices]
        )
        out = dec.generate([r.model_copy(update={"request_id": "req-1"})])[0]
        same(out, colocated)
        # Decode computed no prompt page: per sample the last prompt token and the prefilled one,
        # then one token per decode step (the last sampled token is never fed).
        n, max_tokens = r.sampling.n, r.sampling.max_tokens
        assert dec.stats.computed_tokens_total == (0 if max_tokens == 1 else n * max_tokens)


# ---------------------------------------------------------------------- decode's pull (router.pull_prefix)


def served_store(eng: LLMEngine, store: TieredStore) -> tuple[KVStoreClient, DataPlaneServer, list[bytes]]:
    """PROMPT's 10 pages computed by `eng` into `store`, served by a real data plane, and a client
    of it (the address GET /v1/dataplane would give); also PROMPT's page keys."""
    eng.pages.sink = StoreSink(store, page_nbytes(eng.kv))
    eng.generate([req(PROMPT, temperature=0.0, max_tokens=1)])
    server = DataPlaneServer(lambda: store, "127.0.0.1", max_request_bytes=64 << 20).start()
    client = KVStoreClient("http://127.0.0.1:9", timeout_s=10, retry_after_s=0.0)
    client._planes["http://127.0.0.1:9"] = ("127.0.0.1", server.port)
    return client, server, prompt_keys(eng, PROMPT)


def test_drain_drops_a_batch_of_the_wrong_length(dirs: tuple[Path, Path]) -> None:
    """Runs on the loop thread: a bad staged batch is dropped (and its buffer released), the
    batches around it still import, nothing raises into the step."""
    store = TieredStore([MemoryTier(64 << 20)])
    a = LLMEngine(dirs[0], CFG)
    client, server, keys = served_store(a, store)
    server.close()
    client.close()
    per = page_nbytes(a.kv)
    pages = store.get_many(keys)
    b = LLMEngine(dirs[0], CFG)
    released: list[str] = []
    b.pages.stage(keys[:3], b"".join(pages[:3]) + b"x", release=lambda: released.append("bad"))  # type: ignore[operator]
    b.pages.stage(keys[:4], b"".join(pages[:4]), release=lambda: released.append("good"))  # type: ignore[arg-type]
    assert b.pages.drain() == 4
    assert released == ["bad", "good"] and b.pages.dropped_batches_total == 1
    assert b.pages.import_bytes_total == 4 * per


def test_pull_stops_at_a_short_page(dirs: tuple[Path, Path]) -> None:
    """A page cut short (a gateway crash mid-write) ends the pulled run: the pages before it are
    imported, the rest computed; generate gives the same tokens."""
    store = TieredStore([MemoryTier(64 << 20)])
    a = LLMEngine(dirs[0], CFG)
    client, server, keys = served_store(a, store)
    try:
        short = TieredStore([MemoryTier(64 << 20)])
        for k, p in zip(keys, store.get_many(keys), strict=True):
            assert p is not None
            short.put(k, p[: len(p) // 2] if k == keys[3] else p)
        server.store = lambda: short
        b = LLMEngine(dirs[0], CFG)
        assert pull_prefix(b, client, keys) == 3
        assert b.pages.drain() == 3 and b.pages.dropped_batches_total == 0
        r = req(PROMPT, temperature=1.0, seed=4, max_tokens=3, ignore_eos=True)
        same(b.generate([r])[0], LLMEngine(dirs[0], CFG).generate([r])[0])
        assert b.stats.prefix_cache_hit_tokens == 3 * 4
    finally:
        server.close()
        client.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host where pinned memory cannot be allocated")
def test_pull_survives_a_staging_allocation_failure(dirs: tuple[Path, Path]) -> None:
    """Pinned staging memory that cannot be allocated (here: no CUDA, a real RuntimeError from
    torch) means the prefix is computed, never a failed request."""
    store = TieredStore([MemoryTier(64 << 20)])
    a = LLMEngine(dirs[0], CFG)
    client, server, keys = served_store(a, store)
    try:
        b = LLMEngine(dirs[0], CFG)
        b.pages.buffers = StagingBuffers(pin=True)
        errors = REGISTRY.get_sample_value("relay_kv_pull_errors_total") or 0.0
        assert pull_prefix(b, client, keys, PullPolicy(KVPullSection(mode="always"))) == 0
        assert REGISTRY.get_sample_value("relay_kv_pull_errors_total") == errors + 1
        assert b.pages.drain() == 0
        r = req(PROMPT, temperature=0.0, max_tokens=2)
        same(b.generate([r])[0], a.generate([r])[0])
        # A working buffer again: the same client pulls (its connection was replaced).
        c = LLMEngine(dirs[0], CFG)
        c.pages.buffers = StagingBuffers(pin=False)
        assert pull_prefix(c, client, keys) == 10
    finally:
        server.close()
        client.close()


def test_pull_caps_at_free_pages_and_observes_only_round_trips(dirs: tuple[Path, Path]) -> None:
    store = TieredStore([MemoryTier(64 << 20)])
    a = LLMEngine(dirs[0], CFG)
    client, server, keys = served_store(a, store)
    try:
        # No gateway (down, none registered): no round trip, so nothing for the latency estimate
        # and the probe clock is not reset.
        policy = PullPolicy(KVPullSection(mode="always"))
        b = LLMEngine(dirs[0], CFG)
        assert pull_prefix(b, KVStoreClient(lambda: None), keys, policy) == 0
        assert policy.latency.samples == 0 and policy.pull_bw.samples == 0
        assert policy._last_pull_at == -1e18
        # A real round trip is observed.
        assert pull_prefix(b, client, keys, policy) == 10
        assert policy.latency.samples + policy.pull_bw.samples == 1
        # An engine with 6 free pages asks the store for 6, not 10.
        small = LLMEngine(dirs[0], CFG.model_copy(update={"num_kv_blocks": 6}))
        assert small.kv.blocks.num_free == 6
        assert pull_prefix(small, client, keys) == 6
        assert small.pages.drain() == 6
    finally:
        server.close()
        client.close()


def test_background_hashing_lets_the_gil_go_and_keys_stay_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router's pull hashes a long prompt's chain off the engine's loop thread: it must pause
    every BREATHE_PAGES pages (interference runs 19-21: without it, decode steps overlapping a pull
    took 6-9 ms), and the keys must be the block_hash chain the scheduler computes."""
    from services.engine import kv_transfer
    from services.engine.block_manager import block_hash, root_hash

    prompt = [(i * 7919) % 50_000 for i in range(4 * kv_transfer.BREATHE_PAGES * 4 + 3)]
    pauses: list[float] = []
    monkeypatch.setattr(kv_transfer.time, "sleep", pauses.append)
    quiet = chain_hashes(prompt, 5, "lay", 4)
    assert pauses == []
    loud = chain_hashes(prompt, 5, "lay", 4, breathe=True)
    assert pauses == [kv_transfer.BREATHE_S] * 4 and all(p > 0 for p in pauses)
    prev, want = root_hash(5, "lay"), []
    for i in range(len(prompt) // 4):
        prev = block_hash(prev, prompt[4 * i : 4 * i + 4])
        want.append(prev)
    assert quiet == loud == want
