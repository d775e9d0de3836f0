"""run.time_budget_s: the launcher stops the trainer gracefully once the budget is spent; the
run ends with exit 0, a checkpoint and its summary, well before max_steps. The launcher starts its
own Redis here: with the run's password, which like the run token stays in files only the owner
can read (services/common/auth.py)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.auth import SECRETS_FILE, load_run_secrets
from services.common.config import REPO_ROOT, load_resolved
from services.common.redis_server import CONF_FILE

pytestmark = pytest.mark.slow


def test_time_budget_ends_the_run_gracefully(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "sbatch.launch", "run", "debug", f"--run.dir={run_dir}",
        "--run.max_steps=100000", "--run.time_budget_s=20", "--run.timeout_s=300",
        "--run.stop_on_targets=false",
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "time budget" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    steps = summary["steps"]
    assert 0 < steps < 100000
    assert wall < 260, f"the budget did not stop the run ({wall:.0f}s)"
    # A graceful stop checkpoints the last committed step.
    assert (run_dir / "checkpoints" / f"step_{steps}").exists(), sorted(
        p.name for p in (run_dir / "checkpoints").iterdir()
    )
    # Every service authenticated (the run trained), with secrets nobody else can read.
    secrets = load_run_secrets(run_dir)
    for f in (run_dir / SECRETS_FILE, run_dir / "redis" / CONF_FILE):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert secrets.redis_password == secrets.token
    cfg_text = (run_dir / "config.json").read_text()
    assert secrets.token not in cfg_text and "@" not in load_resolved(run_dir / "config.json").redis.url
    for log in (run_dir / "logs").glob("*.log"):
        assert secrets.token not in log.read_text(errors="replace"), log
