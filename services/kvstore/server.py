"""The KV store gateway service: batched page get/put over HTTP with raw-bytes bodies (wire.py).

    python -m services.kvstore --config RUN_DIR/config.json --redis-url redis://host:port/0

PUT  /v1/pages       pages frame -> {"stored", "bytes"}
POST /v1/pages/get   keys frame  -> pages frame of the pages found (request order)
GET  /v1/stats       per-tier bytes, pages, hits, puts, demotions, promotions, evictions
GET  /v1/dataplane   {"port"} of the bulk data plane (dataplane.py: raw TCP, what clients use for
                     page bytes; the two page routes above stay for tools and as the fallback)
plus /health and /metrics (per-tier gauges and counters) like every relay service. Registered in
Redis as kind "kvstore"; decode and prefill find it there (or through kvstore.url).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.config import KVStoreSection
from services.common.gate import BodyLimit
from services.common.service import Service, create_app, log_event, start_service
from services.kvstore.dataplane import DataPlaneServer
from services.kvstore.tiers import DiskTier, MemoryTier, Tier, TieredStore
from services.kvstore.wire import (
    MEDIA_TYPE,
    DataPlaneInfo,
    FrameError,
    PutReply,
    StoreStats,
    decode_keys,
    decode_pages,
    encode_pages,
)

MOONCAKE_SETUP_TRIES = 20  # the master may still be starting (the launcher starts both at once)


def build_store(sec: KVStoreSection, run_dir: Path, log: Any = None) -> TieredStore:
    tiers: list[Tier] = [MemoryTier(sec.ram_bytes)]
    if sec.disk_bytes:
        tiers.append(DiskTier(sec.disk_dir or run_dir / "kvstore" / "disk", sec.disk_bytes))
    if sec.mooncake.enabled:
        from services.kvstore.mooncake import MooncakeTier, MooncakeUnavailable

        for attempt in range(MOONCAKE_SETUP_TRIES):
            try:
                tiers.append(MooncakeTier(sec.mooncake))
                break
            except MooncakeUnavailable as e:
                if attempt + 1 == MOONCAKE_SETUP_TRIES or "not installed" in str(e):
                    raise
                if log is not None:
                    log.warning(f"mooncake not ready ({e}); retrying")
                time.sleep(1.0)
    return TieredStore(tiers)


class StoreCollector(Collector):
    """Per-tier gauges and counters, read from the store at scrape time."""

    def __init__(self, store: Callable[[], TieredStore | None]):
        self.store = store

    def collect(self) -> Iterator[Any]:
        store = self.store()
        if store is None:
            return
        st = store.stats()
        yield CounterMetricFamily("relay_kvstore_gets", "page lookups", value=st.gets)
        yield CounterMetricFamily("relay_kvstore_misses", "page lookups found in no tier", value=st.misses)
        gauges = {
            "used_bytes": GaugeMetricFamily("relay_kvstore_tier_used_bytes", "bytes held", labels=["tier"]),
            "budget_bytes": GaugeMetricFamily(
                "relay_kvstore_tier_budget_bytes", "byte budget", labels=["tier"]
            ),
            "pages": GaugeMetricFamily("relay_kvstore_tier_pages", "pages held", labels=["tier"]),
        }
        counters = {
            name: CounterMetricFamily(f"relay_kvstore_tier_{name}", f"pages: {name}", labels=["tier"])
            for name in ("hits", "puts", "demotions", "promotions", "evictions", "errors")
        }
        for t in st.tiers:
            for name, g in gauges.items():
                g.add_metric([t.name], getattr(t, name))
            for name, c in counters.items():
                c.add_metric([t.name], getattr(t, name))
        yield from gauges.values()
        yield from counters.values()


_collector: StoreCollector | None = None


def build_app(service: Service, run_dir: Path) -> FastAPI:
    global _collector
    sec = service.cfg.kvstore
    holder: dict[str, TieredStore] = {}
    plane: dict[str, int] = {}
    if _collector is None:
        _collector = StoreCollector(lambda: holder.get("store"))
        REGISTRY.register(_collector)
    else:
        _collector.store = lambda: holder.get("store")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        holder["store"] = await asyncio.to_thread(build_store, sec, run_dir, service.log)
        st = holder["store"].stats()
        # The bulk data plane binds the HTTP socket's address (all interfaces on Slurm), own port.
        dataplane = DataPlaneServer(
            lambda: holder.get("store"), service.sock.getsockname()[0], sec.max_request_bytes, service.token
        ).start()
        plane["port"] = dataplane.port
        log_event(
            service.log,
            "kv store ready",
            tiers=[(t.name, t.budget_bytes, t.pages) for t in st.tiers],
            dataplane_port=dataplane.port,
        )
        service.version = 0
        async with service.registered():
            try:
                yield
            finally:
                await asyncio.to_thread(dataplane.close)
                st = holder["store"].stats()
                await asyncio.to_thread(holder["store"].close)
                log_event(service.log, "kv store closed", **st.model_dump())

    def store() -> TieredStore:
        if "store" not in holder:
            raise HTTPException(503, "starting", headers={"Retry-After": "1"})
        return holder["store"]

    def health() -> dict[str, Any]:
        s = holder.get("store")
        tiers = {t.name: {"pages": t.pages, "used_bytes": t.used_bytes} for t in s.stats().tiers} if s else {}
        return {"tiers": tiers}

    pages = BodyLimit(sec.max_request_bytes, "kvstore.max_request_bytes")
    app = create_app(
        "relay-kvstore",
        health,
        lifespan,
        service=service,
        open_routes={"GET /v1/stats", "GET /v1/dataplane"},
        body_limits={"PUT /v1/pages": pages, "POST /v1/pages/get": pages},
    )

    @app.put("/v1/pages", response_model=PutReply)
    async def put_pages(request: Request) -> PutReply:
        data = await request.body()
        try:
            pages = decode_pages(data)
        except FrameError as e:
            raise HTTPException(400, f"body: {e}") from None
        s = store()

        def put_all() -> PutReply:
            stored = nbytes = 0
            for key, page in pages:
                if s.put(key, bytes(page)):
                    stored += 1
                    nbytes += len(page)
            return PutReply(stored=stored, bytes=nbytes)

        return await asyncio.to_thread(put_all)

    @app.post("/v1/pages/get")
    async def get_pages(request: Request) -> Response:
        data = await request.body()
        try:
            keys = decode_keys(data)
        except FrameError as e:
            raise HTTPException(400, f"body: {e}") from None
        found = await asyncio.to_thread(store().get_many, keys)
        hits = [(k, p) for k, p in zip(keys, found, strict=True) if p is not None]
        frame = encode_pages([k for k, _ in hits], [p for _, p in hits])
        return Response(frame, media_type=MEDIA_TYPE)

    @app.get("/v1/dataplane", response_model=DataPlaneInfo)
    def dataplane_info() -> DataPlaneInfo:
        if "port" not in plane:
            raise HTTPException(503, "starting", headers={"Retry-After": "1"})
        return DataPlaneInfo(port=plane["port"])

    @app.get("/v1/stats", response_model=StoreStats)
    def stats() -> StoreStats:
        return store().stats()

    return app


def main() -> None:
    args, service = start_service("kvstore", "relay KV store gateway: tiered, content-addressed KV pages")
    service.run(build_app(service, Path(args.config).resolve().parent))
