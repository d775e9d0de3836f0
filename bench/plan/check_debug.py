"""The capacity plan against a measured run, stage by stage: predicted vs the run's own.

    python bench/plan/check_debug.py --run runs/latest --out bench/plan/results/debug_check.json
    python bench/plan/check_debug.py --launch 80 --out bench/plan/results/debug_check.json

With `--launch N` it first runs the debug pipeline itself (`sbatch.launch run debug`, N steps, no
early stop on targets) in a fresh run directory and checks that run.

Reads the run's resolved config and metrics.jsonl (steps after the first `--skip`, when compile
and warm-up are over) and sets each stage's median per step beside `make plan`'s prediction for
the same config (the [plan] workload the config states):

- step: the wall time between trainer steps, against the plan's asynchronous step;
- train: the trainer's compute per step (`step_s`), against the plan's train time;
- rollout: the time decode had work per step (the step's wall time less decode's idle time,
  `decode_idle_s`), against the plan's rollout time;
- publish: the time publishing blocked the trainer (`publish_s`), against the plan's publish
  plus apply; where the plan predicts none, it passes while under 5% of the measured step.

It also reports the workload the run had (tokens and generated tokens per rollout) beside the
plan's assumption of it, and the load average, which slows every stage of a shared machine.
Goal: every stage within 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from bench.results import write_result  # noqa: E402
from sbatch.plan import build_plan, load_rates  # noqa: E402
from services.common.config import load_resolved  # noqa: E402

NEGLIGIBLE = 0.05  # of the step: a stage the plan predicts as zero may take this much


def measured_stages(recs: list[dict[str, Any]]) -> dict[str, float]:
    pairs = list(zip(recs, recs[1:], strict=False))
    gaps = [b["time"] - a["time"] for a, b in pairs]
    busy = [g - (b["decode_idle_s"] - a["decode_idle_s"]) for g, (a, b) in zip(gaps, pairs, strict=True)]
    later = [b for _, b in pairs]
    return {
        "step": statistics.median(gaps),
        "train": statistics.median(r["step_s"] for r in later),
        "rollout": statistics.median(busy),
        "publish": statistics.median(r["publish_s"] for r in later),
        "trainer_wait": statistics.median(r["wait_data_s"] for r in later),
    }


def compare(predicted: float, measured: float, step: float) -> dict[str, Any]:
    if predicted == 0.0:
        return {"predicted_s": 0.0, "measured_s": measured, "ok": measured <= NEGLIGIBLE * step}
    ratio = predicted / measured if measured > 0 else float("inf")
    return {
        "predicted_s": predicted,
        "measured_s": measured,
        "predicted_over_measured": ratio,
        "ok": 0.5 <= ratio <= 2.0,
    }


def launch(steps: int) -> Path:
    run = Path(tempfile.mkdtemp(prefix="relay-plan-check-")) / "run"
    argv = [sys.executable, "-m", "sbatch.launch", "run", "debug", f"--run.dir={run}"]
    argv += [f"--run.max_steps={steps}", "--run.stop_on_targets=false", "--run.time_budget_s=100000"]
    print(f"launching the debug run in {run}", flush=True)
    with open(run.parent / "launch.log", "w") as log:
        code = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"the debug run failed ({code}): {run.parent / 'launch.log'}")
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest")
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    ap.add_argument("--launch", type=int, default=0, help="run the debug pipeline for N steps first")
    args = ap.parse_args()
    run = launch(args.launch) if args.launch else Path(args.run).resolve()
    cfg = load_resolved(run / "config.json")
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = recs[args.skip :]
    if len(recs) < 4:
        raise SystemExit(f"{run}: only {len(recs)} steps after the first {args.skip}; run longer")
    got = measured_stages(recs)
    plan = build_plan(cfg, load_rates(), balance=False)
    t = plan.times
    stages = {
        "step": compare(t.step_async_s, got["step"], got["step"]),
        "train": compare(t.train_s, got["train"], got["step"]),
        "rollout": compare(t.rollout_s, got["rollout"], got["step"]),
        "publish": compare(t.publish_blocked_s + t.apply_s, got["publish"], got["step"]),
    }
    gaps = [b["time"] - a["time"] for a, b in zip(recs, recs[1:], strict=False)]
    deciles = statistics.quantiles(gaps, n=10)
    out = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_at_check": os.getloadavg(),
        "baseline": "the measured run itself (its metrics.jsonl)",
        "run": {
            "dir": str(run),
            "config": cfg.run.name,
            "steps_measured": len(gaps),
            "step_s_p10_p90": [deciles[0], deciles[-1]],
            "trainer_wait_s": got["trainer_wait"],
            "tokens_per_rollout": statistics.mean(r["tokens"] / max(1, r["samples"]) for r in recs),
            "generated_per_rollout": statistics.mean(r["loss_tokens"] / max(1, r["samples"]) for r in recs),
        },
        "plan": {
            "rollout_tokens": cfg.plan.rollout_tokens,
            "generated_tokens": cfg.plan.generated_tokens,
            "bound_by": t.bound_by,
            "rates_used": plan.rates_used,
        },
        "stages": stages,
        "within_2x": all(s["ok"] for s in stages.values()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(args.out, out)
    print(json.dumps({"within_2x": out["within_2x"], "stages": stages}, indent=1))
    if not out["within_2x"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
