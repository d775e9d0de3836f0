"""Where a request's prompt KV comes from: the local prefix cache, the KV store, or a prefill service.

Decode calls `KVRouter.generate` instead of submitting straight to its engine:
  1. the prompt's full-page keys (hash chain rooted at the engine's weight version and layout) are
     checked against the local prefix cache;
  2. if what is left to compute is at least prefill.min_new_tokens and a prefill service with the
     same weight version is registered, that service prefills the prompt (publishing its pages to
     the store) and returns each sample's first token; short prompts are prefilled locally;
  3. the pages still missing locally are pulled from the store (the longest cached prefix) and
     staged into the engine, which imports them before its next admission, but only when the
     pull is expected to be faster than recomputing those tokens (pull_policy.py, measured);
     when the prefill answered with a handoff (same host), its pages are first copied straight
     from the prefill's shared near tier (services/kvstore/handoff.py) and only the rest pulled;
  4. the request is submitted, with the first tokens from step 2 if any: decode continues from
     there (same seed, same per-sample RNG stream, so the tokens equal a colocated run's).
Every remote step is best effort: a gateway or prefill service that is down, slow, or on other
weights only means those tokens are computed here. Multi-turn rollouts re-send the previous turn's
prompt + output as the prefix of the next prompt; those pages are in the local cache or the store
(decode publishes the pages of every finished sequence), so only the new tokens are computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import uuid
from typing import Any

import httpx
import numpy as np
import torch
from prometheus_client import Counter

from services.common.auth import auth_headers
from services.common.config import KVPullSection, RunConfig
from services.common.prefill_schemas import (
    HandoffAck,
    HandoffSegments,
    KVHandoff,
    PrefillRequest,
    PrefillResponse,
)
from services.common.registry import Lookup, Registry
from services.common.schemas import GenerateRequest, GenerateResponse
from services.engine.async_engine import AsyncEngine
from services.engine.kv_transfer import (
    PromptTail,
    chain_hashes,
    prompt_tail_key,
    reusable_pages,
)
from services.engine.llm_engine import LLMEngine
from services.kvstore.client import KVStoreClient, PagePublisher
from services.kvstore.handoff import HandoffReader
from services.kvstore.near_cache import NearCache, near_for_engine
from services.kvstore.pull_policy import PullPolicy

log = logging.getLogger(__name__)

PULLED_PAGES = Counter("relay_kv_pulled_pages", "KV pages pulled from the KV store into the engine")
PULL_ERRORS = Counter("relay_kv_pull_errors", "pulls that failed inside decode (the prefix is recomputed)")
REMOTE_PREFILLS = Counter("relay_kv_remote_prefills", "prompts prefilled by a prefill service", ["outcome"])
HANDOFF_ACK_ERRORS = Counter("relay_kv_handoff_ack_errors", "handoff acks that failed (the lease ends them)")
DISCOVERY_TTL_S = 1.0
JSON = {"content-type": "application/json"}
ACK_TIMEOUT_S = 2.0
# How often decode looks for same-host prefills whose shared segments it has not mapped yet.
PREMAP_INTERVAL_S = 2.0
SEGMENTS_TIMEOUT_S = 5.0
# Segment mappings are cached per process (one registration per segment): one reader for all pulls.
HANDOFF_READER = HandoffReader()


def store_client(cfg: RunConfig, lookup: Lookup | None) -> KVStoreClient:
    """A client of the run's gateway: kvstore.url, else the first one registered."""
    sec = cfg.kvstore
    if sec.url:
        return KVStoreClient(sec.url, sec.timeout_s, sec.retry_after_s, sec.max_request_bytes)
    if lookup is None:
        raise ValueError("kvstore.url is empty and there is no registry to find the gateway in")
    reg = Registry(lookup, refresh_s=DISCOVERY_TTL_S)
    return KVStoreClient(
        lambda: next((s.url for s in reg.get("kvstore")), None),
        sec.timeout_s,
        sec.retry_after_s,
        sec.max_request_bytes,
    )


def local_prefix_pages(engine: LLMEngine, keys: list[bytes]) -> int:
    """Leading pages of `keys` in the engine's prefix cache. Read from outside the loop thread, so
    only a hint (a page may be evicted before admission; the engine then computes it)."""
    best = 0
    for kv in engine.kv_pools:  # with data-parallel attention: the group holding the most
        n = 0
        by_hash = kv.blocks.by_hash
        for k in keys:
            if k not in by_hash:
                break
            n += 1
        best = max(best, n)
    return best


