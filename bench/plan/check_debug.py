"""The capacity plan against a measured run: predicted step time vs the run's own.

    python bench/plan/check_debug.py --run runs/latest --out bench/plan/results/debug_check.json

Reads the run's resolved config and metrics.jsonl, takes the median wall time between trainer
steps (steps after the first five, when compile and warm-up are over) and the trained tokens per
rollout, and sets them beside `make plan`'s prediction for the same config (its asynchronous step
time, with the [plan] workload the config states). Goal: within 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sbatch.plan import build_plan, load_rates  # noqa: E402
from services.common.config import load_resolved  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest")
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    args = ap.parse_args()
    run = Path(args.run).resolve()
    cfg = load_resolved(run / "config.json")
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = recs[args.skip :]
    if len(recs) < 3:
        raise SystemExit(f"{run}: only {len(recs)} steps after the first {args.skip}; run longer")
    gaps = [b["time"] - a["time"] for a, b in zip(recs, recs[1:], strict=False)]
    measured = statistics.median(gaps)
    tokens_per_rollout = statistics.mean(r["tokens"] / max(1, r["samples"]) for r in recs)
    plan = build_plan(cfg, load_rates(), balance=False)
    predicted = plan.times.step_async_s
    ratio = predicted / measured
    out = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "baseline": "the measured run itself (its metrics.jsonl)",
        "run_config": cfg.run.name,
        "steps_measured": len(gaps),
        "measured_step_s": measured,
        "measured_step_s_p10_p90": [
            statistics.quantiles(gaps, n=10)[0],
            statistics.quantiles(gaps, n=10)[-1],
        ],
        "measured_tokens_per_rollout": tokens_per_rollout,
        "plan_tokens_per_rollout": cfg.plan.rollout_tokens,
        "predicted_step_s": predicted,
        "predicted_bound_by": plan.times.bound_by,
        "predicted_over_measured": ratio,
        "within_2x": 0.5 <= ratio <= 2.0,
        "rates_used": plan.rates_used,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("measured_step_s", "predicted_step_s", "predicted_over_measured")}))
    if not out["within_2x"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
