"""A weight version names one set of weights for the whole run: the orchestrator rolls out only a
higher version than it serves. A republished version (a trainer resumed from its checkpoint) is not
rolled out again, and a lower one (the key rewritten from outside the run) is ignored. A decode
that cannot load a version while Redis is away is asked again until it has. The trainer
side (a resumed trainer numbers on after every version it reached) is in test_trainer_run.py."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
import uvicorn
from helpers.debug_weights import spread_debug_versions

from services.common import bus as bus_module
from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import EngineConfig, RedisSection, RunConfig
from services.common.redis_server import RedisServer
from services.common.schemas import WeightsInfo
from services.common.service import Service
from services.common.weights_dir import weights_root
from services.decode.server import build_app
from services.orchestrator.clients import DecodeClient, Router
from services.orchestrator.loop import Orchestrator


def test_watcher_rolls_out_only_higher_versions(redis_server: str, tmp_path: Path) -> None:
    prefix = f"t-ver-{uuid.uuid4().hex[:8]}"
    cfg = RunConfig(redis=RedisSection(url=redis_server, prefix=prefix))
    bus = Bus(redis_server, prefix)
    orch = Orchestrator(cfg, bus, tmp_path)
    rolled: list[int] = []
    orch.on_version = rolled.append

    def publish(v: int) -> None:
        bus.publish_weights(WeightsInfo(version=v, path=str(tmp_path / "weights" / f"step_{v}")))

    async def settle() -> None:
        await asyncio.sleep(0.6)  # the watcher polls every 0.1 s

    async def scenario() -> None:
        async with aiohttp.ClientSession(headers=auth_headers()) as http:
            orch.decode = DecodeClient(http, Router(orch.registry, "decode"))
            publish(3)
            watcher = asyncio.create_task(orch.weights_watcher())
            try:
                await settle()
                assert rolled == [3] and orch.version == 3
                publish(3)  # republished (new timestamp): the same weights
                await settle()
                assert rolled == [3]
                publish(2)  # lower: never rolled back to
                await settle()
                assert rolled == [3] and orch.version == 3
                publish(4)
                await settle()
                assert rolled == [3, 4] and orch.version == 4
            finally:
                orch.stopping = True
                await watcher

    asyncio.run(scenario())


def test_roll_out_waits_out_redis_behind_a_decodes_announced_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis stops as a version is rolled out, for longer than the clients' own reconnect
    window: the real decode answers /update_weights 503 (it cannot check the version was
    announced), and the orchestrator asks again with back-off until Redis is back and the decode
    has loaded it, before moving on (nothing rolled out past a decode that stayed behind)."""
    monkeypatch.setattr(bus_module, "connect", functools.partial(bus_module.connect, reconnect_s=0.3))
    server = RedisServer(tmp_path / "redis").start()
    revived: list[RedisServer] = []
    timers: list[threading.Timer] = []
    run_dir = tmp_path / "run"
    v0, v1 = spread_debug_versions(weights_root(run_dir))
    cfg = RunConfig(redis=RedisSection(url=server.url, prefix=f"t-ver-{uuid.uuid4().hex[:8]}"))
    cfg.redis.heartbeat_s = 0.2
    cfg.decode.engine = EngineConfig(device="cpu", max_batch_size=4, max_seq_len=128)
    bus = Bus(server.url, cfg.redis.prefix)
    bus.publish_weights(WeightsInfo(version=0, path=str(v0)))
    service = Service("decode", cfg, server.url, "127.0.0.1", 0, run_dir)
    http_server = uvicorn.Server(uvicorn.Config(build_app(service), log_config=None, access_log=False))
    serving = threading.Thread(target=http_server.run, kwargs={"sockets": [service.sock]}, daemon=True)
    serving.start()
    try:
        deadline = time.monotonic() + 60
        while service.version != 0 or not bus.services("decode"):  # version 0 loaded, registered
            assert time.monotonic() < deadline, "decode never loaded version 0"
            time.sleep(0.05)
        info = WeightsInfo(version=1, path=str(v1))
        bus.publish_weights(info)
        orch = Orchestrator(cfg, Bus(server.url, cfg.redis.prefix), run_dir)

        def restart() -> None:
            revived.append(RedisServer(server.workdir, server.port).start())

        async def scenario() -> float:
            async with aiohttp.ClientSession(headers=auth_headers()) as http:
                orch.decode = DecodeClient(http, Router(orch.registry, "decode"))
                live = await orch.registry.live("decode", force=True)
                assert [d.url for d in live] == [service.url]
                server.stop()
                timers.append(threading.Timer(1.5, restart))
                timers[0].start()
                t0 = time.monotonic()
                await orch._roll_out(info)
                return time.monotonic() - t0

        took = asyncio.run(scenario())
        assert revived, "Redis did not come back"
        assert took >= 1.5, f"rolled out in {took:.2f} s, before Redis was back"
        assert orch.loaded == {service.id: 1} and orch.version == 1, (orch.loaded, orch.version)
        assert service.version == 1  # the decode serves it
    finally:
        http_server.should_exit = True
        serving.join(30)
        for t in timers:
            t.join()  # a restart still pending is waited for, then stopped with the rest
        for s in (server, *revived):
            s.stop()
