"""`make launch|stop|status|restart|logs` entry point.

python -m sbatch.launch run debug --orchestrator.batch_size=64
python -m sbatch.launch run glm5 --dry-run          # print the het-job script and plan, submit nothing
python -m sbatch.launch run debug --slurm.launcher=slurm
python -m sbatch.launch status
python -m sbatch.launch stop
python -m sbatch.launch restart decode               # every decode replica; decode.1 for one
python -m sbatch.launch logs decode.0
RELAY_RUN_DIR=runs/<dir> python -m sbatch.launch resume [--run.max_steps=800 ...]
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
from sbatch.status_view import print_running, print_services
from sbatch.summary import print_summary
from services.common.auth import load_run_secrets, with_credentials
from services.common.bus import Bus
from services.common.config import ConfigError, RunConfig, load_config, load_resolved
from services.common.health import health_rows

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


def cmd_resume(overrides: list[str]) -> int:
    """Continue a stopped run in its directory (`make resume RUN=<dir>`): its resolved config
    (with `overrides` on top), its Redis data (the launcher's Redis restarts on RUN_DIR/redis), its
    key prefix, ledger, checkpoints and weights. The trainer resumes from its newest checkpoint, the
    orchestrator re-issues the groups that were in flight and continues its task order, and step
    lines go on after the last printed one."""
    run_dir = _latest()
    if run_dir is None or not (run_dir / "config.json").exists():
        console.print(f"[red]no run to resume ({run_dir or 'runs/latest'}): make resume RUN=runs/<dir>[/]")
        return 2
    pids_file = run_dir / "pids.json"
    running = _run_processes(pids_file) if pids_file.exists() else {}
    if running:
        names = ", ".join(f"{n} {p}" for n, p in running.items())
        console.print(f"[red]run {run_dir.name} is still running ({names}): `make stop` it first[/]")
        return 2
    try:
        cfg = load_resolved(run_dir / "config.json", overrides)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        return 2
    # The resolved config holds the namespaced prefix and the URL of a Redis that is gone; the
    # launcher derives both again (the same prefix, and its own Redis on the run's data).
    redis = cfg.redis.model_copy(update={"prefix": cfg.redis.prefix.removesuffix(f":{run_dir.name}")})
    if cfg.slurm.launcher == "slurm":
        plan = json.loads((run_dir / "slurm" / "plan.json").read_text())
        redis.url = plan["redis_url"]
    elif (run_dir / "redis").is_dir():
        redis.url = ""
    cfg = cfg.model_copy(update={"redis": redis, "run": cfg.run.model_copy(update={"dir": str(run_dir)})})
    if cfg.slurm.launcher == "slurm":
        from sbatch import slurm

        slurm.suppress_submitit_warnings()
        return slurm.submit(cfg, console, resume=True)
    from sbatch.local import run

    return run(cfg, resume=True)


def local_dry_run(cfg: RunConfig) -> int:
    """The local executor's process plan, as it would start it."""
    from sbatch.local import LocalRun

    print(f"# relay dry run: {cfg.run.name}, launcher local; nothing started")
    print("# (use --slurm.launcher=slurm to render the het-job script instead)")
    for name, argv in LocalRun.describe(cfg):
        print(f"{name}: {' '.join(argv)}")
    par = cfg.decode.parallel
    if par.ranks > 1:
        print(
            f"# each decode.i is rank 0 of an engine of {par.ranks} ranks (tp {par.tp}, dp_attention"
            f" {par.dp_attention}, ep {par.ep}, one per GPU; CPU: gloo) and starts ranks 1-{par.ranks - 1}"
            " as its children: python -m services.engine.parallel.worker --config <config.json> --role decode"
            " --rank <r> --init tcp://127.0.0.1:<port>"
        )
    return 0


def _latest() -> Path | None:
    """The run that status/stop/restart/logs act on: $RELAY_RUN_DIR (`make ... RUN=dir`), else runs/latest."""
    chosen = os.environ.get("RELAY_RUN_DIR")
    if chosen:
        return Path(chosen).resolve()
    latest = RUNS_DIR / "latest"
    return latest.resolve() if latest.exists() else None


def run_redis_url(run_dir: Path, cfg: RunConfig) -> str:
    """The run's Redis URL with its credentials (RUN_DIR/secrets.json), for this process only."""
    return with_credentials(cfg.redis.url, load_run_secrets(run_dir))


def _run_bus(run_dir: Path) -> tuple[RunConfig, Bus] | None:
    cfg = load_resolved(run_dir / "config.json")
    if not cfg.redis.url:
        return None  # a Slurm run whose head has not started Redis yet
    return cfg, Bus(run_redis_url(run_dir, cfg), cfg.redis.prefix)


def _print_registry(bus: Bus) -> None:
    """What the registry and supervisors know when the orchestrator cannot answer."""
    print_services(console, health_rows(bus.services(), bus.supervisors()))


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
        console.print(f"run [cyan]{run_dir.name}[/] finished ({run_dir})")
        print_summary(console, json.loads(summary.read_text()))
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
        _print_registry(bus)
        return 1
    try:
        status = httpx.get(f"{orch[0].url}/v1/status", timeout=10).json()
    except (httpx.HTTPError, ValueError) as e:
        # e.g. the orchestrator is restarting: still show what the registry and supervisors know
        console.print(f"run {run_dir.name}: orchestrator at {orch[0].url} did not answer ({e!r})")
        _print_registry(bus)
        return 1
    print_running(console, run_dir.name, status, f"{orch[0].url}/dashboard", status["health"])
    return 0


def _started_at(pid: int) -> float | None:
    """A live process's start time (Unix seconds), None when there is no such process (or only
    its zombie). Without /proc (not Linux) any live pid counts as started at 0."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, someone else's
    if not Path("/proc/stat").exists():
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the name
    except OSError:
        return None  # gone since the signal check
    if fields[0] in ("Z", "X"):
        return None  # exited, not yet reaped by its parent
    boot = next(
        float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime")
    )
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks


def _run_processes(pids_file: Path) -> dict[str, int]:
    """The run's processes (name -> pid) still alive. The launcher writes pids.json once all of
    them have started, so a pid whose process started after the file (by more than the clock's
    tick) was reused by an unrelated process and is left alone."""
    written = pids_file.stat().st_mtime
    alive = {}
    for name, pid in json.loads(pids_file.read_text()).items():
        started = _started_at(int(pid))
        if started is not None and started <= written + 1.0:
            alive[name] = int(pid)
    return alive


def cmd_stop() -> int:
    run_dir = _latest()
    if run_dir is None:
        console.print("no run yet (runs/latest does not exist): nothing to stop")
        return 0
    if (run_dir / "slurm.json").exists():
        from sbatch.slurm import stop_job

        return stop_job(run_dir, console)
    pids_file = run_dir / "pids.json"
    alive = _run_processes(pids_file) if pids_file.exists() else {}
    if not alive:
        summary = run_dir / "summary.json"
        how = ""
        if summary.exists():
            s = json.loads(summary.read_text())
            how = f" (it ended: {s['status']}, {s['steps']} steps)"
        console.print(f"run {run_dir.name} is not running{how}: nothing to stop")
        return 0
    launcher = alive.pop("launcher", None)
    names = ", ".join(alive) or "no services"
    if launcher is not None:
        # The launcher stops the services in order and writes the summary; wait for it.
        os.kill(launcher, signal.SIGTERM)
        console.print(f"stopping run {run_dir.name} (launcher {launcher}; {names}) ...")
        deadline = time.monotonic() + 120
        while _started_at(launcher) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if _started_at(launcher) is None:
            console.print(f"stopped run {run_dir.name}: {names}")
            return 0
        console.print(f"[red]launcher {launcher} is still stopping after 120 s: see {run_dir}/logs[/]")
        return 1
    # The launcher is gone: stop its children directly (each a supervisor in its own group).
    for name, pid in alive.items():
        try:
            os.killpg(pid, signal.SIGTERM)
            console.print(f"stopped {name} ({pid})")
        except (ProcessLookupError, PermissionError) as e:
            console.print(f"{name} ({pid}): {e}")
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
    cfg, bus = got
    try:
        names = request_restart(bus.r, cfg.redis.prefix, service)
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
    sub.add_parser(
        "resume", help="continue a stopped run (RELAY_RUN_DIR or runs/latest) [--section.key=value ...]"
    )
    rs = sub.add_parser("restart", help="restart one service: decode, decode.1, orchestrator, trainer ...")
    rs.add_argument("service", nargs="?", default="")
    lg = sub.add_parser("logs", help="tail a service's log")
    lg.add_argument("service", nargs="?", default="")
    lg.add_argument("-n", "--lines", type=int, default=50)
    lg.add_argument("--no-follow", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "run":
        return cmd_run(args.model, rest, args.dry_run)
    if args.cmd == "resume":
        return cmd_resume(rest)
    if rest:
        p.error(f"unexpected arguments {rest}")
    if args.cmd == "restart":
        return cmd_restart(args.service)
    if args.cmd == "logs":
        return cmd_logs(args.service, args.lines, not args.no_follow)
    return cmd_status() if args.cmd == "status" else cmd_stop()


if __name__ == "__main__":
    sys.exit(main())
