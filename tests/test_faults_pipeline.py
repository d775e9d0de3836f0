"""Whole debug runs (local launcher, every service a real process, a real Redis) with faults
injected mid-run: each ends in a finished run whose ledger lost nothing and trained nothing twice.

- Redis killed, decode hung (SIGSTOP), a supervisor killed, the orchestrator killed;
- the trainer killed, then the run stopped and resumed (`make resume`): admission stays right
  (stale drops stay low) and the step lines go on where they were;
- the disk of the run directory full: the trainer stops cleanly, the launcher says "disk full",
  and the run resumes once there is room again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.parallel import worker_pids

from services.common.auth import load_run_secrets, with_credentials
from services.common.bus import Bus
from services.common.config import REPO_ROOT, load_resolved
from services.common.redis_server import RedisServer
from services.common.schemas import RolloutGroup

pytestmark = pytest.mark.slow

FAST = [
    '--orchestrator.tasks=[{env="reverse", target=0.9}]',
    "--orchestrator.batch_size=16",
    "--run.stop_on_targets=false",
    "--run.timeout_s=400",
    "--slurm.supervisor.backoff_s=0.5",
    "--slurm.supervisor.probe_interval_s=1",
    "--slurm.supervisor.probe_timeout_s=2",
    "--slurm.supervisor.probe_failures=2",
]


def launch(
    run_dir: Path, *args: str, resume: bool = False, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "sbatch.launch"]
    cmd += ["resume", *args] if resume else ["run", "debug", f"--run.dir={run_dir}", *FAST, *args]
    out = run_dir.parent / ("resume.out" if resume else "launch.out")
    env = {**os.environ, **(env or {}), "RELAY_RUN_DIR": str(run_dir)}
    with open(out, "w") as log:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def output(run_dir: Path, resume: bool = False) -> str:
    return (run_dir.parent / ("resume.out" if resume else "launch.out")).read_text()


def steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def wait_step(run_dir: Path, n: int, proc: subprocess.Popen[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not steps(run_dir) or steps(run_dir)[-1]["step"] < n:
        assert proc.poll() is None, output(run_dir)[-4000:]
        assert time.monotonic() < deadline, f"no step {n} after {timeout:.0f}s"
        time.sleep(0.3)


def child_pid(run_dir: Path, name: str) -> int:
    return int((run_dir / "pids" / f"{name}.pid").read_text())


def finish(proc: subprocess.Popen[str], run_dir: Path, resume: bool = False) -> str:
    try:
        proc.wait(400)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    return output(run_dir, resume)


def check_ledger(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    led = summary["ledger"]
    assert led["lost"] == 0 and led["trained_twice"] == 0 and led["trained_and_dropped"] == 0, led
    assert led["started"] == led["trained"] + led["dropped"] + led["pending"], led
    done = [h["step"] for h in steps(run_dir)]
    assert done == sorted(set(done)), f"steps went back or repeated: {done}"
    return summary


def supervisor_events(run_dir: Path, name: str, msg: str) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "logs" / f"{name}.log").read_text().splitlines():
        if line.startswith("{") and '"supervisor"' in line:
            rec = json.loads(line)
            if rec.get("msg") == msg:
                out.append(rec)
    return out


def test_service_faults_then_trainer_restart_stop_and_resume(tmp_path: Path) -> None:
    """One run, its faults one after another (a run each would pay the debug run's start-up again).

    First the services: the run's Redis killed (back with its data), decode hung (SIGSTOP: only the
    liveness probe can tell), a supervisor killed (the launcher's watchdog starts it again), the
    orchestrator killed (the task order must go on). Each service is started again only for its own
    fault: no client died of the Redis kill, the trainer was never restarted and the step lines
    stayed contiguous through all of them.

    Then the trainer is killed (it resumes from its last checkpoint as a new version, the updates
    since lost), later the run is stopped (`make stop`) and resumed (`make resume`) with more steps.
    Admission, derived from the ledger, keeps stale drops as low after each as before; the resumed
    run prints only its new steps and its ledger counts both parts."""
    run_dir = tmp_path / "run"
    batch = 16
    proc = launch(run_dir, "--run.max_steps=100", "--trainer.checkpoint_every=3")
    try:
        wait_step(run_dir, 2, proc)
        os.kill(child_pid(run_dir, "redis"), signal.SIGKILL)  # the run's Redis: back with its data
        wait_step(run_dir, 4, proc)
        decode = child_pid(run_dir, "decode.0")
        os.kill(decode, signal.SIGSTOP)  # hung: only the liveness probe can tell
        wait_step(run_dir, 6, proc)
        sup = json.loads((run_dir / "pids.json").read_text())["sandbox.0"]
        os.kill(int(sup), signal.SIGKILL)  # a supervisor: the launcher's watchdog starts it again
        wait_step(run_dir, 8, proc)
        os.kill(child_pid(run_dir, "orchestrator"), signal.SIGKILL)  # the task order must go on
        # Two steps on from the orchestrator's restart, the service faults are behind the run:
        # the trainer has not been restarted for any of them.
        wait_step(run_dir, 10, proc)
        assert len(supervisor_events(run_dir, "trainer", "started")) == 1
        killed_after = steps(run_dir)[-1]["step"]
        os.kill(child_pid(run_dir, "trainer"), signal.SIGKILL)
        wait_step(run_dir, killed_after + 7, proc)
        proc.send_signal(signal.SIGTERM)  # what `make stop` does
        out = finish(proc, run_dir)
        assert proc.returncode == 130, out[-4000:]
        first = steps(run_dir)
        first_summary = json.loads((run_dir / "summary.json").read_text())
        assert first_summary["status"] == "stopped"

        # The service faults, as the first part of the run left them.
        assert first_summary["supervisors_restarted"] == {"sandbox.0": 1}, first_summary
        assert "supervisor of sandbox.0 was killed" in out
        assert len(supervisor_events(run_dir, "redis", "started")) == 2
        # No client died of the Redis kill: each service was started again only for its own fault
        # (decode hung, sandbox's supervisor killed, orchestrator killed, trainer killed).
        assert len(supervisor_events(run_dir, "decode.0", "started")) == 2
        assert len(supervisor_events(run_dir, "sandbox.0", "started")) == 2
        assert len(supervisor_events(run_dir, "trainer", "started")) == 2
        hung = supervisor_events(run_dir, "decode.0", "child hung: killing")
        assert [h["pid"] for h in hung] == [decode], hung
        assert len(supervisor_events(run_dir, "orchestrator", "started")) == 2
        # The restarted orchestrator went on with the task order: no (task, seed) was drawn twice.
        seeds = transcript_seeds(run_dir)  # the run's Redis is down between the stop and the resume
        assert len(seeds) >= len(first) * batch and len(set(seeds.values())) == len(seeds)

        last = first[-1]["step"]
        proc = launch(run_dir, f"--run.max_steps={last + 6}", resume=True)
        out = finish(proc, run_dir, resume=True)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-5000:]
    assert f"resuming after step {last}" in out
    printed = [int(x.split()[0]) for x in out.splitlines() if x.strip() and x.split()[0].isdigit()]
    assert printed == list(range(last + 1, last + 7)), out  # the new steps only, once each
    summary = check_ledger(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == last + 6
    assert summary["ledger"]["started"] > first_summary["ledger"]["started"]
    hist = steps(run_dir)
    done = [h["step"] for h in hist]
    # Killed after step k (k depends on how fast the steps go): the restart publishes its
    # checkpoint's model as the next version, k + 1 (k + 2 if the killed step's weights were already
    # out), never a number already used, and trains on from there; every step once. Up to the
    # kill the steps ran 1, 2, ... k: none of the service faults broke the counter.
    k = next(i for i, step in enumerate(done) if step != i + 1)
    assert k >= killed_after >= 10 and done[k] in (k + 2, k + 3) and done == sorted(set(done)), done
    # The version the restart skipped makes at most one batch of what was pending stale at once.
    assert hist[k]["dropped_stale"] <= batch, hist[k]
    # From then on admission is as before. (By version number, the restart admitted a batch more
    # for the rest of the run, and the resumed run on a fresh Redis everything it could: a third
    # to a half of the groups were dropped as stale.)
    after_restart = [h for h in hist if done[k] < h["step"] <= last]
    after_resume = [h for h in hist if h["step"] > last]
    shares = [stale_share(x, batch) for x in (after_restart, after_resume)]
    assert max(shares) <= 0.15, shares


def transcript_seeds(run_dir: Path) -> dict[str, int]:
    """group id -> seed of every finished group, read from the run's Redis data (AOF) after the run."""
    cfg = load_resolved(run_dir / "config.json")
    with RedisServer(run_dir / "redis") as server:
        bus = Bus(server.url, cfg.redis.prefix)
        out = {}
        for key in bus.r.scan_iter(match=bus.k.rollouts_pattern, count=1000):
            g = RolloutGroup.model_validate_json(bus.r.get(key))
            out[g.group_id] = g.seed
    return out


def stale_share(hist: list[dict[str, Any]], batch: int) -> float:
    """Groups dropped as stale per group trained, over these steps."""
    return sum(h["dropped_stale"] for h in hist) / (batch * len(hist))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs: a disk that fills up. Needs root (mount); skipped elsewhere."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Write zeros into `path` until its filesystem has no room left."""
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * (1 << 20)
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_disk_full_stops_the_trainer_cleanly_and_the_run_resumes(small_disk: Path, tmp_path: Path) -> None:
    """The run directory's disk fills up mid-run: the trainer stops at the write that failed (no
    restarts into the same wall), leaves no partial `.step_N.tmp-*` directory, logs where it can,
    and the launcher says "disk full"; summary.json is never left empty or cut short. With room
    again, `make resume` finishes the run with its ledger."""
    run_dir = small_disk / "run"
    fallback = tmp_path / "fallback-logs"
    env = {"RELAY_LOG_FALLBACK": str(fallback)}
    with RedisServer(tmp_path / "redis") as redis_server:  # Redis's own files on another disk
        proc = launch(run_dir, "--run.max_steps=100", f"--redis.url={redis_server.url}", env=env)
        try:
            wait_step(run_dir, 3, proc)
            fill(small_disk / "filler")
            out = finish(proc, run_dir)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 73, out[-5000:]
        assert "disk full" in out, out[-3000:]
        assert not list(run_dir.glob("*/.step_*.tmp-*")), list(run_dir.glob("*/.step_*.tmp-*"))
        summary = run_dir / "summary.json"
        if summary.exists():  # written atomically, or not at all (then it is on the console)
            json.loads(summary.read_text())
        else:
            assert "could not write" in out and '"ledger"' in out
        logs = list(fallback.glob("*/trainer.log"))
        assert logs and '"disk full"' in logs[0].read_text(), logs
        trainer_sup = [
            e for e in supervisor_events_text(run_dir, fallback, "trainer") if e.get("msg") == "failed"
        ]
        assert trainer_sup and trainer_sup[-1]["exit"] == 73 and trainer_sup[-1]["restarts"] == 0, trainer_sup

        (small_disk / "filler").unlink()
        # Where the trainer got to (metrics.jsonl may lag: its last lines met the full disk too).
        cfg = load_resolved(run_dir / "config.json")
        bus = Bus(redis_server.url, cfg.redis.prefix)
        state = bus.r.hgetall(bus.k.trainer_state)
        assert state["status"] == "disk full", state
        stopped_at = int(state["version"])
        proc = launch(run_dir, f"--run.max_steps={stopped_at + 3}", resume=True, env=env)
        out = finish(proc, run_dir, resume=True)
        assert proc.returncode == 0, out[-5000:]
        summary_ok = check_ledger(run_dir)
        assert summary_ok["status"] == "completed" and summary_ok["steps"] == stopped_at + 3
        ready = [
            json.loads(x)
            for x in (run_dir / "logs" / "trainer.log").read_text().splitlines()
            if '"trainer ready"' in x
        ]
        assert ready[-1]["version"] > stopped_at, ready  # numbered on: no version reused


def supervisor_events_text(run_dir: Path, fallback: Path, name: str) -> list[dict[str, Any]]:
    """The supervisor's events for `name`, from its log and, once that could not be written, the
    fallback log."""
    out = []
    for path in [run_dir / "logs" / f"{name}.log", *fallback.glob(f"*/{name}.log")]:
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if line.startswith("{") and '"supervisor"' in line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


@pytest.mark.full
def test_a_killed_decode_rank_restarts_the_group_and_loses_no_rollout(tmp_path: Path) -> None:
    """Decode at TP 2 (its rank 1 a child process): rank 1 is SIGKILLed mid-run. The service
    answers what it held with 503s and exits 1, its supervisor starts the whole group again, the
    orchestrator retries the lost groups, and the run finishes with nothing lost or trained twice."""
    run_dir = tmp_path / "run"
    steps_total = 6
    # A restart of the group takes 10-60 s on 2 busy cores: the orchestrator's retry window covers it.
    window = ["--orchestrator.service_retry_s=300", "--orchestrator.request_timeout_s=300"]
    proc = launch(run_dir, f"--run.max_steps={steps_total}", "--decode.parallel.tp=2", *window)
    try:
        wait_step(run_dir, 2, proc)
        decode = child_pid(run_dir, "decode.0")
        [worker] = worker_pids(decode)
        wait_running(run_dir)
        os.kill(worker, signal.SIGKILL)
        out = finish(proc, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-5000:]
    summary = check_ledger(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == steps_total
    log = (run_dir / "logs" / "decode.0.log").read_text()
    assert "engine ranks failed" in log and "rank 1 exited with -9" in log
    # It exits 1 by itself, or its supervisor's probe kills it first on the 503 /health.
    first = supervisor_events(run_dir, "decode.0", "child exited")[0]
    assert first["exit"] == 1 or "rank 1 exited with -9" in first["reason"], first
    assert len(supervisor_events(run_dir, "decode.0", "started")) == 2
    assert log.count("engine ranks joined") == 2  # a fresh group after the restart
    # The turns it held were answered 503 and asked again of the restarted group: no group was
    # dropped for the failure (only, at most, as stale).
    assert set(summary["ledger"]["drop_reasons"]) <= {"stale"}, summary["ledger"]


def wait_running(run_dir: Path, timeout: float = 60) -> None:
    """Until decode.0 is generating (its /health counts running sequences)."""
    cfg = load_resolved(run_dir / "config.json")
    bus = Bus(with_credentials(cfg.redis.url, load_run_secrets(run_dir)), cfg.redis.prefix)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for info in bus.services("decode"):
            try:
                if httpx.get(f"{info.url}/health", timeout=5).json().get("running", 0) > 0:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.02)
    raise AssertionError(f"decode generated nothing for {timeout:.0f}s")
