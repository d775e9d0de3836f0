"""Weights only from the run (services/common/weights_gate.py): what POST /update_weights may load
(an announced version's own directory under the run's weights root), and samples carrying a
version the trainer never announced are dropped by the orchestrator and by the trainer, whose
check waits out a Redis outage. Real Redis; the orchestrator's own group runner against a
scripted decode and the real sandbox."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_agent_budgets import budget_cfg, budget_sandbox, committed, run_groups
from test_trainer_run import make_cfg, sample_group

from services.common import bus as bus_module
from services.common.bus import Bus
from services.common.config import RunConfig
from services.common.redis_server import RedisServer
from services.common.schemas import RolloutGroup, WeightsInfo
from services.common.weights_dir import step_dir
from services.common.weights_gate import AnnouncedVersions, UpdateRefused, check_update
from trainer.model import build_model
from trainer.train import CONSUMER, Trainer

__all__ = ["budget_sandbox"]  # the real sandbox process, a module fixture used below


def test_check_update(redis_url: str, tmp_path: Path) -> None:
    bus = Bus(redis_url, f"gate-{uuid.uuid4().hex[:8]}")
    run = tmp_path / "run"
    for v in (0, 1):
        step_dir(run, v).mkdir(parents=True)

    def refused(path: Path | str, version: int) -> str:
        with pytest.raises(UpdateRefused) as e:
            check_update(bus, run, str(path), version)
        return str(e.value)

    assert refused(step_dir(run, 0), 0) == "version: 0 has not been announced by the trainer (none yet)"
    bus.publish_weights(WeightsInfo(version=0, path=str(step_dir(run, 0))))
    check_update(bus, run, str(step_dir(run, 0)), 0)
    check_update(bus, run, f"{run}/weights/../weights/step_0", 0)  # the same directory
    assert (
        refused(step_dir(run, 1), 1) == "version: 1 has not been announced by the trainer (the newest is 0)"
    )
    assert refused(step_dir(run, 1), 0) == f"path: version 0 is {step_dir(run, 0)}, not {step_dir(run, 1)}"
    outside = tmp_path / "elsewhere" / "step_0"
    assert refused(outside, 0).startswith(f"path: {outside} is not under the run's weights directory")
    link = run / "weights" / "link"
    link.symlink_to(tmp_path / "elsewhere")  # a link out of the root resolves outside it
    assert "is not under the run's weights directory" in refused(link / "step_0", 0)
    bus.publish_weights(WeightsInfo(version=1, path=str(step_dir(run, 1))))
    check_update(bus, run, str(step_dir(run, 1)), 1)
    check_update(bus, run, str(step_dir(run, 0)), 0)  # an older announced version stays valid

    seen = AnnouncedVersions(bus)
    assert seen.unannounced([-1, 0, 1, 1]) == [] and seen.known == {0, 1}
    assert seen.unannounced([0, 2, 999]) == [2, 999]
    bus.publish_weights(WeightsInfo(version=2, path=str(step_dir(run, 2))))
    assert seen.unannounced([2]) == []  # asked again for what it did not know


def test_orchestrator_drops_samples_of_unannounced_weights(
    budget_sandbox: object, redis_server: str, tmp_path: Path
) -> None:
    """A decode serving weights the trainer never announced (version 7: loaded behind the trainer's
    back): its groups are dropped with the reason, never put on the stream for training."""
    prefix = budget_sandbox.prefix  # type: ignore[attr-defined]
    cfg = budget_cfg(redis_server, prefix, max_turns=2)
    bus = Bus(redis_server, prefix)
    specs, _, _ = asyncio.run(run_groups(cfg, bus, tmp_path, [0], version=7))
    (spec,) = specs
    assert bus.ledger()["dropped"][spec.group_id] == "unannounced: weight versions [7]"  # type: ignore[index]
    assert spec.group_id not in committed(bus)
    specs, _, _ = asyncio.run(run_groups(cfg, bus, tmp_path, [0], version=0))  # announced: kept
    assert specs[0].group_id in committed(bus)


def push_forged_and_good(bus: Bus, cfg: RunConfig) -> list[RolloutGroup]:
    """On the stream: a group of a version never announced ("forged"), then a batch of version 0's
    (returned)."""
    model = build_model(cfg.model, seed=cfg.run.seed, init_std=cfg.trainer.init_std)
    forged = sample_group(model, 999999, 4, 3, seed=1).model_copy(update={"group_id": "forged"})
    bus.push_group(forged)
    good = [sample_group(model, 0, 4, 3, seed=10 + i) for i in range(cfg.orchestrator.batch_size)]
    for g in good:
        bus.push_group(g)
    return good


def test_trainer_drops_samples_of_unannounced_weights(redis_server: str, tmp_path: Path) -> None:
    """A group carrying a version the trainer never announced is dropped with the reason, the rest
    trained; a temporary weights directory a dead trainer left is removed at start."""
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir)
    cfg.run.max_steps = 1
    bus = Bus(redis_server, cfg.redis.prefix)
    good = push_forged_and_good(bus, cfg)
    left = run_dir / "weights" / ".step_5.tmp-999"  # a dead trainer's unfinished write
    left.mkdir(parents=True)
    t = Trainer(cfg, run_dir, redis_server)
    try:
        assert t.run() == 0
    finally:
        t.d.close()
    assert not left.exists()  # removed at start
    ledger = bus.ledger()
    assert ledger["dropped"] == {"forged": "unannounced: weight versions [999999]"}
    assert set(ledger["trained"]) == {g.group_id for g in good}  # type: ignore[arg-type]


def test_trainer_waits_out_redis_during_the_announced_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis stops exactly when the trainer asks which versions were announced, for longer than
    its client's own reconnect window, and comes back with its data: the trainer waits (no
    crash), then drops the forged group with its reason (recorded and acked together) and trains
    the rest; nothing is left pending or lost."""
    monkeypatch.setattr(bus_module, "connect", functools.partial(bus_module.connect, reconnect_s=0.3))
    server = RedisServer(tmp_path / "redis").start()
    revived: list[RedisServer] = []
    timers: list[threading.Timer] = []
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir)
    cfg.run.max_steps = 1
    try:
        bus = Bus(server.url, cfg.redis.prefix)
        good = push_forged_and_good(bus, cfg)
        t = Trainer(cfg, run_dir, server.url)
        assert t.bus is not None
        real = t.bus.announced_versions

        def restart() -> None:
            revived.append(RedisServer(server.workdir, server.port).start())

        def outage_then_ask() -> set[int]:
            if not timers:  # the first time only
                server.stop()
                timers.append(threading.Timer(1.5, restart))
                timers[0].start()
            return real()

        monkeypatch.setattr(t.bus, "announced_versions", outage_then_ask)
        t0 = time.monotonic()
        try:
            assert t.run() == 0
        finally:
            t.d.close()
        assert revived and time.monotonic() - t0 >= 1.5  # it waited for the restart
        ledger = bus.ledger()
        assert ledger["dropped"] == {"forged": "unannounced: weight versions [999999]"}
        assert set(ledger["trained"]) == {g.group_id for g in good}  # type: ignore[arg-type]
        assert bus.pending_count(CONSUMER) == 0  # every entry acked: the forged one with its drop
    finally:
        for timer in timers:
            timer.join()  # a restart still pending is waited for, then stopped with the rest
        for s in (server, *revived):
            s.stop()
