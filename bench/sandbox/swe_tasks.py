"""What a built swe-real task set holds: tasks per project and per mutation kind, failing tests
per task, the suite runs the build cost, and a digest of the task file (the same seed must give
the same digest on any machine). Run after `make tasks`:

    python -m bench.sandbox.swe_tasks --elapsed-s 2693 --out bench/sandbox/swe_tasks.json

`--elapsed-s` is the build's own last line ("... in N s"); the rest comes from the cache files."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bench.machine import machine
from bench.results import write_result


def summarise(tasks_file: Path, verified_file: Path) -> dict[str, Any]:
    tasks = [json.loads(x) for x in tasks_file.read_text().splitlines() if x.strip()]
    runs = [json.loads(x) for x in verified_file.read_text().splitlines() if x.strip()]
    baselines = {r["id"].split(":")[0]: r["passed"] for r in runs if r["id"].endswith(":baseline")}
    per_project: dict[str, dict[str, Any]] = {}
    for name, n in sorted(Counter(f"{t['project']}-{t['version']}" for t in tasks).items()):
        per_project[name] = {"tasks": n, "suite_tests": baselines.get(name)}
    failing = [len(t["fail_to_pass"]) for t in tasks]
    return {
        "tasks": len(tasks),
        "projects": len(per_project),
        "per_project": per_project,
        "per_mutation_kind": dict(sorted(Counter(t["mutation"]["kind"] for t in tasks).items())),
        "failing_tests_per_task": {
            "median": statistics.median(failing),
            "min": min(failing),
            "max": max(failing),
        },
        "suite_runs": len(runs),
        "mutations_verified": sum(1 for r in runs if not r["id"].endswith(":baseline")),
        "tasks_sha256": hashlib.sha256(tasks_file.read_bytes()).hexdigest(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default=".cache/swe-real", help="the build's directory")
    p.add_argument("--seed", type=int, default=0, help="the seed the build used")
    p.add_argument("--elapsed-s", type=float, required=True, help="the build's wall time (its last line)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    cache = Path(a.cache)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": f"python -m services.sandbox.swe_real --seed {a.seed} --tasks 500 (make tasks)",
        "report": " ".join(
            [Path(sys.executable).name, "-m", "bench.sandbox.swe_tasks", *(argv or sys.argv[1:])]
        ),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "machine": machine(),
        "seed": a.seed,
        "elapsed_s": a.elapsed_s,
        **summarise(cache / "tasks.jsonl", cache / "verified.jsonl"),
    }
    write_result(a.out, result)
    print(json.dumps({k: result[k] for k in ("tasks", "projects", "suite_runs", "elapsed_s")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
