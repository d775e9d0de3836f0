"""Start a relay service as a real process the way the launcher does, for tests that need one,
and wait for it to register."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from services.common.bus import Bus
from services.common.config import REPO_ROOT, RunConfig


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


def start_with_config(
    module: str, cfg: RunConfig, redis_url: str, tmp: Path, name: str
) -> subprocess.Popen[bytes]:
    """`start_service` with `cfg` written to tmp/<name>.json and the log at tmp/<name>.log (one
    name per process, so several of one service can share a directory)."""
    cfg_path = tmp / f"{name}.json"
    cfg_path.write_text(cfg.dump())
    return start_service(module, cfg_path, redis_url, tmp / f"{name}.log")


def wait_registered(
    bus: Bus, kind: str, proc: subprocess.Popen[bytes], log: Path, n: int = 1, timeout_s: float = 60
) -> list[str]:
    """The URLs once at least `n` services of `kind` are in the registry; fails at once (with the
    log's tail) if `proc` exits first, and after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = bus.services(kind)
        if len(found) >= n:
            return [s.url for s in found]
        assert proc.poll() is None, f"{kind} exited {proc.returncode}: {log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise TimeoutError(f"{kind} did not register ({log})")
