"""Decode affinity (orchestrator.decode_affinity_slack): a sample's later turns go back to the decode
replica that served its previous turn, whose prefix cache holds its context, unless that replica is
more than `slack` requests busier than the least-loaded one or no longer live.

Router level against the real Redis registry; rollout level over real HTTP with two scripted decode
servers and the real sandbox process (test_agent_budgets' stack)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import REGISTRY
from test_agent_budgets import ENV, EOS, TOK, Policy, budget_cfg, budget_sandbox, scripted_decode_app

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.registry import Registry
from services.common.schemas import GenerateRequest, ServiceInfo, WeightsInfo
from services.orchestrator.clients import DecodeClient, Router, SandboxClient
from services.orchestrator.loop import Orchestrator
from services.orchestrator.rollout import GroupSpec, RolloutRunner

__all__ = ["budget_sandbox"]  # the real sandbox process, a module fixture used below


@pytest.fixture()
def bus(redis_url: str) -> Iterator[Bus]:
    b = Bus(redis_url, f"test-affinity-{uuid.uuid4().hex[:6]}")
    yield b


def two_replicas(bus: Bus) -> tuple[str, str]:
    a, b = "http://127.0.0.1:1", "http://127.0.0.1:2"
    bus.register(ServiceInfo(kind="decode", id="a", url=a), ttl_s=60)
    bus.register(ServiceInfo(kind="decode", id="b", url=b), ttl_s=60)
    return a, b


def kept_count(outcome: str) -> float:
    return (
        REGISTRY.get_sample_value("relay_orchestrator_affinity_total", {"kind": "decode", "outcome": outcome})
        or 0.0
    )


def test_router_keeps_the_preferred_replica_within_the_slack(bus: Bus) -> None:
    a, b = two_replicas(bus)
    router = Router(Registry(bus.services), "decode", affinity_slack=2)
    kept0, moved0 = kept_count("kept"), kept_count("moved")

    async def run() -> None:
        router.outstanding[a] = 2  # b is idle: a is 2 busier, within the slack
        assert await router.pick(prefer=a) == a
        router.outstanding[a] = 3  # past the slack: the least-loaded replica takes the turn
        assert await router.pick(prefer=a) == b
        router.outstanding[a] = 0
        router.registry.forget(a)  # a failed request quarantines a: the turn moves
        assert await router.pick(prefer=a) == b
        assert await router.pick(prefer="http://127.0.0.1:9") == b  # never registered

    asyncio.run(run())
    assert kept_count("kept") - kept0 == 1 and kept_count("moved") - moved0 == 3


def test_router_without_affinity_is_least_outstanding(bus: Bus) -> None:
    a, b = two_replicas(bus)
    router = Router(Registry(bus.services), "decode", affinity_slack=None)

    async def run() -> None:
        router.outstanding[a] = 1
        assert await router.pick(prefer=a) == b

    asyncio.run(run())


def letter_policy(letter: str, delay_s: float = 0.0) -> Policy:
    """This replica's answer to everything: its letter (the env asks for more, up to max_turns),
    after `delay_s` (a slower replica carries more outstanding requests)."""

    async def policy(req: GenerateRequest) -> list[list[int]]:
        await asyncio.sleep(delay_s)
        return [[*TOK.encode(letter).ids, EOS] for _ in range(req.sampling.n)]

    return policy


def run_two_replicas(
    redis_url: str,
    prefix: str,
    tmp_path: Path,
    slack: int | None,
    max_turns: int = 3,
    x_delay_s: float = 0.0,
) -> dict[str, list[GenerateRequest]]:
    """4 groups of 2 samples, `max_turns` model turns each, against replicas answering "x" and "y"
    (the char tokenizer has no capitals)."""
    cfg = budget_cfg(redis_url, prefix, max_turns=max_turns, decode_affinity_slack=slack)
    bus = Bus(redis_url, prefix)

    async def run() -> dict[str, list[GenerateRequest]]:
        seen: dict[str, list[GenerateRequest]] = {}
        runners, ids = [], []
        for letter in ("x", "y"):
            seen[letter] = []
            runner = web.AppRunner(
                scripted_decode_app(seen[letter], letter_policy(letter, x_delay_s if letter == "x" else 0.0))
            )
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            sid = f"scripted-{letter}-{uuid.uuid4().hex[:6]}"
            bus.register(ServiceInfo(kind="decode", id=sid, url=f"http://127.0.0.1:{port}"), ttl_s=600)
            runners.append(runner)
            ids.append(sid)
        bus.publish_weights(WeightsInfo(version=0, path=str(tmp_path / "weights" / "step_0")))
        orch = Orchestrator(cfg, bus, tmp_path)
        http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=60, connect=5), headers=auth_headers()
        )
        registry = Registry(bus.services)
        decode = DecodeClient(http, Router(registry, "decode", affinity_slack=slack))
        orch.runner = RolloutRunner(cfg, decode, SandboxClient(http, Router(registry, "sandbox")), TOK, EOS)
        try:
            specs = [GroupSpec(group_id=uuid.uuid4().hex[:12], env=ENV, seed=0) for _ in range(4)]
            for spec in specs:
                orch._record_start(spec, 0)
            await asyncio.gather(*(orch._run_group(spec) for spec in specs))
        finally:
            await http.close()
            for r in runners:
                await r.cleanup()
            for sid in ids:
                bus.deregister("decode", sid)
        return seen

    return asyncio.run(run())


def answers_in_context(req: GenerateRequest) -> set[str]:
    """The model answers already in a later turn's context: each model turn is one letter + EOS."""
    ids = req.input_ids
    return {TOK.decode([ids[i - 1]]) for i in range(1, len(ids)) if ids[i] == EOS}


def test_rollout_turns_stick_to_the_replica_of_their_first_turn(
    budget_sandbox: object, redis_server: str, tmp_path: Path
) -> None:
    """Every later turn lands on the replica that served the sample's earlier turns: a context
    holds only that replica's letter. Without affinity the same run mixes them (the control)."""
    prefix = budget_sandbox.prefix  # type: ignore[attr-defined]
    seen = run_two_replicas(redis_server, prefix, tmp_path, slack=8)
    for letter, reqs in seen.items():
        later = [r for r in reqs if r.sampling.n == 1]
        assert all(answers_in_context(r) == {letter} for r in later), letter
    assert sum(len(r) for r in seen.values()) == 4 * (1 + 2 * 2)  # a group: 1 shared turn + 2 x 2 later
    assert all(seen.values())  # both replicas served groups: affinity is per sample, not global

    # The control must move turns whatever the scheduling: with both replicas equally fast, CI once
    # placed every sample's second turn back on its first turn's replica by tie-break alone. A
    # slow "x" keeps requests outstanding there, so least-outstanding routing sends turns of x's
    # samples to the idle "y", and five turns give each sample four chances to show the move.
    control = run_two_replicas(
        redis_server, prefix, tmp_path / "control", slack=None, max_turns=5, x_delay_s=0.1
    )
    mixed = [
        r for reqs in control.values() for r in reqs if r.sampling.n == 1 and len(answers_in_context(r)) > 1
    ]
    assert mixed, "least-outstanding routing alone should have moved some turns between replicas"
