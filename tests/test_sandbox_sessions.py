"""SessionStore in-process, with a fake clock: limits, expiry, the turn cap, and broken envs."""

from __future__ import annotations

import pytest

from services.sandbox.envs import Environment, register_env
from services.sandbox.sessions import (
    EnvFailed,
    EpisodeDone,
    SandboxFull,
    SessionStore,
    UnknownEnv,
    UnknownSession,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@register_env("test-never-done")
class NeverDone(Environment):
    """Never says done: the store must still end the episode at max_turns."""

    max_turns = 2

    def reset(self, seed: int) -> str:
        self.steps = 0
        return "go:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        self.steps += 1
        return "\n", False

    def score(self) -> float:
        return 0.5


@register_env("test-broken")
class Broken(Environment):
    """reset(seed) misbehaves by seed: 0 ok, 1 raises; step raises; score out of range."""

    def reset(self, seed: int) -> str:
        if seed == 1:
            raise RuntimeError("boom in reset")
        return "x:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        raise ValueError("boom in step")

    def score(self) -> float:
        return 2.0


def test_turn_cap_and_409() -> None:
    store = SessionStore(10, 60)
    s, prompt = store.create("test-never-done", 0)
    assert prompt == "go:" and s.max_turns == 2
    assert store.step(s.id, "a", True)[1:] == ("\n", False)
    assert store.step(s.id, "a", True)[2] is True  # capped at max_turns
    with pytest.raises(EpisodeDone):
        store.step(s.id, "a", True)
    assert store.score(s.id)[1] == 0.5


def test_capacity_and_expiry_with_fake_clock() -> None:
    clock = Clock()
    store = SessionStore(2, ttl_s=10, clock=clock)
    a, _ = store.create("echo", 0)
    b, _ = store.create("echo", 1)
    with pytest.raises(SandboxFull, match="max_sessions=2"):
        store.create("echo", 2)
    clock.t += 6
    store.get(a.id)  # touching a session restarts its idle clock
    clock.t += 6
    assert [s.id for s in store.sweep()] == [b.id]
    with pytest.raises(UnknownSession, match="expired after 10 s idle"):
        store.step(b.id, "a", True)
    store.create("echo", 3)
    assert store.stats()["expired"] == 1 and store.stats()["rejected_full"] == 1
    clock.t += 11
    assert len(store.sweep()) == 2 and len(store) == 0


def test_unknown_env_and_session() -> None:
    store = SessionStore(2, 10)
    with pytest.raises(UnknownEnv, match="env: unknown env 'nope'; known: .*reverse"):
        store.create("nope", 0)
    with pytest.raises(UnknownSession, match="unknown session 'x'"):
        store.score("x")
    with pytest.raises(UnknownSession):
        store.delete("x")


def test_broken_env_is_a_500_naming_the_env() -> None:
    store = SessionStore(2, 10)
    with pytest.raises(EnvFailed, match=r"env 'test-broken': reset\(1\) raised RuntimeError: boom in reset"):
        store.create("test-broken", 1)
    assert len(store) == 0  # a failed reset takes no slot
    s, _ = store.create("test-broken", 0)
    with pytest.raises(EnvFailed, match="step\\(\\) raised ValueError") as e:
        store.step(s.id, "a", True)
    assert e.value.status == 500
    with pytest.raises(EnvFailed, match=r"reward 2.0, outside \[0, 1\]"):
        store.score(s.id)
    assert len(store) == 1  # a failed score does not close the session; DELETE does
    store.delete(s.id)
    assert len(store) == 0


def test_app_maps_env_failures_to_500() -> None:
    from fastapi.testclient import TestClient

    from services.common.auth import auth_headers
    from services.common.config import RunConfig
    from services.sandbox.server import build_app

    with TestClient(build_app(RunConfig()), headers=auth_headers()) as c:
        r = c.post("/v1/sessions", json={"env": "test-broken", "seed": 1})
        assert r.status_code == 500 and "boom in reset" in r.json()["detail"]
        sid = c.post("/v1/sessions", json={"env": "test-broken"}).json()["session_id"]
        r = c.post(f"/v1/sessions/{sid}/score")
        assert r.status_code == 500 and "outside [0, 1]" in r.json()["detail"]
        assert 'relay_sandbox_env_errors_total{env="test-broken"} 2.0' in c.get("/metrics").text


def test_unknown_task_env_fails_at_start() -> None:
    from services.common.config import OrchestratorSection, RunConfig, TaskSpec
    from services.sandbox.envs import EnvError
    from services.sandbox.server import check_tasks

    check_tasks(RunConfig())
    cfg = RunConfig(orchestrator=OrchestratorSection(tasks=[TaskSpec(env="echo"), TaskSpec(env="nope")]))
    with pytest.raises(
        EnvError, match=r"orchestrator.tasks\[1\].env = 'nope' is not a registered environment"
    ):
        check_tasks(cfg)


@register_env("test-bad-observation")
class BadObservation(Environment):
    def reset(self, seed: int) -> str:
        return "go:"

    def step(self, action: str, eos: bool = True) -> tuple[str, bool]:
        return 42, False  # type: ignore[return-value]

    def score(self) -> float:
        return 0.0

    def credit(self) -> list[list[float]] | None:
        return [[0.5]]  # wrong: one value per action character plus the end


def test_broken_observation_and_credit_are_500s_naming_the_env() -> None:
    store = SessionStore(2, 10)
    s, _ = store.create("test-bad-observation", 0)
    with pytest.raises(EnvFailed, match=r"env 'test-bad-observation': step\(\) returned observation 42") as e:
        store.step(s.id, "ab", True)
    assert e.value.status == 500 and e.value.env == "test-bad-observation"
    # credit() is only called when asked for: a run without token credit never trips on it
    assert store.score(s.id, keep=True)[3] is None
    with pytest.raises(EnvFailed, match=r"credit\(\) gave 1 turn\(s\), the episode has 0"):
        store.score(s.id, keep=True, credit=True)
