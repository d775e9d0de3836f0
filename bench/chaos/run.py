"""Chaos: the debug pipeline with a random service killed (-9) every 20-40 s, against the same run
without faults, in one process.

    python -m bench.chaos.run --minutes 10 --steps 450 --kv --out bench/chaos/results/chaos_cpu.json

1. baseline: `sbatch.launch run debug` for --steps steps (no early stop, no time budget), timed;
2. chaos: the same run; during its first --minutes, every 20-40 s (--interval) one service
   chosen at random among decode, sandbox, orchestrator, trainer, Redis and (with --kv) the KV
   store gateway and a prefill service is killed with SIGKILL (its child process, found through
   RUN_DIR/pids/<name>.pid: its supervisor restarts it); then the run finishes on its own.
3. the result file counts faults injected (by service), rollouts lost and trained twice (the run's
   ledger), weight versions out of order (weights:latest polled during the run, and the metrics'
   step numbers), checkpoints and weight directories that do not load, and the chaos run's
   wall-clock time against the baseline's (slowdown).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import torch

from bench.machine import machine
from bench.results import dumps, write_result
from services.common.auth import AuthError, load_run_secrets, with_credentials
from services.common.bus import Bus
from services.common.config import REPO_ROOT, load_resolved
from services.common.weights_dir import read_model_dir

SERVICES = ["decode.0", "sandbox.0", "orchestrator", "trainer", "redis"]
KV_SERVICES = ["kvstore", "prefill.0"]


def run_args(run_dir: Path, steps: int, kv: bool, extra: list[str]) -> list[str]:
    args = [
        sys.executable, "-m", "sbatch.launch", "run", "debug", f"--run.dir={run_dir}",
        f"--run.max_steps={steps}", "--run.stop_on_targets=false", "--run.time_budget_s=1000000",
        "--run.timeout_s=1000000",
    ]  # fmt: skip
    if kv:
        args += ["--kvstore.enabled=true", "--prefill.replicas=1"]
    return args + extra


@dataclass
class Watch:
    """weights:latest as seen during the run: every change, and how often it went back."""

    run_dir: Path
    seen: list[int] = field(default_factory=list)
    went_back: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        bus: Bus | None = None
        while not self.stop.is_set():
            try:
                if bus is None:
                    cfg = load_resolved(self.run_dir / "config.json")
                    url = with_credentials(cfg.redis.url, load_run_secrets(self.run_dir))
                    bus = Bus(url, cfg.redis.prefix)
                info = bus.latest_weights()
                if info is not None and (not self.seen or info.version != self.seen[-1]):
                    if self.seen and info.version < max(self.seen):
                        self.went_back += 1
                    self.seen.append(info.version)
            except (OSError, ValueError, AuthError, redis.RedisError):
                pass  # no config or secrets yet, or Redis restarting (one of the faults)
            self.stop.wait(0.2)


@dataclass
class Faults:
    run_dir: Path
    services: list[str]
    minutes: float
    interval: tuple[float, float]
    rng: random.Random
    injected: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, t0: float) -> None:
        end = t0 + self.minutes * 60
        while not self.stop.wait(self.rng.uniform(*self.interval)):
            now = time.monotonic()
            if now > end:
                return
            name = self.rng.choice(self.services)
            try:
                pid = int((self.run_dir / "pids" / f"{name}.pid").read_text())
                os.kill(pid, signal.SIGKILL)
                self.injected.append({"t_s": round(now - t0, 1), "service": name, "pid": pid})
                print(f"[chaos] {now - t0:6.1f}s kill -9 {name} ({pid})", flush=True)
            except (OSError, ValueError) as e:  # between a kill and its restart: no child yet
                print(f"[chaos] {now - t0:6.1f}s {name}: no live child ({e})", flush=True)


def load_during(stop: threading.Event, out: list[float], every_s: float = 30.0) -> None:
    """The 1-minute load average every `every_s` while a run goes: on a shared machine it says
    how much of the wall-clock time (and so of the slowdown) other work took."""
    while True:
        out.append(os.getloadavg()[0])
        if stop.wait(every_s):
            return


def timed_run(args: list[str], log: Path, run_dir: Path, faults: Faults | None) -> dict[str, Any]:
    watch = Watch(run_dir)
    threading.Thread(target=watch.run, daemon=True).start()
    load: list[float] = []
    threading.Thread(target=load_during, args=(watch.stop, load), daemon=True).start()
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    injector = None
    if faults is not None:
        injector = threading.Thread(target=faults.run, args=(t0,), daemon=True)
        injector.start()
    code = proc.wait()
    wall = time.monotonic() - t0
    if faults is not None:
        faults.stop.set()
    watch.stop.set()
    return {"exit": code, "wall_s": round(wall, 1), "watch": watch, "load": load}


def unreadable(run_dir: Path) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {"checkpoints": [], "weights": []}
    for p in sorted((run_dir / "checkpoints").glob("step_*")):
        try:
            torch.load(p / "state.pt", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure to load counts
            bad["checkpoints"].append(f"{p.name}: {type(e).__name__}")
    for p in sorted((run_dir / "weights").glob("step_*")):
        try:
            read_model_dir(p)
        except Exception as e:  # noqa: BLE001
            bad["weights"].append(f"{p.name}: {type(e).__name__}")
    return bad


def report(run_dir: Path, res: dict[str, Any]) -> dict[str, Any]:
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )
    hist = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [h["step"] for h in hist]
    watch: Watch = res["watch"]
    bad = unreadable(run_dir)
    led = summary.get("ledger", {})
    return {
        "exit": res["exit"],
        "status": summary.get("status"),
        "wall_s": res["wall_s"],
        "steps": steps[-1] if steps else 0,
        "ledger": led,
        "rollouts_lost": led.get("lost"),
        "trained_twice": led.get("trained_twice"),
        "versions_out_of_order": watch.went_back
        + sum(1 for a, b in zip(steps, steps[1:], strict=False) if b <= a),
        "versions_published_seen": len(watch.seen),
        "checkpoints_unreadable": len(bad["checkpoints"]),
        "weights_unreadable": len(bad["weights"]),
        "unreadable": bad,
        "stale_dropped": sum(h["dropped_stale"] for h in hist),
        "supervisors_restarted": summary.get("supervisors_restarted", {}),
        "load_avg_1m_during": {
            "samples": len(res["load"]),
            "min": min(res["load"], default=None),
            "median": statistics.median(res["load"]) if res["load"] else None,
            "max": max(res["load"], default=None),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    p.add_argument("--interval", type=float, nargs=2, default=(20.0, 40.0), help="seconds between faults")
    p.add_argument("--steps", type=int, default=450, help="run.max_steps of both runs")
    p.add_argument("--kv", action="store_true", help="with the KV store gateway and a prefill service")
    p.add_argument("--seed", type=int, default=0, help="of the fault schedule")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without faults")
    p.add_argument("--workdir", default="", help="where the runs go (default: a temporary directory)")
    p.add_argument("--out", default="", help="the result file (default: print only)")
    p.add_argument("extra", nargs="*", help="more dotted overrides for both runs (--a.b=c)")
    args, extra = p.parse_known_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="relay-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    overrides = [*args.extra, *extra]
    services = SERVICES + (KV_SERVICES if args.kv else [])
    out: dict[str, Any] = {
        "command": " ".join(
            [sys.executable, "-m", "bench.chaos.run", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_avg_before": os.getloadavg(),
        "config": {"model": "debug", "steps": args.steps, "kv": args.kv, "overrides": overrides},
        "faults_window_min": args.minutes,
        "fault_interval_s": list(args.interval),
        "services": services,
    }
    if not args.no_baseline:
        base_dir = work / "baseline"
        res = timed_run(
            run_args(base_dir, args.steps, args.kv, overrides), work / "baseline.log", base_dir, None
        )
        out["baseline"] = report(base_dir, res)
        print(f"[chaos] baseline: {out['baseline']['steps']} steps in {res['wall_s']}s", flush=True)
    chaos_dir = work / "chaos"
    faults = Faults(chaos_dir, services, args.minutes, tuple(args.interval), random.Random(args.seed))  # type: ignore[arg-type]
    res = timed_run(
        run_args(chaos_dir, args.steps, args.kv, overrides), work / "chaos.log", chaos_dir, faults
    )
    chaos = report(chaos_dir, res)
    chaos["faults_injected"] = len(faults.injected)
    chaos["faults_by_service"] = {s: sum(f["service"] == s for f in faults.injected) for s in services}
    chaos["faults"] = faults.injected
    out["chaos"] = chaos
    if "baseline" in out and out["baseline"]["wall_s"]:
        out["slowdown"] = round(chaos["wall_s"] / out["baseline"]["wall_s"], 3)
    out["workdir"] = str(work)
    print(dumps(out), end="")
    if args.out:
        write_result(args.out, out)
    ok = chaos["exit"] == 0 and not chaos["rollouts_lost"] and not chaos["trained_twice"]
    ok = ok and not chaos["versions_out_of_order"] and not chaos["checkpoints_unreadable"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
