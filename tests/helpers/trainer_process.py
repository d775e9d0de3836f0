"""The trainer run the way the launcher runs it, for tests that train real steps: in this process
(trainer.train.run) for trainer.nproc 1, else as its own process (torchrun for nproc > 1)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from services.common.config import REPO_ROOT, RunConfig
from trainer.launch import trainer_command
from trainer.train import run as run_trainer


def start_trainer(cfg: RunConfig, run_dir: Path, redis_url: str, log: Path) -> subprocess.Popen[bytes]:
    """`trainer_command` (torchrun for nproc > 1) from the repository root, its output appended
    to `log` (a restarted trainer keeps the earlier run's lines). Reads run_dir/config.json."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with open(log, "ab") as fh:
        return subprocess.Popen(
            trainer_command(cfg, run_dir, redis_url), cwd=REPO_ROOT, stdout=fh, stderr=fh, env=env
        )


def run_trainer_steps(cfg: RunConfig, run_dir: Path, redis_url: str, timeout_s: float) -> None:
    """Write run_dir/config.json and run the trainer until it exits (run.max_steps): in this
    process for nproc 1, else `start_trainer` waited for at most timeout_s (killed after), its
    log (run_dir/trainer.log) in the failure message."""
    (run_dir / "config.json").write_text(cfg.dump())
    if cfg.trainer.nproc == 1:
        assert run_trainer(cfg, run_dir, redis_url) == 0
        return
    log = run_dir / "trainer.log"
    proc = start_trainer(cfg, run_dir, redis_url, log)
    try:
        assert proc.wait(timeout_s) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
