"""bench/calibration/debug_sweep.py's bookkeeping: which step met each target (as the run summary
and the launcher's stop rule count them) and the spread over seeds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from services.common.config import TaskSpec

_spec = importlib.util.spec_from_file_location(
    "debug_sweep", Path(__file__).parents[2] / "bench/calibration/debug_sweep.py"
)
assert _spec is not None and _spec.loader is not None
sweep = sys.modules["debug_sweep"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def test_hits_follow_the_summary_and_the_stop_rule() -> None:
    tasks = [TaskSpec(env="a", target=0.5), TaskSpec(env="b", target=0.8)]
    hist = []
    for step in range(1, 31):
        a = 0.0 if step < 10 else 1.0  # 10-step mean of a reaches 0.5 at step 14
        rec = {"step": step, "time": 100.0 + step, "reward_by_env": {"a": a}}
        if step >= 12:  # b appears late: its own 10-step mean first exists (0.9) at step 21
            rec["reward_by_env"]["b"] = 0.9
        hist.append(rec)
    got = sweep.hits(hist, tasks)
    assert got["tasks"]["a"] == {"step": 14, "time": 114.0}
    assert got["tasks"]["b"] == {"step": 21, "time": 121.0}
    # The launcher's rule averages the steps that carried each task among the last 10 records:
    # b is 0.9 wherever it appears, so both hold once a does (step 14).
    assert got["both"] == {"step": 14, "time": 114.0}
    assert sweep.hits(hist[:13], tasks)["both"] is None


def test_seeds_and_spread() -> None:
    assert sweep.seeds_arg("0-3,7") == [0, 1, 2, 3, 7]
    s = sweep.spread([130.0, 120.0, 180.0, 150.0])
    assert s["median"] == 140.0 and s["min"] == 120.0 and s["max"] == 180.0
    assert s["q1"] == 127.5 and s["q3"] == 157.5
    runs = [
        {"met_both": True, "to_both": {"step": 120, "s": 300.0}},
        {"met_both": False, "to_both": None},
        {"met_both": True, "to_both": {"step": 140, "s": 340.0}},
    ]
    agg = sweep.aggregate(runs)
    assert agg["runs"] == 3 and agg["met_both"] == 2
    assert agg["steps_to_both"]["median"] == 130 and agg["seconds_to_both"]["max"] == 340.0
