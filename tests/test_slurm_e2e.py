"""Whole runs under the supervisors, on the test Slurm cluster and locally: the debug run as one het
job completes; `kill -9` of Redis, of the sandbox's supervisor and of decode, `make restart
SERVICE=orchestrator` and `kill -9` of the trainer mid-run all end in a finished run with no
rollout lost or trained twice, and `make resume` continues a finished run as a new job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from sbatch.slurm import job_states
from sbatch.supervisor import FINAL_STATES, read_states
from services.common.auth import load_run_secrets, with_credentials
from services.common.bus import Keys, connect
from services.common.config import REPO_ROOT, load_resolved

pytestmark = pytest.mark.slow

# Debug-sized resources that fit the test cluster's virtual nodes; a fast-failing supervisor.
SLURM = ["--slurm.launcher=slurm", "--slurm.time=20"] + [
    f"--slurm.{c}.mem=2G" for c in ("head", "decode", "trainer")
]
COMMON = [
    '--orchestrator.tasks=[{env="reverse", target=0.5}]',
    "--slurm.supervisor.backoff_s=0.5",
    "--run.stop_on_targets=false",
]


def launch(run_dir: Path, steps: int, *extra: str) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "sbatch.launch", "run", "debug",
        f"--run.dir={run_dir}", f"--run.max_steps={steps}", "--run.timeout_s=540", *COMMON, *extra,
    ]  # fmt: skip
    log = open(run_dir.parent / "launcher.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], run_dir: Path, timeout: float = 580) -> str:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    out = (run_dir.parent / "launcher.out").read_text()
    assert proc.returncode == 0, out[-5000:]
    return out


def steps_done(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_steps(run_dir: Path, n: int, proc: subprocess.Popen[str], timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while len(steps_done(run_dir)) < n:
        assert proc.poll() is None, (run_dir.parent / "launcher.out").read_text()[-4000:]
        assert time.monotonic() < deadline, f"fewer than {n} steps after {timeout}s"
        time.sleep(0.5)


def run_redis(run_dir: Path) -> tuple[redis.Redis, str]:
    cfg = load_resolved(run_dir / "config.json")
    assert cfg.redis.url, "the head has not published Redis"
    # config.json names no credentials: they are in the run's secrets file (mode 0600).
    assert "@" not in cfg.redis.url
    return connect(with_credentials(cfg.redis.url, load_run_secrets(run_dir))), cfg.redis.prefix


def supervisor_state(r: redis.Redis, prefix: str, name: str) -> dict[str, Any]:
    raw = r.get(Keys(prefix).supervisor(name))
    assert raw, f"no supervisor state for {name}"
    return json.loads(raw)


def check_ledger(run_dir: Path, steps: int, contiguous: bool = True) -> dict[str, Any]:
    """contiguous=False: a trainer resumed from a checkpoint older than its last published
    version numbers on after it, so step numbers skip ahead (never back)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["steps"] == steps
    led = summary["ledger"]
    assert led["lost"] == 0 and led["trained_twice"] == 0 and led["trained_and_dropped"] == 0, led
    done = [h["step"] for h in steps_done(run_dir)]
    if contiguous:
        assert done == list(range(1, steps + 1)), "step counter not intact"
    else:
        assert done == sorted(set(done)) and done[-1] == steps, f"steps went back or repeated: {done}"
    return summary


@pytest.mark.full  # 90 s: learning is CI's test_e2e (same code path); Slurm is the other tests here
def test_debug_run_on_slurm_learns(slurm_cluster: str, tmp_path: Path) -> None:
    """The same debug run as locally, as a het job: the reward rises from its random-init level
    as it does in a local run (bench/calibration: ~0.02 -> 0.1-0.2 by step 80)."""
    run_dir = tmp_path / "run"
    steps = 80
    finish(launch(run_dir, steps, *SLURM), run_dir)
    check_ledger(run_dir, steps)
    rewards = [h["reward_by_env"]["reverse"] for h in steps_done(run_dir)]
    first = sum(rewards[:5]) / 5
    best = max(sum(rewards[i - 10 : i]) / 10 for i in range(10, len(rewards) + 1))
    assert first < 0.06 and best > 4 * first, f"no learning on Slurm: first {first:.3f} best10 {best:.3f}"


