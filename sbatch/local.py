"""The local executor: the whole pipeline as separate processes on one machine (no Slurm).

Creates the run's secrets (RUN_DIR/secrets.json, services/common/auth.py), starts Redis with
their password (unless the run names one; persistent, in RUN_DIR/redis), then sandbox, decode,
trainer and orchestrator, each under its supervisor (sbatch/supervisor.py), logging to
RUN_DIR/logs/<name>.log, the secrets in its environment; prints one line per trainer step from
RUN_DIR/metrics.jsonl and a summary at the end (RUN_DIR/summary.json, written atomically). A
supervisor killed from outside is started again (a watchdog); one that gave up ends the run.
`resume=True` continues a stopped run in its directory: the same secrets, Redis data and key
prefix; the ledger and step lines go on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import redis
from rich.console import Console

from sbatch.budget import RunClock
from sbatch.files import write_atomic
from sbatch.summary import StepLine, print_summary, read_metrics_after, summarize, write_summary
from sbatch.supervisor import RestartPolicy, supervisor_argv
from services.common.auth import child_env, ensure_run_secrets, with_credentials
from services.common.bus import Bus, run_prefix, wait_for_redis
from services.common.config import REPO_ROOT, RunConfig, TaskSpec
from services.common.disk import FATAL_EXIT
from services.common.net import free_port
from services.common.redis_server import secure_conf, server_argv
from services.kvstore.launch import ensure_installed, kv_plan, resolve_ports
from trainer.launch import trainer_command

RUNS_DIR = REPO_ROOT / "runs"
# Less free space than this where the run writes, and a trainer that gave up: the disk is full.
DISK_LOW_BYTES = 64 << 20
T = TypeVar("T")


@dataclass
class Proc:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes] | None = None
    gpus: str = ""  # CUDA_VISIBLE_DEVICES of this process, when it must not see every GPU

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
    # runs/latest follows runs made under runs/ only: a run placed elsewhere (tests, --run.dir)
    # must not take `make status/stop` away from the user's own run.
    if run_dir.parent == RUNS_DIR:
        latest = RUNS_DIR / "latest"
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(run_dir)
    return run_dir


def targets_met(history: list[dict[str, Any]], tasks: list[TaskSpec]) -> bool:
    """Whether every task's mean reward over the last 10 steps has reached its target (the
    steps that carried the task): the rule `run.stop_on_targets` stops the run on."""
    if len(history) < 10:
        return False
    for t in tasks:
        vals = [h["reward_by_env"].get(t.env) for h in history[-10:]]
        vals = [v for v in vals if v is not None]
        if not vals or sum(vals) / len(vals) < t.target:
            return False
    return True


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


def decode_gpus(cfg: RunConfig, index: int) -> str:
    """The GPUs of decode replica `index` when its engine has several ranks (one per GPU, the
    service rank 0 and its workers ranks 1..): replica i takes GPUs [i x ranks, (i + 1) x ranks)
    of the machine. One-rank replicas (and CPU engines) keep seeing every GPU, as before."""
    ranks = cfg.decode.parallel.ranks
    if ranks == 1 or cfg.decode.engine.device == "cpu":
        return ""
    return ",".join(str(g) for g in range(index * ranks, (index + 1) * ranks))


def process_plan(cfg: RunConfig, run_dir: Path, config_path: Path, url: str) -> list[Proc]:
    plan = [
        Proc(f"sandbox.{i}", service_argv("services.sandbox", config_path, url, i))
        for i in range(cfg.sandbox.replicas)
    ]
    # KV store side (when kvstore.enabled): Mooncake master, the gateway, prefill services.
    plan += [Proc(name, service_argv(module, config_path, url, i)) for name, module, i in kv_plan(cfg)]
    plan += [
        Proc(f"decode.{i}", service_argv("services.decode", config_path, url, i), gpus=decode_gpus(cfg, i))
        for i in range(cfg.decode.replicas)
    ]
    plan.append(Proc("trainer", trainer_command(cfg, run_dir, url)))
    plan.append(Proc("orchestrator", service_argv("services.orchestrator", config_path, url)))
    return plan


class LocalRun:
    def __init__(self, cfg: RunConfig, console: Console | None = None, resume: bool = False):
        self.console = console or Console(highlight=False)
        self.resume = resume
        self.run_dir = make_run_dir(cfg)
        redis_url = cfg.redis.url or os.environ.get("REDIS_URL", "")
        # The run token, and Redis credentials kept out of config.json and every command line.
        self.secrets, redis_url = ensure_run_secrets(self.run_dir, redis_url)
        self.redis_port = 0  # ours to start (and restart) when the run names no Redis
        if not redis_url:
            self.redis_port = free_port()
            redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        # Namespacing by run keeps several runs (or a re-run) on one Redis apart.
        prefix = run_prefix(cfg.redis.prefix, self.run_dir.name)
        self.cfg = resolve_ports(cfg).model_copy(
            update={"redis": cfg.redis.model_copy(update={"url": redis_url, "prefix": prefix})}
        )
        self.config_path = self.run_dir / "config.json"
        write_atomic(self.config_path, self.cfg.dump())
        self.bus = Bus(with_credentials(redis_url, self.secrets), prefix)
        self.procs: list[Proc] = []
        self.revived: dict[str, int] = {}  # supervisors the watchdog started again
        self._stop_requested = False
        self._env: dict[str, str] = {}

    # ------------------------------------------------------------ processes

    def _plan(self) -> list[Proc]:
        return process_plan(self.cfg, self.run_dir, self.config_path, self.cfg.redis.url)

    @staticmethod
    def describe(cfg: RunConfig) -> list[tuple[str, list[str]]]:
        """The process plan with placeholder paths (dry run): what start() would run, unsupervised."""
        run_dir = RUNS_DIR / f"{cfg.run.name}-<stamp>"
        url = cfg.redis.url or "redis://127.0.0.1:<port>/0"
        plan = process_plan(cfg, run_dir, run_dir / "config.json", url)
        if not cfg.redis.url:
            plan.insert(0, Proc("redis", server_argv("<port>", run_dir / "redis")))
        return [(p.name + (f" [gpus {p.gpus}]" if p.gpus else ""), p.argv) for p in plan]

    def _launch(self, p: Proc) -> None:
        """Start (or, from the watchdog, start again) the supervisor of `p`. Its pid is what the
        launcher watches; it exits only when the service is done or given up."""
        probe = {"redis": "redis", "trainer": "none"}.get(p.name, "http")
        argv = supervisor_argv(
            p.name,
            p.argv,
            RestartPolicy.of(self.cfg.slurm.supervisor),
            self.cfg.redis.url,
            self.cfg.redis.prefix,
            probe=probe,
            pid_file=self.run_dir / "pids" / f"{p.name}.pid",
            log=self.run_dir / "logs" / f"{p.name}.log",
        )
        p.popen = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**self._env, "CUDA_VISIBLE_DEVICES": p.gpus} if p.gpus else self._env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )

    def start(self) -> None:
        ensure_installed(self.cfg)  # the Mooncake extra, when the run uses that tier
        env = {
            **child_env(os.environ, self.secrets),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "REDIS_URL": self.cfg.redis.url,
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        self._env = env
        (self.run_dir / "pids").mkdir(exist_ok=True)
        plan = self._plan()
        if self.redis_port:
            secure_conf(self.run_dir / "redis", self.secrets.redis_password)
            plan.insert(0, Proc("redis", server_argv(self.redis_port, self.run_dir / "redis")))
        for p in plan:
            self._launch(p)
            self.procs.append(p)
            if p.name == "redis":
                wait_for_redis(with_credentials(self.cfg.redis.url, self.secrets), 60)
                # A resumed run's Redis holds the stop request that ended its last part.
                self.bus.r.delete(self.bus.k.control_stop, self.bus.k.control_shutdown)
        self._write_pids()

    def _write_pids(self) -> None:
        pids = {p.name: p.popen.pid for p in self.procs if p.popen}
        pids["launcher"] = os.getpid()
        write_atomic(self.run_dir / "pids.json", json.dumps(pids, indent=2))

    def stop(self) -> None:
        # Orchestrator first so nothing new is generated, then the workers, the trainer last
        # but one (it may be committing a step), Redis last.
        order = [
            "orchestrator",
            "prefill",
            "decode",
            "sandbox",
            "kvstore",
            "mooncake_master",
            "trainer",
            "redis",
        ]
        for prefix in order:
            group = [p for p in self.procs if p.name.startswith(prefix) and p.alive]
            for p in group:
                assert p.popen is not None
                os.killpg(p.popen.pid, signal.SIGTERM)
            for p in group:
                assert p.popen is not None
                try:
                    p.popen.wait(20 + self.cfg.slurm.supervisor.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait()

    # ------------------------------------------------------------ monitoring

    def _redis(self, what: str, fn: Callable[[], T]) -> T | None:
        """A Redis call the monitor can do without for a while (Redis restarting): None then."""
        try:
            return fn()
        except redis.RedisError as e:
            self.console.print(f"[yellow]redis unavailable ({what}): {e}; retrying[/]")
            return None

    def _metrics(self, seen: int = 0) -> Iterator[dict[str, Any] | None]:
        # Counted in lines, not bytes: a restarted orchestrator (`make restart`) rewrites the file.
        path = self.run_dir / "metrics.jsonl"
        size = -1
        while True:
            now = path.stat().st_size if path.exists() else -1
            if now != size:
                size = now
                for rec in read_metrics_after(path, seen):
                    seen += 1
                    yield rec
            yield None

    def _print_dashboard(self, wait_s: float = 60.0) -> None:
        """The dashboard's URL, once the orchestrator has registered (it picks its port)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and all(p.alive for p in self.procs) and not self._stop_requested:
            orch = self.bus.services("orchestrator")
            if orch:
                self.console.print(f"dashboard [cyan]{orch[0].url}/dashboard[/] (and `make status`)")
                return
            time.sleep(0.2)

    def _revive(self, p: Proc) -> bool:
        """The watchdog: a supervisor killed by a signal (not one that finished or gave up) is
        started again; it waits for the child its predecessor left before starting another."""
        code = p.popen.returncode if p.popen else None
        if code is None or code >= 0:
            return False
        self.revived[p.name] = self.revived.get(p.name, 0) + 1
        self.console.print(
            f"[yellow]supervisor of {p.name} was killed (signal {-code}): starting it again[/]"
        )
        self._launch(p)
        self._write_pids()
        return True

    def _disk_full(self) -> bool:
        state = self._redis("trainer state", lambda: self.bus.r.hget(self.bus.k.trainer_state, "status"))
        return state == "disk full" or shutil.disk_usage(self.run_dir).free < DISK_LOW_BYTES

    def monitor(self) -> int:
        """Print step lines until the trainer finishes; returns the exit code of the run."""
        clock = RunClock(self.bus, self.cfg.run.time_budget_s, self.cfg.run.timeout_s)
        stop_for = ""  # a stop request still to set (Redis was away when it was due)
        line = StepLine(self.cfg)
        # A resumed run goes on from the lines it already printed (the 10-step targets count them).
        history = read_metrics_after(self.run_dir / "metrics.jsonl", 0) if self.resume else []
        if history:
            self.console.print(f"resuming after step {history[-1]['step']}")
        self._print_dashboard()
        self.console.print(line.header())
        feed = self._metrics(len(history))
        for rec in feed:
            if rec is not None:
                history.append(rec)
                self.console.print(line.format(rec))
                if self.cfg.run.stop_on_targets and targets_met(history, self.cfg.orchestrator.tasks):
                    self.console.print("[green]all task targets met: stopping the trainer[/]")
                    self._redis("stop", lambda: self.bus.r.set(self.bus.k.control_stop, "targets met"))
                continue
            trainer = next(p for p in self.procs if p.name == "trainer")
            if not trainer.alive and not self._revive(trainer):
                # The orchestrator may still be writing the last steps' lines: drain them.
                last_step = int(
                    self._redis("trainer state", lambda: self.bus.r.hget(self.bus.k.trainer_state, "step"))
                    or 0
                )
                drain_until = time.monotonic() + 10.0
                for rec2 in feed:
                    if rec2 is not None:
                        history.append(rec2)
                        self.console.print(line.format(rec2))
                    elif (history and history[-1]["step"] >= last_step) or time.monotonic() > drain_until:
                        break
                    else:
                        time.sleep(0.1)
                code = trainer.popen.returncode if trainer.popen else 1
                if code != 0:
                    if code == FATAL_EXIT and self._disk_full():
                        self.console.print(
                            f"[red]disk full: the trainer cannot write to {self.run_dir} "
                            f"({shutil.disk_usage(self.run_dir).free >> 20} MiB free); free space, then "
                            f"`make resume RUN={self.run_dir}`[/]"
                        )
                    self.console.print(
                        f"[red]trainer exited with {code}: see {self.run_dir}/logs/trainer.log[/]"
                    )
                return code or 0
            dead = [p for p in self.procs if p.name != "trainer" and not p.alive and not self._revive(p)]
            if dead:
                names = ", ".join(f"{p.name} (exit {p.popen.returncode if p.popen else '?'})" for p in dead)
                self.console.print(f"[red]service died: {names}; logs in {self.run_dir}/logs[/]")
                return 1
            if self._stop_requested:
                return 130
            for event in clock.poll():
                self.console.print(event)
            if clock.budget_spent():
                self.console.print(
                    f"[yellow]time budget of {clock.budget_s:.0f}s spent: stopping the trainer[/]"
                )
                stop_for = "time budget"
            if stop_for and self._redis(
                "stop", lambda why=stop_for: self.bus.r.set(self.bus.k.control_stop, why)
            ):
                stop_for = ""
            if clock.timed_out():
                self.console.print(f"[red]run timed out after {clock.timeout_s:.0f}s[/]")
                return 124
            time.sleep(0.2)
        return 1

    def request_stop(self, *_: object) -> None:
        self._stop_requested = True


def run(cfg: RunConfig, resume: bool = False) -> int:
    console = Console(highlight=False)
    t0 = time.time()
    lr = LocalRun(cfg, console, resume=resume)
    verb = "resuming" if resume else "run"
    console.print(f"[bold]relay[/] {verb} [cyan]{cfg.run.name}[/] -> {lr.run_dir}")
    console.print(f"redis {lr.cfg.redis.url} (prefix {lr.cfg.redis.prefix}); logs in {lr.run_dir / 'logs'}")
    signal.signal(signal.SIGTERM, lr.request_stop)
    signal.signal(signal.SIGINT, lr.request_stop)
    code = 1
    try:
        lr.start()
        code = lr.monitor()
        summary = summarize(lr.cfg, lr.run_dir, lr.bus, time.time() - t0, code)
        summary["supervisors_restarted"] = lr.revived
        write_summary(lr.run_dir, summary, console)
        print_summary(console, summary)
    finally:
        lr.stop()
    return code
