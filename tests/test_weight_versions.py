"""A weight version names one set of weights for the whole run: the orchestrator rolls out only a
higher version than it serves. A republished version (a trainer resumed from its checkpoint) is not
rolled out again, and a lower one (the key rewritten from outside the run) is ignored. The trainer
side (a resumed trainer numbers on after every version it reached) is in test_trainer_run.py."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiohttp

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import RedisSection, RunConfig
from services.common.schemas import WeightsInfo
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
