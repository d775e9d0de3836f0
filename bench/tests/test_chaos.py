"""bench/chaos/run.py end to end at its smallest: one debug run with a few kills (no baseline), and
the result file's counts read from what the run left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos.run import main

pytestmark = pytest.mark.slow


def test_chaos_harness_counts_faults_and_the_ledger(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    code = main(
        [
            "--minutes", "0.6", "--interval", "8", "12", "--steps", "12", "--no-baseline",
            "--workdir", str(tmp_path / "work"), "--out", str(out), "--orchestrator.batch_size=8",
        ]
    )  # fmt: skip
    res = json.loads(out.read_text())
    chaos = res["chaos"]
    assert (
        chaos["faults_injected"] >= 2 and sum(chaos["faults_by_service"].values()) == chaos["faults_injected"]
    )
    assert chaos["status"] == "completed" and chaos["steps"] == 12, chaos
    assert chaos["rollouts_lost"] == 0 and chaos["trained_twice"] == 0
    assert chaos["versions_out_of_order"] == 0 and chaos["checkpoints_unreadable"] == 0
    assert chaos["versions_published_seen"] >= 2
    assert "slowdown" not in res and res["machine"]["cpus"]
    assert code == 0
