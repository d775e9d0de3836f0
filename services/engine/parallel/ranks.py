"""A service's engine over several ranks: the service's process is rank 0, and it starts the
other ranks of its node as worker processes (services/engine/parallel/worker.py) that meet it at a
TCP rendezvous.

On one node the rendezvous is on 127.0.0.1. An engine spanning nodes (Slurm: fewer decode replicas
than decode nodes, `RunConfig.engine_nodes`) takes its node's share of the ranks here, and every
other node of the replica runs a node host (services/engine/parallel/node.py) that starts that
node's ranks: rank 0 publishes the rendezvous (tcp://<its host>:<port> and a fresh group id) in
Redis with a TTL, refreshed while it lives, and each node host beats the group id it joined.

The group lives and dies as one. A local worker that exits, a node host whose beat stops or names
another group, or a step that fails (a collective timed out or lost its peer) calls `on_failure`;
a service passes one that exits the process non-zero, and its supervisor restarts the service,
which starts a fresh group (a new id: the node hosts join it). Workers whose rank 0 is gone fail
their next collective and exit too (they also get SIGTERM from `stop`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import redis

from services.common.bus import Bus
from services.common.config import RunConfig
from services.common.net import free_port
from services.common.service import Service, log_event
from services.engine.async_engine import AsyncEngine
from services.engine.parallel.engine import ParallelEngine
from services.engine.parallel.group import EngineGroups, close_engine_groups, init_engine_groups
from services.engine.parallel.runner import rank_device
from services.engine.parallel.worker import worker_argv

log = logging.getLogger(__name__)

Role = Literal["decode", "prefill"]
# An engine spanning nodes: rank 0 refreshes its rendezvous key, and each node host its beat, every
# BEAT_S; a key RENDEZVOUS_TTL_S old is a dead process.
BEAT_S = 1.0
RENDEZVOUS_TTL_S = 5.0


def node_ranks(ranks: int, nodes: int, node: int) -> range:
    """The engine ranks on node `node` of the `nodes` an engine spans (rank 0's node is 0)."""
    per = ranks // nodes
    return range(node * per, (node + 1) * per)


class EngineRanks:
    """Ranks 1.. of one service's engine, as child processes, and rank 0's group."""

    def __init__(
        self,
        cfg: RunConfig,
        role: Role,
        on_failure: Callable[[str], None],
        timeout_s: float = 300.0,
        poll_s: float = 0.5,
        bus: Bus | None = None,
        name: str = "",
    ) -> None:
        """bus, name: the run's Redis and the service's name (decode.3), for an engine spanning
        nodes (its rendezvous and the node hosts' beats)."""
        self.cfg, self.role, self.on_failure = cfg, role, on_failure
        self.engine_cfg = cfg.decode.engine if role == "decode" else (cfg.prefill.engine or cfg.decode.engine)
        self.par = cfg.decode.parallel if role == "decode" else cfg.prefill_parallel
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.nodes = cfg.engine_nodes(role)
        self.bus, self.name = bus, name
        self.group_id = uuid.uuid4().hex
        if self.nodes > 1:
            if bus is None or not name:
                raise ValueError("an engine spanning nodes needs the run's Redis and its service name")
            self.init = f"tcp://{socket.gethostname()}:{free_port()}"
        else:
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
        self._joined = False  # every rank is in the group

    def start(self) -> EngineGroups:
        """Start ranks 1.., watch them from a thread and join the group as rank 0 (blocks until
        every rank has joined)."""
        for rank in node_ranks(self.par.ranks, self.nodes, 0)[1:]:
            argv = worker_argv(self._cfg_file.name, self.role, rank, self.init, self.timeout_s)
            self.procs.append(subprocess.Popen(argv, cwd=Path(__file__).resolve().parents[3]))
        if self.nodes > 1:
            self._publish()
        # Watched from the start: a worker that dies before joining fails the group at once
        # instead of leaving rank 0 in the rendezvous until its timeout.
        threading.Thread(target=self._watch, name=f"{self.role}-ranks", daemon=True).start()
        backend = "nccl" if rank_device(self.engine_cfg, 0).type == "cuda" else "gloo"
        self.groups = init_engine_groups(self.par, 0, self.init, backend, self.timeout_s)
        self._joined = True
        return self.groups

    def _publish(self) -> None:
        """The rendezvous for the other nodes' hosts, alive for RENDEZVOUS_TTL_S unless refreshed."""
        assert self.bus is not None
        value = json.dumps({"init": self.init, "group": self.group_id})
        self.bus.r.set(self.bus.k.engine_rendezvous(self.name), value, px=int(RENDEZVOUS_TTL_S * 1000))

    def _remote_gone(self) -> str:
        """A node whose host no longer beats this group's id (its ranks died, or it joined
        another group), once every rank has joined; '' while all beat."""
        assert self.bus is not None
        keys = [self.bus.k.engine_node(self.name, n) for n in range(1, self.nodes)]
        for node, got in enumerate(self.bus.r.mget(keys), start=1):
            if got != self.group_id:
                r = node_ranks(self.par.ranks, self.nodes, node)
                which = f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}-{r[-1]}"
                return f"{which} on node {node} stopped (its host's beat ended)"
        return ""

    def engine(self, model_dir: str | Path, version: int | None) -> ParallelEngine:
        """Rank 0's engine; a failed step or update ends the group (on_failure)."""
        assert self.groups is not None, "start() first"
        return ParallelEngine(
            model_dir,
            self.engine_cfg,
            self.par,
            self.groups,
            version,
            on_failure=lambda e: self._fail(self._broken_rank() or f"engine step failed: {e!r}"),
        )

    def _broken_rank(self) -> str:
        """Which rank broke a failed step, '' when none is found. The step raises as soon as the
        dead peer's socket closes, a moment before a local worker is reaped (waited for up to
        1 s) or a further node's host drops its beat (it looks every BEAT_S: up to 3 s): waiting
        names the rank instead of the collective's error."""
        deadline = time.monotonic() + (3.0 if self.nodes > 1 else 1.0)
        while True:
            dead = self._dead_rank()
            if not dead and self.nodes > 1 and self._joined:
                try:
                    dead = self._remote_gone()
                except redis.RedisError:
                    pass
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def _dead_rank(self) -> str:
        """'rank r exited with c' for the first local worker found dead, else ''."""
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                return f"rank {rank} exited with {code}"
        return ""

    def _watch(self) -> None:
        last_beat = time.monotonic()
        while not self._stopping.wait(self.poll_s):
            dead = self._dead_rank()
            if not dead and self.nodes > 1 and time.monotonic() - last_beat >= BEAT_S:
                last_beat = time.monotonic()
                try:
                    self._publish()
                    dead = self._remote_gone() if self._joined else ""
                except redis.RedisError as e:  # Redis restarting: the collectives still tell
                    log.warning("cannot refresh the %s rendezvous: %s", self.name, e)
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
        if self.nodes > 1 and self.bus is not None:
            try:  # the node hosts stop waiting on this group at once
                self.bus.r.delete(self.bus.k.engine_rendezvous(self.name))
            except redis.RedisError:
                pass  # the key expires
        if self.groups is not None:
            close_engine_groups(self.groups)
        self._cfg_file.close()


# A service whose rank group broke exits this long after answering what it held with 503s.
RANKS_FAILED_EXIT_S = 2.0


def end_replica(service: Service, engine: AsyncEngine | None, ranks: EngineRanks | None, why: str) -> None:
    """A rank died or a step broke the group: the service's replica cannot go on. /health turns
    503 naming the rank, every request waiting or in flight is answered 503 with the reason (the
    caller retries elsewhere), the other workers are killed, and the process exits 1 after
    RANKS_FAILED_EXIT_S, for its supervisor to restart the whole group. Called from the ranks'
    watcher or the engine loop thread: nothing here waits on the engine."""
    reason = f"engine ranks failed: {why}"
    service.failed = reason
    log_event(service.log, "engine ranks failed", reason=why)
    if engine is not None:
        engine.fail(reason)
    if ranks is not None:
        ranks.kill()
    exit_timer = threading.Timer(RANKS_FAILED_EXIT_S, os._exit, (1,))
    exit_timer.daemon = True
    exit_timer.start()
