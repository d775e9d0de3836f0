"""The local executor: the whole pipeline as separate processes on one machine (no Slurm).

Creates the run's secrets (RUN_DIR/secrets.json, services/common/auth.py), starts Redis with
their password (unless the run names one), then sandbox, decode, trainer and orchestrator, each
its own process logging to RUN_DIR/logs/<name>.log, the secrets in its environment; prints one
line per trainer step from RUN_DIR/metrics.jsonl and a summary at the end (RUN_DIR/summary.json).
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

from sbatch.budget import RunClock
from sbatch.summary import StepLine, print_summary, summarize
from sbatch.supervisor import RestartPolicy, supervisor_argv
from services.common.auth import child_env, ensure_run_secrets, with_credentials
from services.common.bus import Bus, run_prefix
from services.common.config import REPO_ROOT, RunConfig
from services.common.redis_server import RedisServer
from services.kvstore.launch import ensure_installed, kv_plan, resolve_ports
from trainer.launch import trainer_command

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
    # runs/latest follows runs made under runs/ only: a run placed elsewhere (tests, --run.dir)
    # must not take `make status/stop` away from the user's own run.
    if run_dir.parent == RUNS_DIR:
        latest = RUNS_DIR / "latest"
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(run_dir)
    return run_dir


def read_metrics_after(path: Path, seen: int) -> list[dict[str, Any]]:
    """Records of metrics.jsonl after its first `seen` lines. Re-read whole and counted in lines:
    a restarted orchestrator rewrites the file (lines may change length), so a byte offset kept
    across that would land mid-line. A line still being written ends the read."""
    try:
        lines = path.read_text().split("\n")[:-1]  # the last element is "" or a partial line
    except FileNotFoundError:
        return []
    out = []
    for raw in lines[seen:]:
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            break
    return out


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


def process_plan(cfg: RunConfig, run_dir: Path, config_path: Path, url: str) -> list[Proc]:
    plan = [
        Proc(f"sandbox.{i}", service_argv("services.sandbox", config_path, url, i))
        for i in range(cfg.sandbox.replicas)
    ]
    # KV store side (when kvstore.enabled): Mooncake master, the gateway, prefill services.
    plan += [Proc(name, service_argv(module, config_path, url, i)) for name, module, i in kv_plan(cfg)]
    plan += [
        Proc(f"decode.{i}", service_argv("services.decode", config_path, url, i))
        for i in range(cfg.decode.replicas)
    ]
    plan.append(Proc("trainer", trainer_command(cfg, run_dir, url)))
    plan.append(Proc("orchestrator", service_argv("services.orchestrator", config_path, url)))
    return plan


class LocalRun:
    def __init__(self, cfg: RunConfig, console: Console | None = None):
        self.console = console or Console(highlight=False)
        self.run_dir = make_run_dir(cfg)
        self.redis: RedisServer | None = None
        redis_url = cfg.redis.url or os.environ.get("REDIS_URL", "")
        # The run token, and Redis credentials kept out of config.json and every command line.
        self.secrets, redis_url = ensure_run_secrets(self.run_dir, redis_url)
        if not redis_url:
            self.redis = RedisServer(self.run_dir / "redis", password=self.secrets.redis_password).start()
            redis_url = self.redis.url
        # Namespacing by run keeps several runs (or a re-run) on one Redis apart.
        prefix = run_prefix(cfg.redis.prefix, self.run_dir.name)
        self.cfg = resolve_ports(cfg).model_copy(
            update={"redis": cfg.redis.model_copy(update={"url": redis_url, "prefix": prefix})}
        )
        self.config_path = self.run_dir / "config.json"
        self.config_path.write_text(self.cfg.dump())
        self.bus = Bus(with_credentials(redis_url, self.secrets), prefix)
        self.procs: list[Proc] = []
        self._stop_requested = False

    # ------------------------------------------------------------ processes

    def _plan(self) -> list[Proc]:
        return process_plan(self.cfg, self.run_dir, self.config_path, self.cfg.redis.url)

    @staticmethod
    def describe(cfg: RunConfig) -> list[tuple[str, list[str]]]:
        """The process plan with placeholder paths (dry run): what start() would run, unsupervised."""
        run_dir = RUNS_DIR / f"{cfg.run.name}-<stamp>"
        url = cfg.redis.url or "redis://127.0.0.1:<port>/0"
        return [(p.name, p.argv) for p in process_plan(cfg, run_dir, run_dir / "config.json", url)]

    def start(self) -> None:
        ensure_installed(self.cfg)  # the Mooncake extra, when the run uses that tier
        env = {
            **child_env(os.environ, self.secrets),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "REDIS_URL": self.cfg.redis.url,
        }
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        sp = self.cfg.slurm.supervisor
        policy = RestartPolicy(
            sp.max_restarts, sp.backoff_s, sp.backoff_max_s, sp.reset_after_s, sp.stop_timeout_s
        )
        for p in self._plan():
            log = open(self.run_dir / "logs" / f"{p.name}.log", "ab")  # noqa: SIM115 - owned by the child
            # Each service runs under a supervisor (restarts on failure, `make restart`); the pid
            # below is the supervisor's, and it exits only when the service is done or given up.
            argv = supervisor_argv(p.name, p.argv, policy, self.cfg.redis.url, self.cfg.redis.prefix)
            p.popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True
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
        order = ["orchestrator", "prefill", "decode", "sandbox", "kvstore", "mooncake_master", "trainer"]
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
        # Counted in lines, not bytes: a restarted orchestrator (`make restart`) rewrites the file.
        path = self.run_dir / "metrics.jsonl"
        seen, size = 0, -1
        while True:
            now = path.stat().st_size if path.exists() else -1
            if now != size:
                size = now
                for rec in read_metrics_after(path, seen):
                    seen += 1
                    yield rec
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

    def _print_dashboard(self, wait_s: float = 60.0) -> None:
        """The dashboard's URL, once the orchestrator has registered (it picks its port)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and all(p.alive for p in self.procs) and not self._stop_requested:
            orch = self.bus.services("orchestrator")
            if orch:
                self.console.print(f"dashboard [cyan]{orch[0].url}/dashboard[/] (and `make status`)")
                return
            time.sleep(0.2)

    def monitor(self) -> int:
        """Print step lines until the trainer finishes; returns the exit code of the run."""
        clock = RunClock(self.bus, self.cfg.run.time_budget_s, self.cfg.run.timeout_s)
        history: list[dict[str, Any]] = []
        line = StepLine(self.cfg)
        self._print_dashboard()
        self.console.print(line.header())
        feed = self._metrics()
        for rec in feed:
            if rec is not None:
                history.append(rec)
                self.console.print(line.format(rec))
                if self.cfg.run.stop_on_targets and self._targets_met(history):
                    self.console.print("[green]all task targets met: stopping the trainer[/]")
                    self.bus.r.set(self.bus.k.control_stop, "targets met")
                continue
            trainer = next(p for p in self.procs if p.name == "trainer")
            if not trainer.alive:
                # The orchestrator may still be writing the last steps' lines: drain them.
                last_step = int(self.bus.r.hget(self.bus.k.trainer_state, "step") or 0)
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
            for event in clock.poll():
                self.console.print(event)
            if clock.budget_spent():
                self.console.print(
                    f"[yellow]time budget of {clock.budget_s:.0f}s spent: stopping the trainer[/]"
                )
                self.bus.r.set(self.bus.k.control_stop, "time budget")
            if clock.timed_out():
                self.console.print(f"[red]run timed out after {clock.timeout_s:.0f}s[/]")
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
        print_summary(console, summary)
    finally:
        lr.stop()
    return code
