"""A handed-off request starts on the decode as a pure decode (docs/kv-near.md, "Same-host handoff"):
a real prefill engine with a shared near tier and a real gateway data plane, a decode engine that
takes the prefill's first token and, through router.pull_prefilled, every full page of the prompt
(the last one too: no prompt token needs its logits on the decode) and the partial last page from
the handoff. Its first step feeds only the prefilled token; the tokens equal a colocated engine's.
A stale or mismatched tail is never used: those tokens are computed, with the same result."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.debug_weights import random_model_dir
from pydantic import ValidationError
from test_kv_near_cache import ENGINE, TINY, Gateway, gateway

from services.common.config import EngineConfig, KVNearSection, RunConfig
from services.common.prefill_schemas import HandoffSegment, KVHandoff
from services.common.schemas import GenerateRequest, GenerateResponse, SamplingParams
from services.engine import LLMEngine
from services.engine.kv_transfer import (
    PromptTail,
    chain_hashes,
    page_nbytes,
    prompt_tail_key,
    reusable_pages,
    tail_hash,
)
from services.kvstore.client import KVStoreClient, PagePublisher
from services.kvstore.handoff import HandoffLeases, HandoffReader, segment_list
from services.kvstore.near_cache import NearCache
from services.kvstore.router import HANDOFF_READER, attach_near, keep_tails, prompt_keys, pull_prefilled
from services.kvstore.shared_segment import SharedSegment

__all__ = ["gateway"]  # the real gateway fixture of test_kv_near_cache

MB = 1 << 20
BS = ENGINE.block_size  # 8
ACK_URL = "http://127.0.0.1:9/v1/handoff/ack"  # nothing listens: the ack fails fast, the lease ends it


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model_dir(TINY, tmp_path_factory.mktemp("kvfull") / "step_0", 0, 0, std=0.05)


def sampling(n: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=11, n=n, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class Prefill:
    """What services/prefill/server.py holds: an engine whose exports go into a shared near tier
    (full pages, and partial last pages through keep_tails), a publisher to the gateway, leases."""

    engine: LLMEngine
    client: KVStoreClient
    near: NearCache
    publisher: PagePublisher
    leases: HandoffLeases

    def run(self, prompt: list[int], n: int) -> tuple[list[tuple[int, float, int]], KVHandoff | None]:
        """Prefill `prompt` as the service does (one token per sample) and grant a handoff."""
        greq = GenerateRequest(input_ids=prompt, sampling=sampling(n, 1))
        resp = self.engine.generate([greq])[0]
        self.publisher.flush()
        first = [(c.output_ids[0], c.logprobs[0], c.versions[0]) for c in resp.choices]
        eng = self.engine
        keys = chain_hashes(prompt, 0, eng.layout, BS)
        tail = prompt_tail_key(prompt, 0, eng.layout, BS)
        return first, self.leases.grant_prompt(self.near, keys, tail, len(prompt) % BS)


@pytest.fixture
def prefill(weights: Path, gateway: Gateway) -> Iterator[Prefill]:
    yield from make_prefill(weights, gateway, ENGINE)


def make_prefill(weights: Path, gateway: Gateway, cfg_engine: EngineConfig) -> Iterator[Prefill]:
    eng = LLMEngine(weights, cfg_engine, version=0)
    client = gateway.client()
    cfg = RunConfig()
    cfg.kvstore.near = KVNearSection(bytes=1 * MB)
    attach_near(eng, client, cfg, shared=True)
    near = client.near
    assert near is not None and near.shared
    keep_tails(eng, near)
    publisher = PagePublisher(client, page_nbytes(eng.kv))
    eng.pages.sink = publisher
    p = Prefill(eng, client, near, publisher, HandoffLeases(30.0, ACK_URL))
    try:
        yield p
    finally:
        p.leases.close()
        publisher.close()
        near.close()
        client.close()


def colocated(
    weights: Path, prompt: list[int], n: int, max_tokens: int, cfg_engine: EngineConfig = ENGINE
) -> GenerateResponse:
    eng = LLMEngine(weights, cfg_engine, version=0)
    return eng.generate([GenerateRequest(input_ids=prompt, sampling=sampling(n, max_tokens))])[0]


def same(a: GenerateResponse, b: GenerateResponse) -> None:
    assert [c.output_ids for c in a.choices] == [c.output_ids for c in b.choices]
    for x, y in zip(a.choices, b.choices, strict=True):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def decode_run(
    decode: LLMEngine, prompt: list[int], rid: str, n: int, max_tokens: int
) -> tuple[int, GenerateResponse]:
    """Submit the staged request; (tokens its first step fed, the response)."""
    state = decode.add_request(
        GenerateRequest(input_ids=prompt, sampling=sampling(n, max_tokens), request_id=rid)
    )
    before = decode.stats.computed_tokens_total
    decode.step()
    fed = decode.stats.computed_tokens_total - before
    while not state.finished:
        decode.step()
    return fed, state.response()


def segment_of(near: NearCache, h: KVHandoff, i: int) -> SharedSegment:
    name = h.segments[h.seg[i]].name
    return next(s for s in near.shared_segments if s.name == name)


# ------------------------------------------------------------------ 1: every full page


def test_seeded_requests_take_every_full_page_and_the_colocated_rule_stays() -> None:
    assert reusable_pages(128, 8) == 15  # colocated: the last prompt token is computed
    assert reusable_pages(128, 8, seeded=True) == 16  # first token known: every full page
    assert reusable_pages(130, 8) == reusable_pages(130, 8, seeded=True) == 16
    assert reusable_pages(0, 8) == reusable_pages(0, 8, seeded=True) == 0


@pytest.mark.parametrize("via", ["handoff", "store"])
def test_page_aligned_prompt_is_admitted_with_only_the_first_token_to_compute(
    weights: Path, gateway: Gateway, prefill: Prefill, via: str
) -> None:
    """128 tokens = 16 full pages: the decode takes all 16 (from the same-host handoff, or from
    the gateway when there is none) and its first step feeds the prefilled token alone."""
    prompt = [(7 * i + 3) % 500 for i in range(128)]
    first, handoff = prefill.run(prompt, n=1)
    assert handoff is not None and handoff.full_pages == 16 and handoff.tail_tokens == 0
    decode = LLMEngine(weights, ENGINE, version=0)
    assert len(prompt_keys(decode, prompt)) == 15 and len(prompt_keys(decode, prompt, seeded=True)) == 16
    dclient = gateway.client()
    lookups = gateway.lookups
    try:
        got = pull_prefilled(decode, dclient, prompt, "r1", first, handoff if via == "handoff" else None)
    finally:
        dclient.close()
    assert got == 16
    if via == "handoff":
        assert gateway.lookups == lookups  # every page came from shared memory
    else:
        prefill.leases.ack(handoff.id)
    fed, out = decode_run(decode, prompt, "r1", n=1, max_tokens=6)
    assert decode.pages.imported_pages_total == 16
    assert decode.stats.prefix_cache_hit_tokens == 128
    assert fed == 1  # only the prefilled token: a decode step
    # No step of this decode fed more tokens than it had sequences: no prefill work at all.
    assert decode.stats.prefill_step_tokens_total == 0
    assert decode.stats.computed_tokens_total == 5  # t0 .. t4 fed, t1 .. t5 sampled
    same(out, colocated(weights, prompt, 1, 6))


# ------------------------------------------------------------------ 2: the partial last page


@pytest.mark.parametrize(("n", "overlap"), [(1, False), (2, False), (2, True)])
def test_partial_last_page_is_handed_off_and_only_the_first_token_is_fed(
    weights: Path, gateway: Gateway, prefill: Prefill, n: int, overlap: bool
) -> None:
    """130 tokens = 16 full pages + a 2-token tail: the handoff carries the tail too, each sample
    copies it into a page of its own, and each sample's first step feeds only its first token
    (also with overlap scheduling, the CUDA default)."""
    prompt = [(5 * i + 1) % 500 for i in range(130)]
    first, handoff = prefill.run(prompt, n=n)
    tail_key = prompt_tail_key(prompt, 0, prefill.engine.layout, BS)
    assert tail_key is not None
    assert handoff is not None and handoff.tail_tokens == 2 and handoff.full_pages == 16
    assert len(handoff.slots) == 17
    decode = LLMEngine(weights, ENGINE.model_copy(update={"overlap_schedule": overlap}), version=0)
    assert decode.overlap is overlap
    dclient = gateway.client()
    tails, copied, lookups = HANDOFF_READER.tails_copied, HANDOFF_READER.copied, gateway.lookups
    try:
        assert pull_prefilled(decode, dclient, prompt, "r2", first, handoff) == 16
    finally:
        dclient.close()
    assert HANDOFF_READER.copied - copied == 16 and HANDOFF_READER.tails_copied - tails == 1
    assert gateway.lookups == lookups
    fed, out = decode_run(decode, prompt, "r2", n=n, max_tokens=6)
    assert fed == n  # per sample its first token, nothing of the prompt
    assert decode.scheduler.tail_pages_used == n
    assert decode.stats.prefill_step_tokens_total == 0
    assert decode.stats.computed_tokens_total == n * 5
    same(out, colocated(weights, prompt, n, 6))
    # The partial page is never a full page anywhere: not in either prefix cache, not published.
    assert tail_key not in decode.kv.blocks.by_hash and tail_key not in prefill.engine.kv.blocks.by_hash
    assert not any(tail_key in t for t in gateway.store.tiers)
    assert tail_key not in set(chain_hashes(prompt + out.choices[0].output_ids, 0, decode.layout, BS))
    assert not decode.scheduler.tails  # consumed at admission
    assert decode.pages.take_tail("r2") is None


def test_prompt_shorter_than_a_page_is_handed_off_as_a_tail(
    weights: Path, gateway: Gateway, prefill: Prefill
) -> None:
    prompt = [9, 8, 7, 6, 5]
    first, handoff = prefill.run(prompt, n=1)
    assert handoff is not None and handoff.full_pages == 0 and handoff.tail_tokens == 5
    decode = LLMEngine(weights, ENGINE, version=0)
    dclient = gateway.client()
    try:
        assert pull_prefilled(decode, dclient, prompt, "r3", first, handoff) == 0
    finally:
        dclient.close()
    fed, out = decode_run(decode, prompt, "r3", n=1, max_tokens=4)
    assert fed == 1 and decode.scheduler.tail_pages_used == 1
    same(out, colocated(weights, prompt, 1, 4))


def test_stale_tail_is_computed_instead(weights: Path, gateway: Gateway, prefill: Prefill) -> None:
    """The tail's slot is rewritten after the handoff (the seqlock's generation moves): the
    decode does not copy it, takes the 16 full pages, and computes the 2 tail tokens itself."""
    prompt = [(3 * i + 2) % 500 for i in range(130)]
    first, handoff = prefill.run(prompt, n=1)
    assert handoff is not None and handoff.tail_tokens == 2
    segment_of(prefill.near, handoff, 16).begin_write(handoff.slots[16])
    decode = LLMEngine(weights, ENGINE, version=0)
    dclient = gateway.client()
    tails, stale = HANDOFF_READER.tails_copied, HANDOFF_READER.stale
    try:
        assert pull_prefilled(decode, dclient, prompt, "r4", first, handoff) == 16
    finally:
        dclient.close()
    assert HANDOFF_READER.tails_copied == tails and HANDOFF_READER.stale - stale == 1
    fed, out = decode_run(decode, prompt, "r4", n=1, max_tokens=6)
    assert fed == 2 + 1 and decode.scheduler.tail_pages_used == 0
    same(out, colocated(weights, prompt, 1, 6))


def test_tail_of_other_tokens_or_without_its_full_pages_is_never_used(
    weights: Path, gateway: Gateway, prefill: Prefill
) -> None:
    """The scheduler's own guard (Scheduler._tail): a staged tail whose key is not this prompt's
    chain's, or whose full pages are not all cached, is dropped and the tokens computed."""
    prompt = [(11 * i + 4) % 500 for i in range(130)]
    first, handoff = prefill.run(prompt, n=1)
    assert handoff is not None and handoff.tail_tokens == 2
    ref = colocated(weights, prompt, 1, 6)
    decode = LLMEngine(weights, ENGINE, version=0)
    dclient = gateway.client()
    try:
        assert pull_prefilled(decode, dclient, prompt, "r5", first, handoff) == 16
    finally:
        dclient.close()
    real = decode.pages.take_tail("r5")
    assert real is not None
    # Same bytes, the key of other tail tokens: not this prompt's tail.
    keys = chain_hashes(prompt, 0, decode.layout, BS)
    decode.pages.stage_tail("r5", PromptTail(tail_hash(keys[-1], [1, 2]), 2, real.data))
    fed, out = decode_run(decode, prompt, "r5", n=1, max_tokens=6)
    assert fed == 3 and decode.scheduler.tail_pages_used == 0
    same(out, ref)
    # The right tail on an engine that lacks the full pages (nothing pulled): recomputed.
    fresh = LLMEngine(weights, ENGINE, version=0)
    fresh.pages.stage_first("r6", first)
    fresh.pages.stage_tail("r6", real)
    fed, out = decode_run(fresh, prompt, "r6", n=1, max_tokens=6)
    assert fed == 130 + 1 and fresh.scheduler.tail_pages_used == 0
    same(out, ref)


