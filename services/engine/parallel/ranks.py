"""A service's engine over several ranks on its host: the service's process is rank 0, and it
starts ranks 1.. as worker processes (services/engine/parallel/worker.py) that meet it at a TCP
rendezvous on 127.0.0.1.

The group lives and dies as one. A worker that exits, or a step that fails (a collective timed out
or lost its peer), calls `on_failure`; a service passes one that exits the process non-zero, and
its supervisor restarts the service, which starts a fresh group. Workers whose rank 0 is gone fail
their next collective and exit too (they also get SIGTERM from `stop`).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from services.common.config import RunConfig
from services.common.net import free_port
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.group import EngineGroups, close_engine_groups, init_engine_groups
from services.engine.parallel.runner import rank_device

log = logging.getLogger(__name__)

Role = Literal["decode", "prefill"]


class EngineRanks:
    """Ranks 1.. of one service's engine, as child processes, and rank 0's group."""

    def __init__(
        self,
        cfg: RunConfig,
        role: Role,
        on_failure: Callable[[str], None],
        timeout_s: float = 300.0,
        poll_s: float = 0.5,
    ) -> None:
        self.cfg, self.role, self.on_failure = cfg, role, on_failure
        self.engine_cfg = cfg.decode.engine if role == "decode" else (cfg.prefill.engine or cfg.decode.engine)
        self.par = cfg.decode.parallel if role == "decode" else cfg.prefill_parallel
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.init = f"tcp://127.0.0.1:{free_port()}"
        # The workers read the same resolved config this process runs with.
        self._cfg_file = tempfile.NamedTemporaryFile("w", prefix=f"relay-{role}-ranks-", suffix=".json")
        self._cfg_file.write(cfg.dump())
        self._cfg_file.flush()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.groups: EngineGroups | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._failed = ""  # why the group broke (the first report)

    def start(self) -> EngineGroups:
        """Start ranks 1.., watch them from a thread and join the group as rank 0 (blocks until
        every rank has joined)."""
        for rank in range(1, self.par.ranks):
            argv = [
                sys.executable, "-m", "services.engine.parallel.worker",
                "--config", self._cfg_file.name, "--role", self.role,
                "--rank", str(rank), "--init", self.init, "--timeout-s", str(self.timeout_s),
            ]  # fmt: skip
            self.procs.append(subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[3]))
        # Watched from the start: a worker that dies before joining fails the group at once
        # instead of leaving rank 0 in the rendezvous until its timeout.
        threading.Thread(target=self._watch, name=f"{self.role}-ranks", daemon=True).start()
        backend = "nccl" if rank_device(self.engine_cfg, 0).type == "cuda" else "gloo"
        self.groups = init_engine_groups(self.par, 0, self.init, backend, self.timeout_s)
        return self.groups

    def engine(self, model_dir: str | Path, version: int | None) -> ParallelEngine:
        """Rank 0's engine; a failed step or update ends the group (on_failure)."""
        assert self.groups is not None, "start() first"
        return ParallelEngine(
            model_dir,
            self.engine_cfg,
            self.par,
            self.groups,
            version,
            on_failure=lambda e: self._fail(self._dead_rank(wait_s=1.0) or f"engine step failed: {e!r}"),
        )

    def _dead_rank(self, wait_s: float = 0.0) -> str:
        """'rank r exited with c' for the first worker found dead within wait_s, else ''. A step
        that failed on a dead peer raises as soon as its socket closes, a moment before the
        worker is reaped: waiting a little names the rank instead of the collective's error."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                code = p.poll()
                if code is not None:
                    return f"rank {rank} exited with {code}"
            if time.monotonic() >= deadline:
                return ""
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            dead = self._dead_rank()
            if dead:
                self._fail(dead)
                return

    def _fail(self, why: str) -> None:
        with self._lock:  # the watcher and a failed step may both report the same breakage
            if self._stopping.is_set() or self._failed:
                return
            self._failed = why
        log.error("%s engine rank group broken: %s", self.role, why)
        self.on_failure(why)

    def kill(self) -> None:
        """SIGKILL every worker still alive: the group is broken, none can serve again."""
        self._stopping.set()
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def stop(self, engine: ParallelEngine | None) -> None:
        """Release the workers (StopOrder) and reap them; SIGTERM, then SIGKILL, for any left."""
        self._stopping.set()
        if engine is not None:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - a broken group: the workers are signalled below
                log.exception("could not stop the %s ranks cleanly", self.role)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.groups is not None:
            close_engine_groups(self.groups)
        self._cfg_file.close()
