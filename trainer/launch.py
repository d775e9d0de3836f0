"""How the launcher starts the trainer: one process, or torchrun with trainer.nproc processes."""

from __future__ import annotations

import sys
from pathlib import Path

from services.common.config import RunConfig


def trainer_command(cfg: RunConfig, run_dir: str | Path, redis_url: str) -> list[str]:
    """argv for the trainer of this run. It reads RUN_DIR/config.json (the launcher writes it).

    nproc > 1 uses torchrun's standalone rendezvous (a free local port, one host); every worker
    runs the same `-m trainer` entry and initialises gloo from torchrun's environment.
    """
    run_dir = Path(run_dir)
    args = ["--config", str(run_dir / "config.json"), "--redis-url", redis_url, "--run-dir", str(run_dir)]
    n = cfg.trainer.nproc
    if n == 1:
        return [sys.executable, "-m", "trainer", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        "-m",
        "trainer",
        *args,
    ]
