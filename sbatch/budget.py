"""The run's clock: its time budget (`run.time_budget_s`, a graceful stop) and hard limit
(`run.timeout_s`), both counted in running time. Time the orchestrator spent paused
(`POST /v1/pause`, kept in Redis by services/common/bus.py) does not count: a paused run
generates nothing, so spending its budget would stop it having learnt nothing more."""

from __future__ import annotations

import time

import redis

from services.common.bus import Bus
from services.common.schemas import PauseState

# Redis is read at most this often (the launcher's monitor loop ticks every 0.2 s).
POLL_S = 1.0


class RunClock:
    def __init__(self, bus: Bus, budget_s: float | None, timeout_s: float):
        self.bus, self.budget_s, self.timeout_s = bus, budget_s, timeout_s
        self.t0 = time.time()
        self._state = self._read()
        self._read_at = 0.0
        self._budget_done = budget_s is None

    def _read(self) -> PauseState:
        try:
            return self.bus.pause_state()
        except redis.RedisError:
            return getattr(self, "_state", PauseState())  # Redis briefly away: keep the last view

    def poll(self) -> list[str]:
        """Refresh the pause state; lines to print when the run was paused or resumed."""
        now = time.monotonic()
        if now - self._read_at < POLL_S:
            return []
        self._read_at = now
        prev, self._state = self._state, self._read()
        if self._state.paused and not prev.paused:
            why = f" ({self._state.reason})" if self._state.reason else ""
            return [f"[yellow]paused{why}: the time budget is on hold (POST /v1/resume to go on)[/]"]
        if prev.paused and not self._state.paused:
            held = self._state.paused_s() - prev.total_s
            return [f"[yellow]resumed after {held:.0f}s paused[/]"]
        return []

    def running_s(self) -> float:
        """Seconds since the clock started, less those paused (the run's Redis prefix is its own,
        so every pause it records is this run's)."""
        return time.time() - self.t0 - self._state.paused_s()

    def budget_spent(self) -> bool:
        """True once, when the time budget runs out."""
        if self._budget_done or self.budget_s is None or self.running_s() < self.budget_s:
            return False
        self._budget_done = True
        return True

    def timed_out(self) -> bool:
        return self.running_s() > self.timeout_s