@pytest.mark.parametrize("tail_tokens", [3, -1])
def test_handoff_schema_names_the_tail_field(tail_tokens: int) -> None:
    """A tail of 3 tokens with no slot for it, or a negative count: the error names the field."""
    with pytest.raises(ValidationError, match="tail_tokens"):
        KVHandoff(
            id="x",
            page_bytes=1,
            segments=[],
            seg=[],
            slots=[],
            gens=[],
            lease_s=1,
            ack_url="u",
            tail_tokens=tail_tokens,
        )


# ------------------------------------------------------------------ 3: segments mapped ahead


def test_segments_mapped_ahead_are_what_the_first_handoff_reads(prefill: Prefill) -> None:
    """HandoffReader.map_segments (what the decode's background task calls with the prefill's
    GET /v1/handoff/segments): every segment mapped once, the first handoff maps nothing more,
    a segment that is not here is skipped."""
    reader = HandoffReader()
    try:
        segs = segment_list(prefill.near.shared_segments)
        assert segs
        assert reader.map_segments(segs, prefill.near.page_bytes, pin=False) == len(segs)
        assert reader.map_segments(segs, prefill.near.page_bytes, pin=False) == 0  # already mapped
        elsewhere = HandoffSegment(name="relay-kv-another-host", token="0" * 32)
        assert reader.map_segments([elsewhere], prefill.near.page_bytes, pin=False) == 0
        mapped = dict(reader._maps)
        prompt = [(13 * i + 5) % 500 for i in range(64)]
        _first, handoff = prefill.run(prompt, n=1)
        assert handoff is not None
        keys = chain_hashes(prompt, 0, prefill.engine.layout, BS)
        got, pages = reader.fetch(handoff, keys, 0, torch.device("cpu"))
        assert got == 8 and pages is not None
        assert all(reader._maps[name] is seg for name, seg in mapped.items())  # the same mappings
        assert reader.premapped == len(segs)
    finally:
        reader.close()


