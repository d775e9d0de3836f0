"""Weight roll-out in a real pipeline (`sbatch.launch run debug`, a few steps): decode applies each
version it is given exactly once (applies == versions rolled out), never one it already serves,
and retention (run.keep_weights) leaves the newest versions, step_0 and nothing half-written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer_run import _events

from services.common.config import REPO_ROOT
from services.common.redis_server import RedisServer
from services.common.weights_dir import versions, weights_root

pytestmark = pytest.mark.slow  # ~60 s on 2 cores, mostly the services' start and stop


def test_decode_applies_each_rolled_out_version_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 6
    with RedisServer(tmp_path / "redis") as redis:
        cmd = [
            sys.executable, "-m", "sbatch.launch", "run", "debug",
            f"--run.dir={run_dir}", f"--redis.url={redis.url}", f"--run.max_steps={steps}",
            "--run.timeout_s=300", "--run.stop_on_targets=false", "--run.keep_weights.last=2",
            "--orchestrator.batch_size=8", "--orchestrator.group_size=4",
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    logs = run_dir / "logs"
    (ready,) = _events(logs / "decode.0.log", "engine ready")
    updated = [int(e["version"]) for e in _events(logs / "decode.0.log", "weights updated")]  # type: ignore[call-overload]
    applied = [int(ready["version"]), *updated]  # type: ignore[call-overload]
    rolled = {int(e["version"]) for e in _events(logs / "orchestrator.log", "weights rolled out")}  # type: ignore[call-overload]
    (running,) = _events(logs / "orchestrator.log", "orchestrator running")
    rolled.add(int(running["version"]))  # type: ignore[call-overload]
    assert sorted(applied) == sorted(set(applied)), f"a version applied twice: {applied}"
    assert set(applied) == rolled and len(applied) == len(rolled), (applied, sorted(rolled))
    assert max(applied) == steps
    assert not _events(logs / "decode.0.log", "weights update refused")
    # Retention after every publish: the newest 2, step_0 (every 100th) and what a service served
    # then (a decode a version or two behind); no temporary directory left behind.
    passes = _events(logs / "trainer.log", "weights retained")
    assert len(passes) == steps  # versions 1..steps (step_0 is written before any service is up)
    last = passes[-1]
    assert versions(run_dir) == sorted({0, steps - 1, steps} | set(last["served"]))  # type: ignore[call-overload]
    deleted = [v for p in passes for v in p["deleted"]]  # type: ignore[attr-defined]
    assert sorted(deleted) == sorted(set(range(steps + 1)) - set(versions(run_dir)))
    assert [p.name for p in weights_root(run_dir).iterdir() if p.name.startswith(".")] == []
