"""`make launch|stop|status` entry point.

python -m sbatch.launch run debug --orchestrator.batch_size=64
python -m sbatch.launch status
python -m sbatch.launch stop
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import httpx
from rich.console import Console

from sbatch.local import RUNS_DIR
from services.common.bus import Bus
from services.common.config import ConfigError, load_config, load_resolved

console = Console(highlight=False)


def cmd_run(model: str, overrides: list[str]) -> int:
    try:
        cfg = load_config(model, overrides)
    except ConfigError as e:
        console.print(f"[red]{e}[/]")
        return 2
    from sbatch.local import run

    return run(cfg)


def _latest() -> Path | None:
    latest = RUNS_DIR / "latest"
    return latest.resolve() if latest.exists() else None


def cmd_status() -> int:
    run_dir = _latest()
    if run_dir is None:
        console.print("no run yet (runs/latest does not exist)")
        return 1
    summary = run_dir / "summary.json"
    if summary.exists():
        console.print(f"run {run_dir.name} finished:")
        console.print_json(summary.read_text())
        return 0
    cfg = load_resolved(run_dir / "config.json")
    try:
        bus = Bus(cfg.redis.url, cfg.redis.prefix)
        orch = bus.services("orchestrator")
    except Exception as e:  # noqa: BLE001 - report any connection failure plainly
        console.print(
            f"run {run_dir.name}: Redis at {cfg.redis.url} unreachable ({e}); is the run still going?"
        )
        return 1
    if not orch:
        console.print(f"run {run_dir.name}: no live orchestrator registered")
        for s in bus.services():
            console.print(f"  {s.kind:<12} {s.url:<28} v{s.version}")
        return 1
    status = httpx.get(f"{orch[0].url}/v1/status", timeout=10).json()
    services = status.pop("services")
    console.print(f"run {run_dir.name} ({run_dir})")
    console.print_json(json.dumps(status))
    for s in services:
        console.print(
            f"  {s['kind']:<12} {s['url']:<28} host {s['host']:<12} pid {s['pid']:<8} v{s['version']}"
        )
    return 0


def cmd_stop() -> int:
    run_dir = _latest()
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="relay", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a config locally: MODEL [--section.key=value ...]")
    r.add_argument("model")
    sub.add_parser("status")
    sub.add_parser("stop")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "run":
        return cmd_run(args.model, rest)
    if rest:
        p.error(f"unexpected arguments {rest}")
    return cmd_status() if args.cmd == "status" else cmd_stop()


if __name__ == "__main__":
    sys.exit(main())
