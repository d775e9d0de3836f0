"""Where a debug run's CPU goes: CPU-seconds per trainer step of each service process, sampled
from /proc over a window of a run in progress (Linux).

    python -m bench.calibration.cpu_share --code DIR_A --code DIR_B --seconds 90 --out cpu.json

For each code tree (a checkout: the baseline first), starts `python -m sbatch.launch run debug`
from it, waits `--warmup` seconds past the first step, then reads every service's CPU time
(utime + stime) and the step count at the start and end of the window, and stops the run. The
trees run one after the other on the same machine, so the load beside them is the same kind, not
the same: the record keeps the load average of each window.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for bench.results
from bench.results import write_result  # noqa: E402

SERVICES = ("trainer", "services.decode", "services.sandbox", "services.orchestrator")


def cpu_seconds(run_dir: Path) -> dict[str, float]:
    """CPU time of each service process of the run (matched by its command line)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        args = [c.decode(errors="replace") for c in cmd]
        if not any(str(run_dir) in a for a in args) or "sbatch.supervisor" in args:
            continue
        name = next((s for s in SERVICES if s in args), None)
        if name is not None:
            out[name.removeprefix("services.")] = (int(stat[11]) + int(stat[12])) / tick
    return out


def steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def measure(code: Path, work: Path, warmup_s: float, window_s: float) -> dict[str, Any]:
    run_dir = work / code.name
    env = {**os.environ, "PYTHONPATH": str(code)}
    cmd = [sys.executable, "-m", "sbatch.launch", "run", "debug", f"--run.dir={run_dir}",
           "--run.max_steps=10000", "--run.stop_on_targets=false", "--run.time_budget_s=3000", "--run.timeout_s=3600"]  # fmt: skip
    with (work / f"{code.name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while steps(run_dir) < 1:
            if proc.poll() is not None:
                raise RuntimeError(f"{code}: the run ended before its first step; see {work}")
            time.sleep(1)
        time.sleep(warmup_s)
        s0, c0, t0 = steps(run_dir), cpu_seconds(run_dir), time.time()
        time.sleep(window_s)
        s1, c1, t1 = steps(run_dir), cpu_seconds(run_dir), time.time()
        load = os.getloadavg()[0]
    finally:
        subprocess.run([sys.executable, "-m", "sbatch.launch", "stop"], cwd=code, env={**env, "RELAY_RUN_DIR": str(run_dir)}, capture_output=True)  # fmt: skip
        proc.wait(300)
    n = max(1, s1 - s0)
    per_step = {k: round((c1[k] - c0.get(k, 0.0)) / n, 3) for k in c1}
    return {
        "code": str(code),
        "steps": [s0, s1],
        "window_s": round(t1 - t0, 1),
        "steps_per_s": round((s1 - s0) / (t1 - t0), 3),
        "cpu_s_per_step": per_step,
        "cpu_s_per_step_total": round(sum(per_step.values()), 3),
        "load_avg_1min_at_end": round(load, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--code", type=Path, action="append", required=True, help="a checkout; the first is the baseline"
    )
    ap.add_argument(
        "--warmup", type=float, default=20.0, help="seconds after the first step before the window"
    )
    ap.add_argument("--seconds", type=float, default=90.0, help="the window")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cpu_share_"))
    results = [measure(c.resolve(), work, args.warmup, args.seconds) for c in args.code]
    doc = {
        "command": " ".join(["python -m bench.calibration.cpu_share", *sys.argv[1:]]),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "baseline": f"the first --code ({args.code[0]}), measured in this process before the others",
        "results": results,
    }
    write_result(args.out, doc)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
