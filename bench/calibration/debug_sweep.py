"""Does `make launch MODEL=debug` meet its targets every time? Seeds of the real pipeline, on this
machine, under load (two runs at once) and on dedicated cores (one run at a time), each launched
as a user would (`python -m sbatch.launch run debug --run.seed=N`), with its own Redis.

    python -m bench.calibration.debug_sweep --seeds 0-9 --mode both \\
        --out bench/calibration/results/debug_sweep.json

The result file records the command, machine, date and commit, and per mode every seed's steps
and seconds to each task's target (and to both: the run stops there), then the median, min, max
and interquartile range over the seeds, and how many met both targets inside the budget. It is
rewritten after every run, so an interrupted sweep keeps what it measured. Under load, the two
runs of a pair start together; each run's time is its own (launch to the step where both targets
were met), counted from the launcher's start, install excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.results import write_result
from sbatch.local import targets_met
from services.common.config import REPO_ROOT, TaskSpec, load_config


def seeds_arg(text: str) -> list[int]:
    """'0-9' or '0,3,5' or '0-4,8'."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def hits(hist: list[dict[str, Any]], tasks: list[TaskSpec]) -> dict[str, Any]:
    """First step (and its wall-clock time) at which each task's 10-step mean reached its target
    (as the run summary counts it), and the first at which the launcher's stop_on_targets rule
    held for all tasks at once (where a run with that rule stops)."""
    first: dict[str, dict[str, float] | None] = {t.env: None for t in tasks}
    series: dict[str, list[float]] = {t.env: [] for t in tasks}
    both = None
    for i, rec in enumerate(hist):
        for t in tasks:
            if t.env in rec.get("reward_by_env", {}):
                series[t.env].append(rec["reward_by_env"][t.env])
                vals = series[t.env][-10:]
                if first[t.env] is None and len(vals) == 10 and sum(vals) / 10 >= t.target:
                    first[t.env] = {"step": rec["step"], "time": rec["time"]}
        if both is None and targets_met(hist[: i + 1], tasks):
            both = {"step": rec["step"], "time": rec["time"]}
    return {"tasks": first, "both": both}


def machine() -> dict[str, Any]:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return {
        "host": platform.node(),
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True, text=True)
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def launch(seed: int, work: Path, overrides: list[str]) -> tuple[subprocess.Popen[bytes], Path, float]:
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / f"seed{seed}"
    cmd = [
        sys.executable,
        "-m",
        "sbatch.launch",
        "run",
        "debug",
        f"--run.dir={run_dir}",
        f"--run.seed={seed}",
    ]
    log = (work / f"seed{seed}.log").open("wb")
    t0 = time.time()
    proc = subprocess.Popen([*cmd, *overrides], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc, run_dir, t0


def result(
    seed: int, proc: subprocess.Popen[bytes], run_dir: Path, t0: float, tasks: list[TaskSpec]
) -> dict[str, Any]:
    code = proc.wait()
    wall = time.time() - t0
    metrics = run_dir / "metrics.jsonl"
    hist = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    got = hits(hist, tasks)
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    )

    def since_start(hit: dict[str, float] | None) -> dict[str, float] | None:
        return None if hit is None else {"step": hit["step"], "s": round(hit["time"] - t0, 1)}

    return {
        "seed": seed,
        "exit": code,
        "status": summary.get("status"),
        "steps": hist[-1]["step"] if hist else 0,
        "wall_s": round(wall, 1),
        "met_both": got["both"] is not None,
        "to_both": since_start(got["both"]),
        "to_target": {t: since_start(h) for t, h in got["tasks"].items()},
        "last10": {t: e["last10"] for t, e in summary.get("tasks", {}).items()},
        "entropy_last": hist[-1]["entropy"] if hist else None,
        "staleness_mean": summary.get("staleness_mean"),
        "dropped": summary.get("ledger", {}).get("dropped"),
        "run_dir": str(run_dir),
    }


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "q1": q[0],
        "q3": q[2],
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    hit = [r for r in runs if r["met_both"]]
    return {
        "runs": len(runs),
        "met_both": len(hit),
        "steps_to_both": spread([r["to_both"]["step"] for r in hit]),
        "seconds_to_both": spread([r["to_both"]["s"] for r in hit]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=seeds_arg, default=seeds_arg("0-9"))
    ap.add_argument("--mode", choices=["load", "dedicated", "both"], default="both")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=None, help="run directories (default: a temp dir)")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (after --)")
    args = ap.parse_args()
    cfg = load_config("debug", args.overrides)
    tasks = cfg.orchestrator.tasks
    targets = {t.env: t.target for t in tasks}
    work = args.work or Path(tempfile.mkdtemp(prefix="debug_sweep_"))
    work.mkdir(parents=True, exist_ok=True)
    modes = ["load", "dedicated"] if args.mode == "both" else [args.mode]
    doc: dict[str, Any] = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], "-m", "bench.calibration.debug_sweep", *sys.argv[1:]]),
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "config": {"base": "configs/debug.toml", "overrides": args.overrides, "targets": targets,
                   "time_budget_s": cfg.run.time_budget_s, "max_steps": cfg.run.max_steps},
        "modes": {"load": "two runs at once (a pair per two seeds)", "dedicated": "one run at a time"},
        "baseline": "the dedicated-core runs are the baseline of the loaded ones (same seeds, same commit, this process)",
        "results": {},
    }  # fmt: skip
    for mode in modes:
        doc["results"][mode] = {"runs": [], "summary": None}
        width = 2 if mode == "load" else 1
        seeds = list(args.seeds)
        while seeds:
            batch, seeds = seeds[:width], seeds[width:]
            started = [(s, *launch(s, work / mode, args.overrides)) for s in batch]
            load0 = os.getloadavg()[0]
            for s, proc, run_dir, t0 in started:
                r = result(s, proc, run_dir, t0, tasks)
                r["load_at_start"] = round(load0, 2)
                doc["results"][mode]["runs"].append(r)
                print(
                    f"{mode} seed {s}: {json.dumps({k: r[k] for k in ('met_both', 'to_both', 'wall_s', 'status')})}",
                    flush=True,
                )
            doc["results"][mode]["summary"] = aggregate(doc["results"][mode]["runs"])
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_result(args.out, doc)
    for mode in modes:
        print(mode, json.dumps(doc["results"][mode]["summary"]))


if __name__ == "__main__":
    main()