def prompt_keys(engine: LLMEngine, prompt: list[int], seeded: bool = False) -> list[bytes]:
    """(Off the engine's loop thread: the hashing lets the GIL go, chain_hashes `breathe`.) Keys of the prompt's pages the engine can take from elsewhere: all but the one holding the
    last prompt token (computed for its logits), or with `seeded` (the first token came from a
    prefill service) every full page (kv_transfer.reusable_pages)."""
    bs = engine.kv.block_size
    limit = reusable_pages(len(prompt), bs, seeded=seeded)
    return chain_hashes(prompt, engine.version, engine.layout, bs, limit=limit, breathe=True)


def engine_policy(engine: LLMEngine, cfg: KVPullSection) -> PullPolicy:
    """A pull policy fed by this engine's own measurements (prefill steps, page imports)."""
    st, pages = engine.stats, engine.pages
    return PullPolicy(
        cfg,
        prefill_counters=lambda: (st.prefill_step_tokens_total, st.prefill_step_seconds_total),
        import_counters=lambda: (pages.import_bytes_total, pages.import_seconds_total),
        near_import_counters=lambda: (pages.near_import_bytes_total, pages.near_import_seconds_total),
    )


def attach_near(engine: LLMEngine, store: KVStoreClient, cfg: RunConfig, shared: bool = False) -> None:
    """Give `store` a near tier (kvstore.near) for this engine's page layout, in pinned host memory
    on CUDA: pulled and published pages stay in this process, one host -> device copy away.
    `shared`: in named shared-memory segments, for handoffs (a prefill service's tier)."""
    if store.near is None:
        store.near = near_for_engine(engine, cfg.kvstore.near, shared=shared)
        if store.near is not None and shared:
            # Every segment exists from the start, so a decode's first handoff lists (and maps)
            # the whole tier at once (handoff.HandoffLeases.grant).
            store.near.reserve()
    if store.near is not None and store.near.page_bytes == engine.pages.page_bytes:
        # Exports go device -> pinned slots once; the publisher sends from there.
        engine.pages.host_pages = store.near.hold_export


def keep_tails(engine: LLMEngine, near: NearCache) -> None:
    """A prefill that hands off: the partial last prompt page of every prompt it computes goes
    into its shared near tier under its tail key (kv_transfer.tail_hash), never to the gateway nor
    a prefix cache (a partial page is not a reusable page), so a handoff can carry it and the
    decode computes no prompt token at all (pull_prefilled). No-op for a private tier."""
    if not near.shared:
        return

    def sink(key: bytes, blob: torch.Tensor) -> None:  # loop thread: must not raise
        try:
            near.put([key], blob)
        except (RuntimeError, ValueError) as e:  # the decode computes the tail itself then
            log.warning(f"keeping a partial last page in the near tier failed: {e}")

    engine.pages.tail_sink = sink


def reserve_pinned(engine: LLMEngine, store: KVStoreClient, buffers: int = 2) -> None:
    """On CUDA, pin the host memory pulls land in now (the near tier, and `buffers` staging
    buffers of one full-length sequence's pages, at most 4 GiB each): pinning later, on a long
    prompt's first pull, holds the driver lock for ~1 s and stalls every decoding stream
    (measured on an H200)."""
    if engine.kv.k.device.type != "cuda":
        return
    if store.near is not None:
        store.near.reserve()
    seq_bytes = engine.kv.blocks_for(engine.cfg.max_seq_len) * engine.pages.page_bytes
    engine.pages.buffers.reserve(buffers, min(seq_bytes, 4 << 30))


def pull_prefix(
    engine: LLMEngine,
    store: KVStoreClient,
    keys: list[bytes],
    policy: PullPolicy | None = None,
    handoff: KVHandoff | None = None,
    tail: tuple[str, list[int]] | None = None,
) -> int:
    """Stage the longest prefix of `keys` the store has and the local cache lacks, if the policy
    says pulling beats recomputing it (no policy: always pull). Blocking; returns pages staged.
    The reply is received into a reused (on CUDA pinned) staging buffer that is given back once
    the engine has imported it. `handoff` (a prefill response's, same host): its pages are copied
    from the prefill's shared near tier first (validated), the handoff acked, and only the pages
    after them pulled. `tail` (request id, prompt) with a handoff: the prompt's partial last page
    is copied from it too (validated the same way) and staged for that request (PromptTail).
    Never raises: whatever goes wrong here (a staging buffer that cannot be allocated, ...) is
    logged and counted, and the prefix is computed instead."""
    try:
        got = _pull_prefix(engine, store, keys, policy, handoff)
        if handoff is not None and tail is not None:
            _pull_tail(engine, handoff, *tail, keys=keys)
        return got
    except Exception:  # noqa: BLE001 - a pull is an optimisation: never a failed request
        PULL_ERRORS.inc()
        log.exception("kv pull failed; computing the prefix instead")
        return 0
    finally:
        if handoff is not None:
            ack_handoff(handoff)


