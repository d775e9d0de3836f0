"""`make status` and `make stop` as a user runs them (python -m sbatch.launch ..., RUN=dir):
a finished run's status is one compact screen with clean values, and stop says what it stopped
or that nothing was running, never touching a process that merely reuses a run's pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from services.common.config import REPO_ROOT


def launch(*args: str, run_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RELAY_RUN_DIR": str(run_dir), "COLUMNS": "120"}
    return subprocess.run(
        [sys.executable, "-m", "sbatch.launch", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )


def summary(run_dir: Path) -> dict[str, object]:
    def task(target: float, hit: int | None) -> dict[str, object]:
        return {"first10": 0.03, "last10": 0.88, "best10": 0.89, "target": target, "steps_to_target": hit, "met": hit is not None}  # fmt: skip

    return {
        "run": "debug", "run_dir": str(run_dir), "status": "completed", "steps": 391, "wall_s": 543.2,
        "tasks": {"reverse": task(0.9, None), "reverse-turns": task(0.5, 88)},
        "staleness_mean": 0.84, "staleness_max": 1, "trainer_wait_s": 143.8, "decode_idle_s": 52.4,
        "tokens_per_s_mean": 17782.9, "max_off_policy_steps": 1,
        "ledger": {"started": 13000, "trained": 12512, "dropped": 400, "pending": 88, "lost": 0,
                   "trained_twice": 0, "trained_and_dropped": 0, "drop_reasons": ["stale"]},
        "versions_served": [*range(0, 300), *range(302, 392)],
    }  # fmt: skip


def test_status_of_a_finished_run_is_compact(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps(summary(tmp_path)))
    out = launch("status", run_dir=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) < 20, out.stdout
    assert "390 (v0-v299, v302-v391)" in out.stdout
    assert "not reached" in out.stdout and "None" not in out.stdout
    assert "reverse-turns" in out.stdout and "88" in out.stdout


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], start_new_session=True)


def test_stop_says_what_it_stopped(tmp_path: Path) -> None:
    out = launch("stop", run_dir=tmp_path)
    assert out.returncode == 0 and "nothing to stop" in out.stdout, out.stdout

    procs = {"sandbox.0": sleeper(), "decode.0": sleeper()}
    time.sleep(0.05)
    (tmp_path / "pids.json").write_text(json.dumps({n: p.pid for n, p in procs.items()}))
    out = launch("stop", run_dir=tmp_path)
    assert out.returncode == 0, out.stderr
    for name, p in procs.items():
        assert f"stopped {name} ({p.pid})" in out.stdout, out.stdout
        assert p.wait(10) == -15

    (tmp_path / "summary.json").write_text(json.dumps(summary(tmp_path)))
    out = launch("stop", run_dir=tmp_path)
    assert "not running (it ended: completed, 391 steps): nothing to stop" in out.stdout, out.stdout


def test_stop_leaves_a_reused_pid_alone(tmp_path: Path) -> None:
    stranger = sleeper()
    try:
        pids = tmp_path / "pids.json"
        pids.write_text(json.dumps({"launcher": stranger.pid, "decode.0": stranger.pid}))
        hour_ago = time.time() - 3600  # the run's processes were all started before this file
        os.utime(pids, (hour_ago, hour_ago))
        out = launch("stop", run_dir=tmp_path)
        assert "nothing to stop" in out.stdout, out.stdout
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