# ------------------------------------------------------------------ on the GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("piece_pages", [0, 3])
def test_cuda_handed_off_request_starts_with_a_cuda_graph_decode_step(
    weights: Path, gateway: Gateway, piece_pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA (Triton attention, CUDA graphs, overlap scheduling): the handed-off request with a
    partial last page is admitted with the whole prompt cached, and its first step, like every
    later one, replays a decode graph (no eager mixed step). GPU machine:
    `.venv/bin/pytest -q tests/test_kv_handoff_full.py -k cuda`."""
    cuda = ENGINE.model_copy(update={"device": "cuda"})
    gen = make_prefill(weights, gateway, cuda)
    pf = next(gen)
    try:
        prompt = [(5 * i + 1) % 500 for i in range(130)]
        first, handoff = pf.run(prompt, n=2)
        assert handoff is not None and handoff.tail_tokens == 2
        decode = LLMEngine(weights, cuda, version=0)
        assert decode.graphs is not None and decode.overlap
        if piece_pages:  # the import goes into the pool 3 pages per step (kv_transfer.drain)
            import services.engine.kv_transfer as kvt

            monkeypatch.setattr(kvt, "IMPORT_BYTES_PER_STEP", piece_pages * kvt.page_nbytes(decode.kv))
        dclient = gateway.client()
        try:
            assert pull_prefilled(decode, dclient, prompt, "g1", first, handoff) == 16
        finally:
            dclient.close()
        drains = 0
        while decode.pages.pending:  # the import lands (side stream) before the request arrives
            decode.step()
            drains += 1
        assert decode.pages.imported_pages_total == 16 and not decode.pages.landing_keys
        if piece_pages:
            assert drains >= 16 // piece_pages
        graph_steps: list[int] = []
        run = decode.graphs.run

        def counted(hb, feed=None):  # noqa: ANN001, ANN202 - the real graph replay, counted
            graph_steps.append(len(hb.ids))
            return run(hb, feed)

        decode.graphs.run = counted  # type: ignore[method-assign]
        fed, out = decode_run(decode, prompt, "g1", n=2, max_tokens=6)
        assert fed == 2 and decode.scheduler.tail_pages_used == 2
        assert decode.stats.prefill_step_tokens_total == 0
        assert graph_steps and graph_steps[0] == 2  # the first step: both samples' t0, a graph
        same(out, colocated(weights, prompt, 2, 6, cuda))
    finally:
        gen.close()


def test_admission_reuses_the_pull_keys_and_never_stale_ones(weights: Path) -> None:
    """The page keys pull_prefilled computed are what admission looks up (no second hashing of
    the prompt in the loop thread); keys staged for another weight version are not used."""
    import services.engine.scheduler as sched

    eng = LLMEngine(weights, EngineConfig(device="cpu", max_seq_len=256, block_size=4))
    prompt = list(range(3, 3 + 16))
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    eng.generate([GenerateRequest(input_ids=prompt, sampling=greedy)])  # the prompt's pages cached
    keys = prompt_keys(eng, prompt, seeded=True)
    assert len(keys) == 4
    real, calls = sched.block_hash, []

    def counting(prev: bytes, toks: list[int]) -> bytes:
        calls.append(len(toks))
        return real(prev, toks)

    for version, hashed in ((eng.version, 0), (eng.version + 7, 4)):
        rid = f"r{version}"
        eng.pages.stage_first(rid, [(5, -1.0, eng.version)])
        eng.pages.stage_keys(rid, version, keys)
        state = eng.add_request(GenerateRequest(input_ids=prompt, request_id=rid, sampling=greedy))
        calls.clear()
        sched.block_hash = counting
        try:
            plan = eng.scheduler.schedule()
        finally:
            sched.block_hash = real
        assert len(calls) == hashed
        seq = state.seqs[0]
        assert seq.num_cached == 16 and [n for s, n in plan.compute if s is seq] == [1]
        while not state.finished:
            eng.step()
    assert not eng.scheduler.known_keys


def test_reader_reuses_released_device_buffers() -> None:
    """The handoff reader's staging buffers come back on release and serve the next pull of a
    size they hold (no allocation per pull); too small ones and unreleased ones are not reused."""
    reader = HandoffReader()
    cpu = torch.device("cpu")
    buf = reader._buffer(1000, cpu)
    pages = buf[:800].view(8, 100)
    reader._taken[pages.data_ptr()] = buf
    assert reader._buffer(900, cpu) is not buf  # still taken
    reader.release(pages[:5])  # what the engine stages: a leading slice of the fetch
    assert reader._buffer(2000, cpu) is not buf  # too small for this pull
    assert reader._buffer(900, cpu) is buf
    reader.release(torch.empty(4))  # not from the reader: ignored
    assert not reader._free
    # Two free buffers of different sizes: the smallest that fits is the one handed out.
    small, big = reader._buffer(100, cpu), reader._buffer(5000, cpu)
    for b in (big, small):
        reader._taken[b.data_ptr()] = b
        reader.release(b)
    assert reader._buffer(50, cpu) is small and reader._buffer(50, cpu) is big