def pull_prefilled(
    engine: LLMEngine,
    store: KVStoreClient,
    prompt: list[int],
    request_id: str,
    first: list[tuple[int, float, int]],
    handoff: KVHandoff | None = None,
) -> int:
    """After a remote prefill: stage every full page of the prompt (the handoff's, then the
    store's), the partial last page when the handoff carries it, and the first tokens, so the
    request is admitted with the whole prompt cached and its first step feeds only the prefilled
    token: a decode step (a CUDA graph), not a mixed one. What is missing or stale is computed
    (the tail too). Blocking; returns full pages staged. The caller submits the request with
    `request_id` and drops what it did not consume (`engine.pages.forget`). The page keys go
    along too: admission reuses them instead of hashing a long prompt again in the loop thread
    (~2 ms for 16k tokens, inside a decode step)."""
    version = engine.version
    keys = prompt_keys(engine, prompt, seeded=True)
    got = pull_prefix(engine, store, keys, None, handoff, tail=(request_id, prompt))
    engine.pages.stage_first(request_id, first)
    engine.pages.stage_keys(request_id, version, keys)
    return got


def ack_handoff(handoff: KVHandoff) -> None:
    """Tell the prefill its handed-off slots may go (best effort: else its lease ends them)."""
    try:
        r = httpx.post(
            handoff.ack_url,
            content=HandoffAck(id=handoff.id).model_dump_json(),
            headers={**JSON, **auth_headers()},
            timeout=ACK_TIMEOUT_S,
        )
        r.raise_for_status()
    except httpx.HTTPError as e:
        HANDOFF_ACK_ERRORS.inc()
        log.warning(f"kv handoff ack to {handoff.ack_url} failed ({e}); its lease will end it")


def _pull_handoff(engine: LLMEngine, keys: list[bytes], have: int, missing: list[bytes], h: KVHandoff) -> int:
    """Stage the leading pages of `missing` (keys[have:]) that copy intact from handoff `h`."""
    if h.page_bytes != engine.pages.page_bytes:
        return 0
    got, pages = HANDOFF_READER.fetch(h, missing, have, engine.kv.k.device)
    if got and pages is not None:
        # The reader's device buffer goes back to it once the import has landed.
        engine.pages.stage(
            missing[:got], pages, pin=keys[:have], release=lambda: HANDOFF_READER.release(pages)
        )
    return got


def _pull_tail(
    engine: LLMEngine, h: KVHandoff, request_id: str, prompt: list[int], keys: list[bytes] | None = None
) -> bool:
    """Stage the prompt's partial last page for `request_id` if handoff `h` lists it and it copies
    intact (its stamp's key is the tail_hash this engine computes for the prompt, so a tail of
    other tokens, weights or layout never matches). The scheduler uses it only on top of the
    prompt's full pages (Scheduler._tail)."""
    bs = engine.kv.block_size
    if not h.tail_tokens or h.tail_tokens != len(prompt) % bs or h.page_bytes != engine.pages.page_bytes:
        return False
    key = prompt_tail_key(prompt, engine.version, engine.layout, bs, keys=keys)
    if key is None:
        return False
    got, pages = HANDOFF_READER.fetch(h, [key], len(h.slots) - 1, engine.kv.k.device, tail=True)
    if not got or pages is None:
        return False
    engine.pages.stage_tail(request_id, PromptTail(key, h.tail_tokens, pages[0]))
    return True


def _pull_prefix(
    engine: LLMEngine,
    store: KVStoreClient,
    keys: list[bytes],
    policy: PullPolicy | None,
    handoff: KVHandoff | None = None,
) -> int:
    have = local_prefix_pages(engine, keys)
    missing = keys[have:]
    # Pages the import could take without evicting the cached head it extends (a hint: read off
    # the loop thread); more would be moved over the network only to be dropped. With
    # data-parallel attention the request may go to any group's pool: the roomiest one counts.
    free = max(kv.blocks.num_free for kv in engine.kv_pools)
    missing = missing[: max(0, free - have)]
    if not missing:
        return 0
    handed = _pull_handoff(engine, keys, have, missing, handoff) if handoff is not None else 0
    if handed:
        PULLED_PAGES.inc(handed)
        if handed == len(missing):
            return handed
        # The rest (pages the handoff did not cover, or stale ones) from the store.
        have, missing = have + handed, missing[handed:]
        keys = keys[: have + len(missing)]
    return handed + _pull_store(engine, store, keys, have, missing, policy)


