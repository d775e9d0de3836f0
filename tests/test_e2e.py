"""The whole stack as separate processes with a real Redis: a short debug run must learn,
serve several weight versions, respect the off-policy bound and account for every rollout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sbatch.summary import ledger_report
from services.common.bus import Bus
from services.common.config import REPO_ROOT, load_resolved
from services.common.redis_server import RedisServer
from services.common.schemas import RolloutGroup

pytestmark = pytest.mark.slow


def test_debug_run_learns_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as redis:
        # configs/debug.toml (reverse 2 : reverse-turns 1, groups of 16, steered entropy) has its
        # single-turn 10-step mean past 0.55 at ~step 110-170 (bench/calibration/README.md, sweeps
        # 4-5): the run stops as soon as both tasks pass the test's bar, at most 250 steps.
        max_steps = 250
        tasks = '[{env="reverse",weight=2.0,target=0.55},{env="reverse-turns",weight=1.0,target=0.15}]'
        cmd = [
            sys.executable, "-m", "sbatch.launch", "run", "debug",
            f"--run.dir={run_dir}", f"--redis.url={redis.url}", f"--run.max_steps={max_steps}",
            "--run.timeout_s=900", "--run.stop_on_targets=true", f"--orchestrator.tasks={tasks}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1000)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

        hist = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = len(hist)
        assert 10 <= steps <= max_steps
        assert [h["step"] for h in hist] == list(range(1, steps + 1))

        def curve(env: str) -> tuple[float, float]:
            """(mean of the first 5 steps, best 10-step mean)."""
            r = [h["reward_by_env"][env] for h in hist if env in h["reward_by_env"]]
            return sum(r[:5]) / 5, max(sum(r[i - 10 : i]) / 10 for i in range(10, len(r) + 1))

        first, last = curve("reverse")  # single-turn
        assert first < 0.1, f"random-init reward should be a few percent, got {first}"
        assert last > 0.5, f"single-turn reward did not rise: first {first:.3f} best10 {last:.3f}"
        first_mt, last_mt = curve("reverse-turns")  # multi-turn, observations masked
        assert last_mt > 5 * first_mt, f"multi-turn reward: first {first_mt:.3f} best10 {last_mt:.3f}"

        cfg = load_resolved(run_dir / "config.json")
        bound = cfg.orchestrator.max_off_policy_steps
        assert max(h["staleness_max"] for h in hist) <= bound

        bus = Bus(redis.url, cfg.redis.prefix)
        ledger = bus.ledger()
        started, trained, dropped = ledger["started"], ledger["trained"], ledger["dropped"]
        assert len(trained) == steps * cfg.orchestrator.batch_size
        assert all(c == 1 for c in trained.values()), "a group was trained twice"
        assert set(trained).isdisjoint(dropped)
        # The run stopped on targets: groups generated for later steps are still queued or in
        # flight (trainable on a resume). Every other started group was trained or dropped.
        led = ledger_report(bus)
        assert led["lost"] == 0 and led["trained_and_dropped"] == 0, led
        assert led["started"] == len(started) == led["trained"] + led["dropped"] + led["pending"], led
        assert set(trained) | set(dropped) <= started

        versions: set[int] = set()
        token_credit = cfg.orchestrator.advantage == "token"
        for key in bus.r.scan_iter(match=bus.k.rollouts_pattern):
            group = RolloutGroup.model_validate_json(bus.r.get(key))
            for s in group.samples:
                versions.update(v for v in s.versions if v >= 0)
                # the debug config's token credit reached the samples (sandbox -> orchestrator)
                assert (s.token_advantages is not None) == token_credit, group.group_id
        assert len(versions) >= 2, f"decode served only versions {versions}"

        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
        assert "reward" in proc.stdout and "groups started" in proc.stdout
