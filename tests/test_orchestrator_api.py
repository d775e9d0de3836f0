"""The orchestrator's control API over real HTTP (a real Redis, the orchestrator as a subprocess):
status, pause/resume, metrics history, transcripts, and 4xx errors that name the bad field."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.common.auth import auth_headers
from services.common.bus import Bus
from services.common.config import RedisSection, RunConfig
from services.common.schemas import RolloutGroup, Sample

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def orchestrator(tmp_path: Path, redis_server: str) -> Iterator[tuple[str, Bus, subprocess.Popen[bytes]]]:
    prefix = f"test-orch-{uuid.uuid4().hex[:8]}"
    cfg = RunConfig(redis=RedisSection(url=redis_server, prefix=prefix))
    (tmp_path / "config.json").write_text(cfg.dump())
    bus = Bus(redis_server, prefix)
    with open(tmp_path / "orchestrator.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.orchestrator", "--config", str(tmp_path / "config.json")],
            cwd=REPO,
            env={**os.environ, "REDIS_URL": redis_server},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while not bus.services("orchestrator"):
        assert proc.poll() is None, (tmp_path / "orchestrator.log").read_text()
        assert time.monotonic() < deadline, "orchestrator never registered"
        time.sleep(0.1)
    try:
        yield bus.services("orchestrator")[0].url, bus, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)


def test_status_pause_resume_and_errors(orchestrator: tuple[str, Bus, subprocess.Popen[bytes]]) -> None:
    url, bus, proc = orchestrator
    status = httpx.get(f"{url}/v1/status").json()
    for key in ("step", "policy_version", "inflight_groups", "queue_depth", "last_reward", "services"):
        assert key in status
    assert any(s["kind"] == "orchestrator" for s in status["services"])
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert "relay_orchestrator_inflight_groups" in httpx.get(f"{url}/metrics").text
    assert httpx.get(f"{url}/docs").status_code == 200

    r = httpx.post(f"{url}/v1/pause", headers=auth_headers()).json()
    assert r["paused"] is True and r["reason"] == ""
    assert httpx.get(f"{url}/v1/status").json()["paused"] is True
    r = httpx.post(f"{url}/v1/pause", headers=auth_headers(), json={"reason": "inspecting rollouts"}).json()
    assert r["paused"] is True and r["reason"] == "inspecting rollouts"
    status = httpx.get(f"{url}/v1/status").json()
    assert status["paused_reason"] == "inspecting rollouts" and status["paused_s"] >= 0
    # The pause is in Redis: a restarted orchestrator (and the launcher's budget) sees it.
    assert bus.pause_state().paused and bus.pause_state().reason == "inspecting rollouts"
    # A malformed body changes nothing and names what is wrong.
    for body, field in (
        ({"reason": 5}, "reason"),
        ({"resaon": "typo"}, "resaon"),
        ({"reason": "x" * 501}, "reason"),
        (["reason"], "body"),
    ):
        r = httpx.post(f"{url}/v1/resume", headers=auth_headers(), json=body)
        assert r.status_code == 422 and field in r.json()["detail"], (body, r.text)
    r = httpx.post(
        f"{url}/v1/resume",
        content=b"{not json",
        headers={"content-type": "application/json", **auth_headers()},
    )
    assert r.status_code == 422, r.text
    assert httpx.get(f"{url}/v1/status").json()["paused"] is True
    time.sleep(0.3)
    r = httpx.post(f"{url}/v1/resume", headers=auth_headers(), json={"reason": "done"}).json()
    assert r["paused"] is False and r["paused_s"] >= 0.3
    assert not bus.pause_state().paused and bus.pause_state().total_s >= 0.3

    r = httpx.get(f"{url}/v1/metrics", params={"last": -1})
    assert r.status_code == 422 and "last" in r.json()["detail"]
    r = httpx.get(f"{url}/v1/rollouts/nope", headers=auth_headers())
    assert r.status_code == 404 and "rollout_id" in r.json()["detail"]
    assert httpx.get(f"{url}/v1/metrics").json() == []

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert not bus.services("orchestrator"), "deregistered on shutdown"


def test_rollout_transcript_masks(
    orchestrator: tuple[str, Bus, subprocess.Popen[bytes]], model_dir: Path
) -> None:
    url, bus, _ = orchestrator
    from services.common.schemas import WeightsInfo

    bus.publish_weights(WeightsInfo(version=0, path=str(model_dir)))  # gives the orchestrator its tokenizer
    sample = Sample(
        rollout_id="g1.0", tokens=[3, 4, 5, 1, 6, 7, 8, 1], loss_mask=[0, 0, 1, 1, 0, 0, 1, 1],
        logprobs=[0, 0, -1.0, -0.5, 0, 0, -0.2, -0.1], versions=[-1, -1, 0, 0, -1, -1, 1, 1], reward=1.0,
    )  # fmt: skip
    group = RolloutGroup(group_id="g1", env="echo-turns", seed=3, samples=[sample])
    bus.r.set(bus.k.rollout("g1"), group.model_dump_json())
    body = httpx.get(f"{url}/v1/rollouts/g1.0", headers=auth_headers()).json()
    (s,) = body["samples"]
    assert [seg["role"] for seg in s["segments"]] == ["prompt", "model", "env", "model"]
    assert [seg["trained"] for seg in s["segments"]] == [False, True, False, True]
    assert s["segments"][1]["text"] == "c<eos>" and s["segments"][3]["versions"] == [1, 1]
    assert s["min_version"] == 0
    assert httpx.get(f"{url}/v1/rollouts/g1.7", headers=auth_headers()).status_code == 404
    # A sample index must be ASCII digits: '²' passes str.isdigit() but not int().
    for bad in ("g1.²", "g1.x", "g1.-1", ".0"):
        r = httpx.get(f"{url}/v1/rollouts/{bad}", headers=auth_headers())
        assert r.status_code == 422 and r.json()["detail"].startswith("rollout_id:"), (bad, r.text)


def test_rollout_browser_lists_filters_and_pages(
    orchestrator: tuple[str, Bus, subprocess.Popen[bytes]], model_dir: Path
) -> None:
    """GET /v1/rollouts over the rollout log and the ledger, as the orchestrator and the trainer
    write them (through the bus): newest first, each row's fate and staleness, filters, paging,
    and a 422 naming any bad parameter."""
    url, bus, _ = orchestrator
    from services.common.schemas import RolloutLogEntry, WeightsInfo

    bus.publish_weights(WeightsInfo(version=0, path=str(model_dir)))
    groups = []
    for i in range(12):
        v = i // 3  # versions 0, 0, 0, 1, 1, 1, ...
        n_out = 1 + i % 3
        s = Sample(
            rollout_id=f"b{i}.0", tokens=[3, 4, 5] + [6] * n_out, loss_mask=[0, 0, 0] + [1] * n_out,
            logprobs=[0.0] * 3 + [-0.5] * n_out, versions=[-1] * 3 + [v] * n_out, reward=i / 12,
        )  # fmt: skip
        g = RolloutGroup(group_id=f"b{i}", env="reverse", seed=i, samples=[s, s])
        bus.r.set(bus.k.rollout(g.group_id), g.model_dump_json())
        bus.push_group(g)
        bus.log_rollout(RolloutLogEntry.of_group(g))
        groups.append(g)
    # The trainer trained b0-b7 (b0-b3 at version 1, b4-b7 at 2), dropped b8 as stale; b9-b11 pend.
    bus.mark_trained([f"b{i}" for i in range(4)], step=2, version=1)
    bus.mark_trained([f"b{i}" for i in range(4, 8)], step=3, version=2)
    bus.mark_dropped("b8", "stale: trainer v4 - min_version 2 = 2 > max_off_policy_steps 1", version=4)
    # A group the orchestrator dropped before it finished: no transcript, no reward.
    bus.mark_dropped("x1", "failed after 3 attempts")
    bus.log_rollout(RolloutLogEntry(group_id="x1", env="reverse", seed=99))

    page = httpx.get(f"{url}/v1/rollouts", headers=auth_headers()).json()
    rows = page["rollouts"]
    assert [r["id"] for r in rows] == ["x1", *[f"b{i}" for i in range(11, -1, -1)]]
    assert page["next_cursor"] is None
    by_id = {r["id"]: r for r in rows}
    assert (
        by_id["x1"]["status"] == "dropped"
        and by_id["x1"]["reward"] is None
        and by_id["x1"]["version"] is None
    )
    assert (
        by_id["b8"]["status"] == "dropped"
        and by_id["b8"]["staleness"] == 2
        and "stale" in by_id["b8"]["reason"]
    )
    assert by_id["b5"] == {
        **by_id["b5"], "status": "trained", "version": 1, "staleness": 1, "trained_at": 2, "reward": 5 / 12,
        "task": "reverse", "samples": 2, "length": 6.0, "model_tokens": 3.0,
    }  # fmt: skip
    assert (
        by_id["b0"]["staleness"] == 1
        and by_id["b10"]["status"] == "pending"
        and by_id["b10"]["staleness"] is None
    )

    # Filters: status, task, version range (a group's version is its oldest weights).
    def got(**p: object) -> list[str]:
        page = httpx.get(f"{url}/v1/rollouts", params=p, headers=auth_headers()).json()
        return [r["id"] for r in page["rollouts"]]

    assert got(status="pending") == ["b11", "b10", "b9"]
    assert got(status="dropped") == ["x1", "b8"]
    assert got(status="trained", version_min=1, version_max=1) == ["b5", "b4", "b3"]
    assert got(version_min=3) == ["b11", "b10", "b9"]
    assert got(task="reverse", limit=2) == ["x1", "b11"]

    # Paging: limit + cursor walks every row once, newest first.
    seen, cursor = [], None
    while True:
        params = {"limit": 5, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(f"{url}/v1/rollouts", params=params, headers=auth_headers()).json()
        seen += [r["id"] for r in page["rollouts"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [r["id"] for r in rows]

    for params, name in (
        ({"limit": 0}, "limit"),
        ({"limit": 501}, "limit"),
        ({"status": "lost"}, "status"),
        ({"cursor": "yesterday"}, "cursor"),
        ({"version_min": -1}, "version_min"),
        ({"version_min": 3, "version_max": 1}, "version_max"),
        ({"task": "echo"}, "task"),
        ({"colour": "red"}, "colour"),
    ):
        r = httpx.get(f"{url}/v1/rollouts", params=params, headers=auth_headers())
        assert r.status_code == 422 and name in r.json()["detail"], (params, r.text)

    # A listed row opens its transcript: turns with each model token's text and advantage.
    body = httpx.get(f"{url}/v1/rollouts/b5", headers=auth_headers()).json()
    assert body["fate"] == {"status": "trained", "trainer_version": 2, "reason": ""}
    assert body["reward"] == 5 / 12 and body["min_version"] == 1
    model = [seg for seg in body["samples"][0]["segments"] if seg["role"] == "model"]
    assert len(model) == 1 and len(model[0]["pieces"]) == len(model[0]["advantages"]) == 3