@pytest.mark.full  # a het job of 4 nodes with two engine starts: the layout's rendering is in test_slurm.py
def test_decode_engine_across_two_nodes_on_slurm(slurm_cluster: str, tmp_path: Path) -> None:
    """The debug run with one decode engine of TP 2 over two (virtual) nodes: decode.0 (rank 0)
    on the first, the node host decode.0.node1 (rank 1) on the second, meeting at the rendezvous
    rank 0 publishes in Redis; the run completes."""
    run_dir = tmp_path / "run"
    proc = launch(run_dir, 4, *SLURM, "--slurm.decode.nodes=2", "--decode.parallel.tp=2")
    finish(proc, run_dir)
    check_ledger(run_dir, 4)
    joined = [
        json.loads(x)
        for x in (run_dir / "logs" / "decode.0.log").read_text().splitlines()
        if '"engine ranks joined"' in x
    ]
    assert [(j["ranks"], j["nodes"]) for j in joined] == [(2, 2)]
    assert "joining decode.0 group" in (run_dir / "logs" / "decode.0.node1.log").read_text()
    plan = json.loads((run_dir / "slurm" / "plan.json").read_text())
    decode = next(c for c in plan["components"] if c["role"] == "decode")
    assert [[s["name"] for s in node] for node in decode["services"]] == [["decode.0"], ["decode.0.node1"]]


def run_redis_after(run_dir: Path) -> tuple[redis.Redis | None, str]:
    try:
        r, prefix = run_redis(run_dir)
        r.ping()
        return r, prefix
    except (redis.RedisError, AssertionError):
        return None, ""


