"""The run's time budget and hard limit count running time only: a pause (orchestrator
POST /v1/pause, kept in Redis) holds both, against a real Redis server."""

from __future__ import annotations

import time
import uuid

from sbatch import budget
from sbatch.budget import RunClock
from services.common.bus import Bus


def test_pause_holds_the_budget(redis_server: str, monkeypatch) -> None:
    monkeypatch.setattr(budget, "POLL_S", 0.0)
    bus = Bus(redis_server, f"test-clock-{uuid.uuid4().hex[:8]}")
    clock = RunClock(bus, budget_s=0.6, timeout_s=0.9)
    time.sleep(0.3)
    assert clock.poll() == []
    bus.set_paused(True, "a look at the rollouts")
    events = clock.poll()
    assert len(events) == 1 and "paused (a look at the rollouts)" in events[0] and "on hold" in events[0]
    time.sleep(0.8)  # past the budget and the hard limit in wall time, but paused
    clock.poll()
    assert not clock.budget_spent() and not clock.timed_out()
    assert clock.running_s() < 0.45
    # A second pause request keeps the first one's start: the pause is counted once.
    bus.set_paused(True, "still looking")
    bus.set_paused(False)
    events = clock.poll()
    assert len(events) == 1 and "resumed after" in events[0]
    assert 0.8 <= bus.pause_state().total_s < 1.5
    # Resuming twice does not count the pause twice.
    total = bus.set_paused(False).total_s
    assert bus.pause_state().total_s == total
    time.sleep(0.35)
    clock.poll()
    assert clock.budget_spent()
    assert not clock.budget_spent(), "reported once"
    assert not clock.timed_out()
    time.sleep(0.3)
    assert clock.timed_out()


def test_no_budget(redis_server: str) -> None:
    clock = RunClock(Bus(redis_server, f"test-clock-{uuid.uuid4().hex[:8]}"), budget_s=None, timeout_s=60)
    assert not clock.budget_spent() and not clock.timed_out() and clock.running_s() < 1