def _pull_store(
    engine: LLMEngine,
    store: KVStoreClient,
    keys: list[bytes],
    have: int,
    missing: list[bytes],
    policy: PullPolicy | None,
) -> int:
    per = engine.pages.page_bytes
    near = store.near.run_length(missing) if store.near is not None and store.near.page_bytes == per else 0
    near_limit = None
    if policy is not None:
        decision = policy.decide(len(missing), per, engine.kv.block_size, near=near)
        missing = missing[: decision.pages]
        near_limit = decision.near
        if not missing:
            return 0
    if store.near is not None:
        return _pull_near_then_remote(engine, store, keys[:have], missing, policy, per, near_limit)
    buffers = engine.pages.buffers
    taken: list[tuple[torch.Tensor, int]] = []

    def alloc(n: int) -> memoryview:
        buf = buffers.take(n)
        taken.append((buf, n))
        return memoryview(buf.numpy())

    try:
        failures = store.failures
        store.take_call_seconds()
        got, data = store.get_prefix(missing, alloc, page_bytes=per)
        round_trip = store.take_call_seconds()  # None: no request reached a gateway
        if policy is not None and round_trip is not None and store.failures == failures:
            policy.observe_pull(len(data), round_trip)
        if not got:
            return 0
        if len(data) != len(got) * per:  # get_prefix keeps only whole pages: a client bug if not
            raise ValueError(f"{len(data)} bytes for {len(got)} pages of {per} bytes")
        if not taken:  # the HTTP fallback path: the bytes are its own
            engine.pages.stage(got, data, pin=keys[:have])
        else:
            buf, n = taken[-1]
            # The pages are a view into the reply body, received into buf[:n]: stage that slice
            # of buf itself (on CUDA it is pinned, so the import is one DMA).
            start = np.frombuffer(data, dtype=np.uint8).ctypes.data - buf.data_ptr()
            if not 0 <= start <= n - len(data):
                raise ValueError("pulled pages are not inside the staging buffer they were received into")
            pages = buf[start : start + len(data)]
            engine.pages.stage(got, pages, pin=keys[:have], release=lambda: buffers.give(buf))
            taken.pop()  # given back by the engine once imported
        PULLED_PAGES.inc(len(got))
        return len(got)
    finally:
        for buf, _n in taken:
            buffers.give(buf)


def _pull_near_then_remote(
    engine: LLMEngine,
    store: KVStoreClient,
    pin: list[bytes],
    missing: list[bytes],
    policy: PullPolicy | None,
    per: int,
    near_limit: int | None,
) -> int:
    """Stage the near tier's leading run of `missing` (at most `near_limit` pages; its pinned
    slots, imported with a direct host -> device copy, held until then) and the gateway's pages
    after it (received into a staging buffer, as `_pull_prefix` does), as two batches in chain
    order."""
    buffers = engine.pages.buffers
    taken: list[torch.Tensor] = []

    def alloc(n: int) -> memoryview:
        buf = buffers.take(n)
        taken.append(buf)
        return memoryview(buf.numpy())

    run = None
    try:
        failures = store.failures
        store.take_call_seconds()
        run, got, data = store.get_prefix_near(missing, alloc, page_bytes=per, near_limit=near_limit)
        round_trip = store.take_call_seconds()  # None: the gateway was not asked (or not reached)
        if policy is not None and round_trip is not None and store.failures == failures:
            policy.observe_pull(len(data), round_trip)
        n_near = len(run) if run is not None else 0
        if n_near:
            engine.pages.stage(run.keys, run, pin=pin, release=run.release)
            run = None  # released by the engine once imported
        if got:
            if len(data) != len(got) * per:
                raise ValueError(f"{len(data)} bytes for {len(got)} pages of {per} bytes")
            head = pin + missing[:n_near]
            if not taken:  # the HTTP fallback path: the bytes are its own
                engine.pages.stage(got, data, pin=head)
            else:
                buf = taken[-1]
                start = np.frombuffer(data, dtype=np.uint8).ctypes.data - buf.data_ptr()
                if not 0 <= start <= buf.numel() - len(data):
                    raise ValueError("pulled pages are not inside the staging buffer they were received into")
                engine.pages.stage(
                    got, buf[start : start + len(data)], pin=head, release=lambda: buffers.give(buf)
                )
                taken.pop()
        PULLED_PAGES.inc(n_near + len(got))
        return n_near + len(got)
    finally:
        if run is not None:
            run.release()
        for buf in taken:
            buffers.give(buf)


