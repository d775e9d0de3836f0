"""The local executor: the whole pipeline as separate processes on one machine (no Slurm).

Starts Redis (unless the run names one), then sandbox, decode, trainer and orchestrator, each
its own process logging to RUN_DIR/logs/<name>.log; prints one line per trainer step from
RUN_DIR/metrics.jsonl and a summary at the end (RUN_DIR/summary.json).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from trainer.launch import trainer_command

from sbatch.summary import StepLine, summarize
from services.common.bus import Bus
from services.common.config import REPO_ROOT, RunConfig
from services.common.redis_server import RedisServer

RUNS_DIR = REPO_ROOT / "runs"


@dataclass
class Proc:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def make_run_dir(cfg: RunConfig) -> Path:
    if cfg.run.dir:
        run_dir = Path(cfg.run.dir).resolve()
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = RUNS_DIR / f"{cfg.run.name}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    latest = RUNS_DIR / "latest"
    RUNS_DIR.mkdir(exist_ok=True)
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(run_dir)
    return run_dir


def service_argv(module: str, config_path: Path, redis_url: str, index: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        module,
        "--config",
        str(config_path),
        "--redis-url",
        redis_url,
        "--index",
        str(index),
    ]


class LocalRun:
    def __init__(self, cfg: RunConfig, console: Console | None = None):
        self.console = console or Console(highlight=False)
        self.run_dir = make_run_dir(cfg)
        self.redis: RedisServer | None = None
        redis_url = cfg.redis.url or os.environ.get("REDIS_URL", "")
        if not redis_url:
            self.redis = RedisServer(self.run_dir / "redis").start()
            redis_url = self.redis.url
        # Namespacing by run keeps several runs (or a re-run) on one Redis apart.
        prefix = f"{cfg.redis.prefix}:{self.run_dir.name}"
        self.cfg = cfg.model_copy(
            update={"redis": cfg.redis.model_copy(update={"url": redis_url, "prefix": prefix})}
        )
        self.config_path = self.run_dir / "config.json"
        self.config_path.write_text(self.cfg.dump())
        self.bus = Bus(redis_url, prefix)
        self.procs: list[Proc] = []
        self._stop_requested = False

    # ------------------------------------------------------------ processes

    def _plan(self) -> list[Proc]:
        url = self.cfg.redis.url
        plan = [
            Proc(f"sandbox.{i}", service_argv("services.sandbox", self.config_path, url, i))
            for i in range(self.cfg.sandbox.replicas)
        ]
        plan += [
            Proc(f"decode.{i}", service_argv("services.decode", self.config_path, url, i))
            for i in range(self.cfg.decode.replicas)
        ]
        plan.append(Proc("trainer", trainer_command(self.cfg, self.run_dir, url)))
        plan.append(Proc("orchestrator", service_argv("services.orchestrator", self.config_path, url)))
        return plan

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "REDIS_URL": self.cfg.redis.url}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        for p in self._plan():
            log = open(self.run_dir / "logs" / f"{p.name}.log", "ab")  # noqa: SIM115 - owned by the child
            p.popen = subprocess.Popen(
                p.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True
            )
            log.close()
            self.procs.append(p)
        pids = {p.name: p.popen.pid for p in self.procs if p.popen}
        pids["launcher"] = os.getpid()
        if self.redis and self.redis.proc:
            pids["redis"] = self.redis.proc.pid
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=2))

    def stop(self) -> None:
        # Orchestrator first so nothing new is generated, then the workers, the trainer last
        # but one (it may be committing a step), Redis last.
        order = ["orchestrator", "decode", "sandbox", "trainer"]
        for prefix in order:
            group = [p for p in self.procs if p.name.startswith(prefix) and p.alive]
            for p in group:
                assert p.popen is not None
                os.killpg(p.popen.pid, signal.SIGTERM)
            for p in group:
                assert p.popen is not None
                try:
                    p.popen.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait()
        if self.redis:
            self.redis.stop()

    # ------------------------------------------------------------ monitoring

    def _metrics(self) -> Iterator[dict[str, Any] | None]:
        path = self.run_dir / "metrics.jsonl"
        pos = 0
        while True:
            if path.exists():
                with path.open() as f:
                    f.seek(pos)
                    while line := f.readline():
                        if not line.endswith("\n"):
                            break
                        pos = f.tell()
                        yield json.loads(line)
            yield None

    def _targets_met(self, history: list[dict[str, Any]]) -> bool:
        if len(history) < 10:
            return False
        for t in self.cfg.orchestrator.tasks:
            vals = [h["reward_by_env"].get(t.env) for h in history[-10:]]
            vals = [v for v in vals if v is not None]
            if not vals or sum(vals) / len(vals) < t.target:
                return False
        return True

    def monitor(self) -> int:
        """Print step lines until the trainer finishes; returns the exit code of the run."""
        deadline = time.monotonic() + self.cfg.run.timeout_s
        history: list[dict[str, Any]] = []
        line = StepLine(self.cfg)
        self.console.print(line.header())
        for rec in self._metrics():
            if rec is not None:
                history.append(rec)
                self.console.print(line.format(rec))
                if self.cfg.run.stop_on_targets and self._targets_met(history):
                    self.console.print("[green]all task targets met: stopping the trainer[/]")
                    self.bus.r.set(f"{self.bus.k.prefix}:control:stop", "targets met")
                continue
            trainer = next(p for p in self.procs if p.name == "trainer")
            if not trainer.alive:
                # drain the last lines the orchestrator may still be writing
                time.sleep(1.0)
                for rec2 in self._metrics():
                    if rec2 is None:
                        break
                    history.append(rec2)
                    self.console.print(line.format(rec2))
                code = trainer.popen.returncode if trainer.popen else 1
                if code != 0:
                    self.console.print(
                        f"[red]trainer exited with {code}: see {self.run_dir}/logs/trainer.log[/]"
                    )
                return code or 0
            dead = [p for p in self.procs if p.name != "trainer" and not p.alive]
            if dead:
                names = ", ".join(f"{p.name} (exit {p.popen.returncode if p.popen else '?'})" for p in dead)
                self.console.print(f"[red]service died: {names}; logs in {self.run_dir}/logs[/]")
                return 1
            if self._stop_requested:
                return 130
            if time.monotonic() > deadline:
                self.console.print(f"[red]run timed out after {self.cfg.run.timeout_s:.0f}s[/]")
                return 124
            time.sleep(0.2)
        return 1

    def request_stop(self, *_: object) -> None:
        self._stop_requested = True


def run(cfg: RunConfig) -> int:
    console = Console(highlight=False)
    t0 = time.time()
    lr = LocalRun(cfg, console)
    console.print(f"[bold]relay[/] run [cyan]{cfg.run.name}[/] -> {lr.run_dir}")
    console.print(f"redis {lr.cfg.redis.url} (prefix {lr.cfg.redis.prefix}); logs in {lr.run_dir / 'logs'}")
    signal.signal(signal.SIGTERM, lr.request_stop)
    signal.signal(signal.SIGINT, lr.request_stop)
    code = 1
    try:
        lr.start()
        code = lr.monitor()
        summary = summarize(lr.cfg, lr.run_dir, lr.bus, time.time() - t0, code)
        (lr.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        StepLine(lr.cfg).print_summary(console, summary)
    finally:
        lr.stop()
    return code