def test_het_job_survives_four_faults_then_resumes_on_slurm(slurm_cluster: str, tmp_path: Path) -> None:
    """The debug run as one het job, the trainer as torchrun across two (virtual) nodes, with four
    faults in the same run (each a run of its own would cost a Slurm start-up):

    - on the head, Redis's server is SIGKILLed (its supervisor restarts it on its AOF and every
      client reconnects), then the sandbox's supervisor (the component task starts it again);
    - decode's process is SIGKILLed (its supervisor restarts it, it loads the current weights, the
      orchestrator re-issues what it lost), then `make restart SERVICE=orchestrator` (the CLI
      behind it) restarts the orchestrator, which resumes from Redis state.

    The job completes with every rollout accounted for and leaves the queue; `make resume` with
    more steps then continues it as a new job on the same Redis data, step lines going on after
    the last."""
    run_dir = tmp_path / "run"
    steps = 18  # the faults are over by step ~9: the rest is margin for a slow restart on a busy machine
    t0 = time.monotonic()
    proc = launch(run_dir, steps, *SLURM, "--slurm.trainer.nodes=2", "--trainer.nproc=2")
    wait_steps(run_dir, 2, proc)
    r, prefix = run_redis(run_dir)
    redis_pid = supervisor_state(r, prefix, "redis")["child_pid"]
    os.kill(redis_pid, signal.SIGKILL)
    wait_steps(run_dir, 3, proc)
    sandbox_sup = supervisor_state(r, prefix, "sandbox.0")["pid"]
    os.kill(sandbox_sup, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while supervisor_state(r, prefix, "sandbox.0")["pid"] == sandbox_sup:
        assert time.monotonic() < deadline, "the sandbox's supervisor was not started again"
        time.sleep(0.5)

    before = supervisor_state(r, prefix, "decode.0")
    assert before["state"] == "running" and before["restarts"] == 0
    os.kill(before["child_pid"], signal.SIGKILL)
    killed_at = len(steps_done(run_dir))
    # While the run goes on: the supervisor reports the kill and a new process.
    deadline = time.monotonic() + 120
    while True:
        st = supervisor_state(r, prefix, "decode.0")
        if st["restarts"] == 1 and st["state"] == "running" and st["child_pid"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    assert st["last_exit"] == -9 and st["child_pid"] != before["child_pid"]

    # The orchestrator is restarted once the restarted decode serves again (a step after the kill).
    wait_steps(run_dir, killed_at + 1, proc)
    first_pid = supervisor_state(r, prefix, "orchestrator")["child_pid"]
    env = {**os.environ, "RELAY_RUN_DIR": str(run_dir)}
    out = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "restart", "orchestrator"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and "restart requested: orchestrator" in out.stdout, out.stdout + out.stderr
    deadline = time.monotonic() + 120
    while True:
        st = supervisor_state(r, prefix, "orchestrator")
        if st["restarts"] == 1 and st["state"] == "running" and st["child_pid"] != first_pid:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    assert st["failures"] == 0
    # status shows the supervisors while the run goes on
    status = subprocess.run(
        [sys.executable, "-m", "sbatch.launch", "status"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # the services table: name, state, restarts ("1 (last exit 0)"), ...
    rows = [line.split() for line in status.stdout.splitlines() if line.split()[:1] == ["orchestrator"]]
    assert len(rows) == 1 and rows[0][2] == "1", status.stdout

    out = finish(proc, run_dir)
    first = check_ledger(run_dir, steps)
    redis_log = (run_dir / "logs" / "redis.log").read_text()
    assert redis_log.count('"msg": "child failed: restarting"') == 1, "Redis was not restarted once"
    slurm_log = "".join(p.read_text() for p in (run_dir / "slurm").glob("*_log.out"))
    assert "supervisor killed: starting it again" in slurm_log
    ready = [
        json.loads(x)
        for x in (run_dir / "logs" / "decode.0.log").read_text().splitlines()
        if '"engine ready"' in x
    ]
    assert len(ready) == 2, "decode should have started twice"
    assert ready[1]["version"] >= killed_at - 1 >= 1, "the restarted decode must load the current weights"

    # The het job: three components, gone from the queue, every service's log, torchrun on both nodes.
    info = json.loads((run_dir / "slurm.json").read_text())
    assert f"submitted het job {info['job_id']} (3 components)" in out
    assert " running after " in out
    assert first["stop_reason"] == "trainer finished" and first["slurm_job_id"] == str(info["job_id"])
    assert job_states(str(info["job_id"])) == [], "the job should have left the queue"
    r_after, prefix = run_redis_after(run_dir)
    if r_after is not None:  # Redis stops with the job; when it is still reachable, states must be final
        assert all(x["state"] in FINAL_STATES for x in read_states(r_after, prefix))
    for name in ("redis", "sandbox.0", "orchestrator", "decode.0", "trainer.0", "trainer.1"):
        assert (run_dir / "logs" / f"{name}.log").exists()
    trainer_ready = [
        json.loads(x)
        for n in (0, 1)
        for x in (run_dir / "logs" / f"trainer.{n}.log").read_text().splitlines()
        if '"trainer ready"' in x
    ]
    assert sorted((t["rank"], t["world"]) for t in trainer_ready) == [(0, 2), (1, 2)], (
        "torchrun across both nodes"
    )
    print(f"debug het-job run with four faults: {time.monotonic() - t0:.0f}s for {steps} steps")

    with open(tmp_path / "resume.out", "w") as log:
        resumed = subprocess.run(
            [sys.executable, "-m", "sbatch.launch", "resume", f"--run.max_steps={steps + 3}"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=580,
        )  # fmt: skip
    out = (tmp_path / "resume.out").read_text()
    assert resumed.returncode == 0, out[-5000:]
    summary = check_ledger(run_dir, steps + 3)
    assert summary["ledger"]["started"] > first["ledger"]["started"]
    printed = [int(x.split()[0]) for x in out.splitlines() if x.strip() and x.split()[0].isdigit()]
    assert printed == [steps + 1, steps + 2, steps + 3], out


# 66 s: make test has the same resume through the local launcher in test_faults_pipeline.py
# (trainer SIGKILLed, resumed as a new version, nothing trained twice) and test_trainer_run.py
@pytest.mark.full
def test_trainer_killed_resumes_from_checkpoint_locally(tmp_path: Path) -> None:
    """The trainer is SIGKILLed mid-run (local launcher): restarted by its supervisor, it resumes from
    its last checkpoint; nothing is trained twice and the published weight versions never go back."""
    run_dir = tmp_path / "run"
    steps = 8
    # A short timeout: if the resume stalls the run, fail in minutes, not the full budget.
    proc = launch(run_dir, steps, "--trainer.checkpoint_every=2", "--run.timeout_s=150")
    wait_steps(run_dir, 3, proc)
    r, prefix = run_redis(run_dir)
    versions: list[int] = []
    pid = supervisor_state(r, prefix, "trainer")["child_pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            raw = r.get(Keys(prefix).weights_latest)
        except redis.RedisError:
            break
        if raw:
            v = json.loads(raw)["version"]
            if not versions or versions[-1] != v:
                versions.append(v)
        time.sleep(0.1)
    finish(proc, run_dir)
    check_ledger(run_dir, steps, contiguous=False)
    assert versions == sorted(versions), f"weight versions went back: {versions}"
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert '"resumed_from"' in log and "checkpoints/step_" in log