async def pull_pages(
    engine: LLMEngine,
    store: KVStoreClient,
    keys: list[bytes],
    policy: PullPolicy | None = None,
    handoff: KVHandoff | None = None,
) -> int:
    """pull_prefix off the event loop."""
    return await asyncio.to_thread(pull_prefix, engine, store, keys, policy, handoff)


class KVRouter:
    def __init__(self, cfg: RunConfig, lookup: Lookup | None):
        self.cfg = cfg
        self.store = store_client(cfg, lookup)
        # A failed prefill is routed around for kvstore.retry_after_s.
        self.prefills = (
            Registry(lookup, DISCOVERY_TTL_S, cfg.kvstore.retry_after_s) if lookup is not None else None
        )
        # Its own view for premap_segments: its reads never make the routing view's cache older.
        self._premap_view = Registry(lookup, DISCOVERY_TTL_S) if lookup is not None else None
        self.http = httpx.AsyncClient(timeout=cfg.prefill.timeout_s, headers=auth_headers())
        self.publisher: PagePublisher | None = None
        self.engine: LLMEngine | None = None
        self.policy: PullPolicy | None = None
        self._rr = itertools.count()
        self._same_host: set[str] = set()  # prefill URLs registered from this host
        self.counts = {"local": 0, "remote": 0, "remote_failed": 0, "pulled_pages": 0}
        self._premapper: asyncio.Task[None] | None = None
        self._premapped: set[tuple[str, tuple[str, ...]]] = set()  # (prefill URL, its segment names)

    def attach(self, engine: LLMEngine) -> None:
        """Publish the pages of every sequence the engine finishes (multi-turn reuse, restarts)."""
        self.engine = engine
        self.policy = engine_policy(engine, self.cfg.kvstore.pull)
        attach_near(engine, self.store, self.cfg)
        reserve_pinned(engine, self.store)
        self.publisher = PagePublisher(self.store, engine.pages.page_bytes)
        engine.pages.sink = self.publisher
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # attached outside a service (a bench, a test): no background mapping
        if loop is not None and self.prefills is not None and self.cfg.kvstore.near.shared_lease_s > 0:
            self._premapper = loop.create_task(self.premap_segments())

    async def premap_segments(self, interval_s: float = PREMAP_INTERVAL_S) -> None:
        """Background task: map (and on CUDA pin) the shared segments of every prefill that
        registers from this host, as soon as it appears, so the first handoff from it does not
        stall the serving path on mapping and cudaHostRegister (~1 s per couple of GB)."""
        while True:
            try:
                await self.premap_once()
            except Exception:  # noqa: BLE001 - an optimisation: the first handoff maps them otherwise
                log.exception("mapping same-host prefill segments failed; the first handoff will")
            await asyncio.sleep(interval_s)

    async def premap_once(self) -> int:
        """One round of premap_segments: returns how many segments were newly mapped. A prefill
        still loading (503), gone, of another page layout, or already mapped is skipped."""
        engine = self.engine
        if self._premap_view is None or engine is None:
            return 0
        here = socket.gethostname()
        per = engine.pages.page_bytes
        pin = engine.kv.k.device.type == "cuda"
        new = 0
        for svc in await self._premap_view.live("prefill"):
            if svc.host != here:
                continue
            try:
                r = await self.http.get(f"{svc.url}/v1/handoff/segments", timeout=SEGMENTS_TIMEOUT_S)
                r.raise_for_status()
                segs = HandoffSegments.model_validate_json(r.content)
            except (httpx.HTTPError, ValueError):
                continue  # loading or gone: the next round asks again
            names = (svc.url, tuple(s.name for s in segs.segments))
            if segs.page_bytes != per or not segs.segments or names in self._premapped:
                continue
            new += await asyncio.to_thread(HANDOFF_READER.map_segments, segs.segments, per, pin)
            self._premapped.add(names)
        return new

    def _prefill_url(self, version: int) -> str | None:
        if self.prefills is None:
            return None
        live = [s for s in self.prefills.get("prefill") if s.version == version]
        if not live:
            return None
        pick = live[next(self._rr) % len(live)]
        if pick.host == socket.gethostname():
            self._same_host.add(pick.url)
        return pick.url

    async def _remote_prefill(self, url: str, req: GenerateRequest, rid: str) -> PrefillResponse | None:
        # A handoff only from a prefill on this host (its registry entry says so): one given to
        # another host would let the prefill answer before the store has the pages.
        body = PrefillRequest(
            input_ids=req.input_ids, sampling=req.sampling, request_id=rid, handoff=url in self._same_host
        )
        try:
            r = await self.http.post(f"{url}/v1/prefill", content=body.model_dump_json(), headers=JSON)
            r.raise_for_status()
            return PrefillResponse.model_validate_json(r.content)
        except (httpx.HTTPError, ValueError) as e:
            log.warning(f"prefill at {url} failed ({type(e).__name__}: {e}); prefilling locally")
            if self.prefills is not None:
                self.prefills.forget(url)
            return None

    async def generate(self, aengine: AsyncEngine, req: GenerateRequest) -> GenerateResponse:
        engine = aengine.engine
        if req.return_routed_experts:
            # Expert ids of prompt tokens are recorded where the prompt is computed: keep it local.
            return await aengine.submit(req)
        engine.validate(req)  # a bad request is a 400 before anything remote is asked
        keys = prompt_keys(engine, req.input_ids)
        new_tokens = len(req.input_ids) - local_prefix_pages(engine, keys) * engine.kv.block_size
        first = None
        resp: PrefillResponse | None = None
        # Top-k log-probs of the first token are not carried back from a prefill service.
        remote = new_tokens >= self.cfg.prefill.min_new_tokens and not req.sampling.logprobs
        url = self._prefill_url(engine.version) if remote else None
        rid = req.request_id or uuid.uuid4().hex
        if url is not None:
            resp = await self._remote_prefill(url, req, rid)
            ok = resp is not None and resp.version == engine.version and resp.layout == engine.layout
            if ok and resp is not None and len(resp.choices) == req.sampling.n:
                first = [(c.token, c.logprob, c.version) for c in resp.choices]
                self.counts["remote"] += 1
                REMOTE_PREFILLS.labels("ok").inc()
            else:
                self.counts["remote_failed"] += 1
                REMOTE_PREFILLS.labels("failed" if resp is None else "mismatch").inc()
        if first is None:
            self.counts["local"] += 1
        # After a remote prefill its pages are pulled whatever the estimate: that is what the
        # prefill service computed them for (and it keeps prefill chunks out of decode's steps).
        policy = self.policy if first is None and engine is self.engine else None
        handoff = resp.handoff if resp is not None else None
        if first is None and handoff is not None:  # a rejected answer: only let its slots go
            await asyncio.to_thread(ack_handoff, handoff)
            handoff = None
        if first is None:
            pulled = await pull_pages(engine, self.store, keys, policy)  # (not `+= await`: lost updates)
            self.counts["pulled_pages"] += pulled
            return await aengine.submit(req)
        # Every full page, the partial last one from a handoff, and the first tokens: the request
        # starts as a pure decode (pull_prefilled).
        pulled = await asyncio.to_thread(
            pull_prefilled, engine, self.store, req.input_ids, rid, first, handoff
        )
        self.counts["pulled_pages"] += pulled
        try:
            return await aengine.submit(req.model_copy(update={"request_id": rid}))
        finally:
            # Consumed by add_request; dropped if the request never got there.
            engine.pages.forget(rid)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        if self.publisher is not None:
            out["published_pages"] = self.publisher.pages_published
            out["publish_dropped_batches"] = self.publisher.batches_dropped
        out["store_failures"] = self.store.failures
        out.update(self.store.near_stats())
        out.update(HANDOFF_READER.stats())
        if self.policy is not None:
            out.update(self.policy.stats())
        if self.engine is not None:
            st = self.engine.stats
            out["computed_tokens"] = st.computed_tokens_total
            out["prefix_hit_tokens"] = st.prefix_cache_hit_tokens
            out["imported_pages"] = self.engine.pages.imported_pages_total
            out["exported_pages"] = self.engine.pages.exported_pages_total
        return out

    async def close(self) -> None:
        if self._premapper is not None:
            self._premapper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._premapper
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)
        log.info("kv routing totals", extra={"fields": self.stats()})
        await self.http.aclose()
        self.store.close()
        HANDOFF_READER.close()  # unmap prefill segments (their memory goes once unlinked too)
