"""`make launch|stop|status|restart|logs` entry point.

python -m sbatch.launch run debug --orchestrator.batch_size=64
python -m sbatch.launch run glm5 --dry-run          # print the het-job script and plan, submit nothing
python -m sbatch.launch run debug --slurm.launcher=slurm
python -m sbatch.launch status
python -m sbatch.launch stop
python -m sbatch.launch restart decode               # every decode replica; decode.1 for one
python -m sbatch.launch logs decode.0
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console

from sbatch.local import RUNS_DIR
from services.common.bus import Bus, connect
from services.common.config import ConfigError, RunConfig, load_config, load_resolved

console = Console(highlight=False)


def cmd_run(model: str, overrides: list[str], dry_run: bool = False) -> int:
    try:
        cfg = load_config(model, overrides)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        return 2
    if cfg.slurm.launcher == "slurm":
        from sbatch import slurm

        slurm.suppress_submitit_warnings()
        return slurm.dry_run(cfg, console) if dry_run else slurm.submit(cfg, console)
    if dry_run:
        return local_dry_run(cfg)
    from sbatch.local import run

    return run(cfg)


def local_dry_run(cfg: RunConfig) -> int:
    """The local executor's process plan, as it would start it."""
    from sbatch.local import LocalRun

    print(f"# relay dry run: {cfg.run.name}, launcher local; nothing started")
    print("# (use --slurm.launcher=slurm to render the het-job script instead)")
    for name, argv in LocalRun.describe(cfg):
        print(f"{name}: {' '.join(argv)}")
    return 0


def _latest() -> Path | None:
    """The run that status/stop/restart/logs act on: $RELAY_RUN_DIR (`make ... RUN=dir`), else runs/latest."""
    chosen = os.environ.get("RELAY_RUN_DIR")
    if chosen:
        return Path(chosen).resolve()
    latest = RUNS_DIR / "latest"
    return latest.resolve() if latest.exists() else None


def _run_bus(run_dir: Path) -> tuple[RunConfig, Bus] | None:
    cfg = load_resolved(run_dir / "config.json")
    if not cfg.redis.url:
        return None  # a Slurm run whose head has not started Redis yet
    return cfg, Bus(cfg.redis.url, cfg.redis.prefix)


def print_supervisors(bus: Bus) -> None:
    from sbatch.supervisor import read_states

    states = read_states(bus.r, bus.k.prefix)
    if not states:
        return
    console.print("services (supervisors):")
    now = time.time()
    for s in states:
        up = f"{now - s['child_started']:.0f}s" if s.get("child_started") and s["state"] == "running" else "-"
        last = "-" if s.get("last_exit") is None else str(s["last_exit"])
        pid = s.get("child_pid") or "-"
        console.print(
            f"  {s['name']:<13} {s['state']:<8} {s['host']}:{pid} up {up} restarts {s['restarts']} last exit {last}",
            soft_wrap=True,
        )


