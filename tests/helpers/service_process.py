"""Start a relay service as a real process the way the launcher does, for tests that need one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.common.config import REPO_ROOT


def start_service(module: str, config: Path, redis_url: str, log: Path) -> subprocess.Popen[bytes]:
    """`python -m <module> --config <config> --redis-url <redis_url>` from the repository root,
    its stdout and stderr written to `log` (read it when the process misbehaves)."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(config), "--redis-url", redis_url],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
