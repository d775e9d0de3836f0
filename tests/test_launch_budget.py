"""run.time_budget_s: the launcher stops the trainer gracefully once the budget is spent; the
run ends with exit 0, a checkpoint and its summary, well before max_steps."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.config import REPO_ROOT
from services.common.redis_server import RedisServer

pytestmark = pytest.mark.slow


def test_time_budget_ends_the_run_gracefully(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as redis:
        cmd = [
            sys.executable, "-m", "sbatch.launch", "run", "debug", f"--run.dir={run_dir}",
            f"--redis.url={redis.url}", "--run.max_steps=100000", "--run.time_budget_s=20",
            "--run.timeout_s=300", "--run.stop_on_targets=false",
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