def cmd_status() -> int:
    run_dir = _latest()
    if run_dir is None:
        console.print("no run yet (runs/latest does not exist)")
        return 1
    from sbatch.slurm import job_states, slurm_info

    info = slurm_info(run_dir)
    if info is not None:
        states = job_states(str(info["job_id"]))
        console.print(
            f"slurm job {info['job_id']}: "
            + ("squeue did not answer" if states is None else "; ".join(states) or "no longer in the queue")
        )
    summary = run_dir / "summary.json"
    if summary.exists():
        console.print(f"run {run_dir.name} finished:")
        console.print_json(summary.read_text())
        return 0
    try:
        got = _run_bus(run_dir)
        if got is None:
            console.print(f"run {run_dir.name}: waiting for the job's head to start Redis")
            return 1
        _cfg, bus = got
        orch = bus.services("orchestrator")
    except Exception as e:  # noqa: BLE001 - report any connection failure plainly
        console.print(f"run {run_dir.name}: Redis unreachable ({e}); is the run still going?")
        return 1
    if not orch:
        console.print(f"run {run_dir.name}: no live orchestrator registered")
        for s in bus.services():
            console.print(f"  {s.kind:<12} {s.url:<28} v{s.version}")
        print_supervisors(bus)
        return 1
    try:
        status = httpx.get(f"{orch[0].url}/v1/status", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        # e.g. the orchestrator is restarting: still show what the registry and supervisors know
        console.print(f"run {run_dir.name}: orchestrator at {orch[0].url} did not answer ({e!r})")
        for s in bus.services():
            console.print(f"  {s.kind:<12} {s.url:<28} v{s.version}")
        print_supervisors(bus)
        return 1
    services = status.pop("services")
    console.print(f"run {run_dir.name} ({run_dir})")
    console.print_json(json.dumps(status))
    for s in services:
        console.print(
            f"  {s['kind']:<12} {s['url']:<28} host {s['host']:<12} pid {s['pid']:<8} v{s['version']}"
        )
    print_supervisors(bus)
    return 0


def cmd_stop() -> int:
    run_dir = _latest()
    if run_dir is not None and (run_dir / "slurm.json").exists():
        from sbatch.slurm import stop_job

        return stop_job(run_dir, console)
    pids_file = run_dir / "pids.json" if run_dir else None
    if not pids_file or not pids_file.exists():
        console.print("no running local run")
        return 0
    pids = json.loads(pids_file.read_text())
    launcher = pids.get("launcher")
    try:
        os.kill(int(launcher), signal.SIGTERM)
        console.print(f"asked launcher {launcher} to stop run {run_dir.name if run_dir else ''}")
        return 0
    except (ProcessLookupError, TypeError):
        pass
    # The launcher is gone: stop its children directly.
    for name, pid in pids.items():
        try:
            os.killpg(int(pid), signal.SIGTERM)
            console.print(f"stopped {name} ({pid})")
        except (ProcessLookupError, PermissionError):
            pass
    return 0


def cmd_restart(service: str) -> int:
    """Ask the supervisor(s) of SERVICE to restart it (graceful stop, immediate start)."""
    from sbatch.supervisor import request_restart

    if not service:
        console.print(
            "[red]name a service: make restart SERVICE=decode (or decode.1, orchestrator, trainer)[/]"
        )
        return 2
    run_dir = _latest()
    got = _run_bus(run_dir) if run_dir else None
    if got is None:
        console.print("no run with a live Redis (runs/latest)")
        return 1
    cfg, _bus = got
    try:
        names = request_restart(connect(cfg.redis.url), cfg.redis.prefix, service)
    except LookupError as e:
        console.print(f"[red]{e}[/]")
        return 1
    console.print(f"restart requested: {', '.join(names)} (their supervisors act within a second)")
    return 0


def cmd_logs(service: str, lines: int, follow: bool) -> int:
    """Tail one service's log (RUN_DIR/logs/<name>.log); `decode` means every decode replica,
    `slurm` the job's per-task logs (what each component task printed)."""
    from sbatch.supervisor import matches

    run_dir = _latest()
    if run_dir is None:
        console.print("no run yet (runs/latest does not exist)")
        return 1
    logs = sorted((run_dir / "logs").glob("*.log"))
    names = [p.stem for p in logs]
    if not service:
        console.print(f"logs of {run_dir.name}: {', '.join(names) or 'none yet'}")
        console.print("make logs SERVICE=<name>")
        return 0
    if service == "slurm":
        files = sorted((run_dir / "slurm").glob("*_log.out"))
    else:
        files = [p for p in logs if matches(p.stem, service)]
    if not files:
        console.print(f"[red]no log matches {service!r}; have: {', '.join(names) or 'none'}[/]")
        return 1
    argv = ["tail", "-n", str(lines), *(["-F"] if follow else []), *map(str, files)]
    sys.stdout.flush()
    os.execvp("tail", argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="relay", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a config: MODEL [--dry-run] [--section.key=value ...]")
    r.add_argument("model")
    r.add_argument(
        "--dry-run", action="store_true", help="print the plan (and het-job script); start nothing"
    )
    sub.add_parser("status")
    sub.add_parser("stop")
    rs = sub.add_parser("restart", help="restart one service: decode, decode.1, orchestrator, trainer ...")
    rs.add_argument("service", nargs="?", default="")
    lg = sub.add_parser("logs", help="tail a service's log")
    lg.add_argument("service", nargs="?", default="")
    lg.add_argument("-n", "--lines", type=int, default=50)
    lg.add_argument("--no-follow", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "run":
        return cmd_run(args.model, rest, args.dry_run)
    if rest:
        p.error(f"unexpected arguments {rest}")
    if args.cmd == "restart":
        return cmd_restart(args.service)
    if args.cmd == "logs":
        return cmd_logs(args.service, args.lines, not args.no_follow)
    return cmd_status() if args.cmd == "status" else cmd_stop()


if __name__ == "__main__":
    sys.exit(main())
