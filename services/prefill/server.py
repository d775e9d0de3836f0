"""The prefill service: computes a prompt's KV pages, publishes them to the KV store, returns the
first sampled token of each sample and the page keys; a decode replica continues from there.

    python -m services.prefill --config RUN_DIR/config.json --redis-url redis://host:port/0

It runs its own engine (prefill.engine, default decode's: the page layout must match decode's),
pulls pages the store already has before computing (a growing multi-turn context is computed once),
and follows the trainer's published weights by polling Redis (decode only routes to a prefill
service registered with its own weight version). POST /update_weights works as on decode.

With prefill.parallel over several ranks this process is rank 0 (the HTTP front and the
scheduler) and starts the other ranks; its pages are whole single-rank pages (the ranks' KV heads
gathered on export and scattered on a pull: services/engine/parallel/pages.py).

Same host (kvstore.near.shared_lease_s > 0): the near tier lives in /dev/shm segments and the
answer carries a handoff of the prompt's pages there (services/kvstore/handoff.py); it is sent as
soon as the pages are in that tier, the gateway publish going on in the background. The decode
POSTs /v1/handoff/ack once it has copied them (else the lease ends the hold). GET
/v1/handoff/segments lists the tier's segments, which a same-host decode maps ahead of traffic.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import FastAPI, HTTPException

from services.common.config import EngineConfig, RunConfig
from services.common.gate import BodyLimit
from services.common.prefill_schemas import (
    FirstToken,
    HandoffAck,
    HandoffSegments,
    KVHandoff,
    PrefillRequest,
    PrefillResponse,
)
from services.common.schemas import GenerateRequest
from services.common.service import (
    Service,
    add_update_weights_route,
    create_app,
    loaded,
    log_event,
    start_service,
    token_body_limit,
)
from services.engine import AsyncEngine, InvalidRequest, LLMEngine, WeightsError
from services.engine.host_tuning import tune_after_startup
from services.engine.kv_transfer import chain_hashes, prompt_tail_key
from services.engine.parallel.ranks import EngineRanks, end_replica
from services.engine.parallel.runner import check_engine
from services.kvstore.client import PagePublisher
from services.kvstore.handoff import HandoffLeases, segment_list
from services.kvstore.pull_policy import PullPolicy
from services.kvstore.router import (
    attach_near,
    engine_policy,
    keep_tails,
    local_prefix_pages,
    prompt_keys,
    pull_pages,
    store_client,
)

WEIGHTS_POLL_S = 0.5
LEASE_SWEEP_S = 1.0


def start_checks(cfg: RunConfig) -> None:
    """What the prefill service refuses to start with (SystemExit naming the key), on the config
    alone: the test of the shipped configs runs it without building an engine. RunConfig refuses
    a multi-rank prefill.parallel with dp_attention > 1 at load; this holds for one built otherwise."""
    par = cfg.prefill_parallel
    if par.ranks > 1 and par.dp_attention > 1:
        raise SystemExit(
            "prefill.parallel.dp_attention: a multi-rank prefill runs one attention group "
            "(tp and ep); set prefill.parallel = { tp = ..., ep = ... }"
        )
    if par.ranks > 1:
        try:
            check_engine(cfg.prefill.engine or cfg.decode.engine, cfg.model, par)
        except ValueError as e:
            raise SystemExit(f"prefill.parallel: {e}") from None


class Prefill:
    def __init__(self, service: Service):
        self.service = service
        self.cfg = service.cfg
        self.engine_cfg: EngineConfig = self.cfg.prefill.engine or self.cfg.decode.engine
        self.engine: AsyncEngine | None = None
        self.store = store_client(self.cfg, service.bus.services)
        self.publisher: PagePublisher | None = None
        self.policy: PullPolicy | None = None
        lease_s = self.cfg.kvstore.near.shared_lease_s
        self.leases = HandoffLeases(lease_s, f"{service.url}/v1/handoff/ack") if lease_s > 0 else None
        self._lock = asyncio.Lock()
        self.served = 0
        # prefill.parallel over several ranks: this process is rank 0 (the HTTP front and the
        # scheduler) and starts the others with the engine (services/engine/parallel/ranks.py).
        # Its pages in and out are whole single-rank pages (services/engine/parallel/pages.py).
        self.par = self.cfg.prefill_parallel
        self.ranks: EngineRanks | None = None
        start_checks(self.cfg)

    async def load(self, path: str, version: int) -> int:
        async with self._lock:
            if self.engine is None:
                if self.par.ranks > 1:
                    eng = await asyncio.to_thread(self._start_ranks, path, version)
                else:
                    eng = await asyncio.to_thread(LLMEngine, path, self.engine_cfg, version)
                attach_near(eng, self.store, self.cfg, shared=self.leases is not None)
                self.publisher = PagePublisher(self.store, eng.pages.page_bytes, **self._publish_bound())
                eng.pages.sink = self.publisher
                if self.leases is not None and self.store.near is not None:
                    keep_tails(eng, self.store.near)  # handed off with the full pages
                self.policy = engine_policy(eng, self.cfg.kvstore.pull)
                # Start-up's objects out of the GC's way, the GIL back to the step loop sooner (host_tuning.py).
                log_event(self.service.log, "host tuned", **tune_after_startup())
                self.engine = AsyncEngine(eng).start()
                log_event(self.service.log, "engine ready", path=path, version=version, layout=eng.layout)
            elif version > self.engine.version:
                await self.engine.load_weights(path, version)
                log_event(self.service.log, "weights updated", path=path, version=version)
            self.service.version = self.engine.version
            return self.engine.version

    def _start_ranks(self, path: str, version: int) -> LLMEngine:
        name = f"prefill.{self.service.index}"
        self.ranks = EngineRanks(self.cfg, "prefill", self._ranks_failed, bus=self.service.bus, name=name)
        self.ranks.start()
        log_event(
            self.service.log, "engine ranks joined", ranks=self.par.ranks, tp=self.par.tp, ep=self.par.ep
        )
        return self.ranks.engine(path, version)

    def _ranks_failed(self, why: str) -> None:
        end_replica(self.service, self.engine, self.ranks, why)

    def _publish_bound(self) -> dict[str, int]:
        """With a shared near tier, the publisher may hold at most half of it: it sends from the
        tier's slots at the gateway's pace (~0.6 GB/s on the H200 host), and a tier full of its
        holds would leave no room for new prompts' pages, hence no handoff. Past that the gateway
        misses batches (recomputed by whoever needs them elsewhere); same-host decodes still get
        every page through the handoff."""
        near = self.store.near
        if near is None or not near.shared:
            return {}
        return {"max_queue_bytes": max(near.page_bytes, near.budget_bytes // 2)}

    async def follow_weights(self) -> None:
        """Load the latest published weights, now and whenever a newer version appears."""
        while True:
            try:
                info = await asyncio.to_thread(self.service.bus.latest_weights)
            except redis.RedisError as e:
                self.service.log.warning(f"redis unavailable while polling weights: {e}")
                info = None
            if info is not None and (self.engine is None or info.version > self.engine.version):
                try:
                    await self.load(info.path, info.version)
                except WeightsError as e:
                    self.service.log.error(f"cannot load published weights: {e}")
            await asyncio.sleep(WEIGHTS_POLL_S)

    def ready(self) -> AsyncEngine:
        return loaded(self.engine)

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        if self.service.failed:  # a broken rank group: it exits in a moment, retry elsewhere
            raise HTTPException(503, self.service.failed)
        aengine = self.ready()
        eng = aengine.engine
        rid = req.request_id or uuid.uuid4().hex
        greq = GenerateRequest(
            input_ids=req.input_ids,
            sampling=req.sampling.model_copy(update={"max_tokens": 1}),
            request_id=rid,
        )
        try:
            eng.validate(greq)
        except InvalidRequest as e:
            raise HTTPException(400, str(e)) from None
        version = eng.version
        keys = prompt_keys(eng, req.input_ids)
        local = local_prefix_pages(eng, keys)
        pulled = await pull_pages(eng, self.store, keys, self.policy) if eng.pages.imports else 0
        assert self.publisher is not None  # set with the engine
        published = self.publisher.expect(rid)
        try:
            resp = await aengine.submit(greq)
        except InvalidRequest as e:
            self.publisher.forget(rid)
            raise HTTPException(400, str(e)) from None
        except RuntimeError as e:
            self.publisher.forget(rid)
            raise HTTPException(503, str(e)) from None
        if any(not c.output_ids for c in resp.choices):
            self.publisher.forget(rid)
            raise HTTPException(503, "prefill aborted (engine stopping or request timed out)")
        choices = [
            FirstToken(token=c.output_ids[0], logprob=c.logprobs[0], version=c.versions[0])
            for c in resp.choices
        ]
        bs = eng.kv.block_size
        all_keys = chain_hashes(req.input_ids, choices[0].version, eng.layout, bs, breathe=True)
        # The pages are in the near tier already (exported before the request finished), the
        # partial last one too (tail_sink).
        handoff = None
        if req.handoff:
            tail = prompt_tail_key(req.input_ids, choices[0].version, eng.layout, bs, keys=all_keys)
            handoff = self._handoff(all_keys, tail, len(req.input_ids) % bs)
        if handoff is not None and handoff.full_pages >= len(all_keys):
            # The decode has the first token, so it takes every full page (kv_transfer.
            # reusable_pages, seeded) and they are all in shared memory: no need to wait for the
            # gateway (the publish goes on in the background, for other consumers and restarts).
            self.publisher.forget(rid)
            stored = 0
        else:
            # Answer once the pages are in the store: decode pulls them right after.
            try:
                stored = await asyncio.wait_for(
                    asyncio.wrap_future(published), self.cfg.kvstore.timeout_s * 4
                )
            except TimeoutError:
                self.publisher.forget(rid)
                stored = 0  # decode finds fewer pages in the store and computes the rest itself
        self.served += 1
        return PrefillResponse(
            request_id=rid,
            version=choices[0].version if choices else version,
            layout=eng.layout,
            prompt_tokens=len(req.input_ids),
            page_keys=[k.hex() for k in all_keys],
            pages_stored=stored,
            local_tokens=local * bs,
            pulled_tokens=pulled * bs,
            computed_tokens=len(req.input_ids) - (local + pulled) * bs,
            choices=choices,
            handoff=handoff,
        )

    def _handoff(self, keys: list[bytes], tail: bytes | None, tail_tokens: int) -> KVHandoff | None:
        """A lease on the prompt's pages in the shared near tier (None: off or empty)."""
        near = self.store.near
        if self.leases is None or near is None:
            return None
        return self.leases.grant_prompt(near, keys, tail, tail_tokens)

    def segments(self) -> HandoffSegments:
        """The shared tier's segments (a read: no grant, no hold, no counter)."""
        self.ready()  # the tier exists once the engine is loaded: 503 until then
        near = self.store.near
        if self.leases is None or near is None or not near.shared:
            return HandoffSegments(page_bytes=0, segments=[])
        return HandoffSegments(page_bytes=near.page_bytes, segments=segment_list(near.shared_segments))

    async def expire_leases(self) -> None:
        while self.leases is not None:
            self.leases.expire()
            await asyncio.sleep(LEASE_SWEEP_S)

    def close_near(self) -> None:
        """Let every lease go and unlink the shared segments (no /dev/shm left behind)."""
        if self.leases is not None:
            self.leases.close()
        if self.store.near is not None:
            self.store.near.close()

    def health(self) -> dict[str, Any]:
        eng = self.engine
        return {
            "status": "ok" if eng is not None else "loading",
            "served": self.served,
            "queue": eng.num_waiting if eng else 0,
            "running": eng.num_running if eng else 0,
            "published_pages": self.publisher.pages_published if self.publisher else 0,
            **(self.leases.stats() if self.leases is not None else {}),
            **(self.policy.stats() if self.policy is not None else {}),
            **self.store.near_stats(),
        }


def build_app(service: Service) -> FastAPI:
    state = Prefill(service)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with service.registered():
            follower = service.watch(asyncio.create_task(state.follow_weights()), "weights follower")
            sweeper = service.watch(asyncio.create_task(state.expire_leases()), "lease sweeper")
            try:
                yield
            finally:
                follower.cancel()
                sweeper.cancel()
                if state.engine is not None:
                    await asyncio.to_thread(state.engine.stop)
                if state.ranks is not None:
                    engine = state.engine.engine if state.engine is not None else None
                    await asyncio.to_thread(state.ranks.stop, engine)  # type: ignore[arg-type]
                if state.publisher is not None:
                    await asyncio.to_thread(state.publisher.close)
                state.close_near()
                log_event(service.log, "engine stopped")

    app = create_app(
        "relay-prefill",
        state.health,
        lifespan,
        service=service,
        body_limits={
            "POST /v1/prefill": token_body_limit(
                state.engine_cfg,
                BodyLimit(service.cfg.prefill.max_request_bytes, "prefill.max_request_bytes"),
            )
        },
    )
    app.state.prefill = state

    @app.post("/v1/prefill", response_model=PrefillResponse)
    async def prefill(req: PrefillRequest) -> PrefillResponse:
        return await state.prefill(req)

    @app.post("/v1/handoff/ack")
    async def handoff_ack(req: HandoffAck) -> dict[str, bool]:
        """The decode has copied a handoff's pages: its slots may be reused."""
        return {"released": state.leases is not None and state.leases.ack(req.id)}

    @app.get("/v1/handoff/segments", response_model=HandoffSegments)
    async def handoff_segments() -> HandoffSegments:
        """Every segment of the shared near tier: a same-host decode maps them before its first
        handoff (services/kvstore/router.py, KVRouter.premap_segments)."""
        return state.segments()

    add_update_weights_route(app, service, state.load, WeightsError)

    return app


def main() -> None:
    _args, service = start_service("prefill", "relay prefill service: prompt KV pages into the KV store")
    service.run(build_app(service))
