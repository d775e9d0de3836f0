"""The whole stack as separate processes with a real Redis: a short debug run must learn,
serve several weight versions, respect the off-policy bound and account for every rollout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.common.config import REPO_ROOT, load_resolved
from services.common.redis_server import RedisServer
from services.common.schemas import RolloutGroup

pytestmark = pytest.mark.slow


def test_debug_run_learns_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as redis:
        steps = 60
        cmd = [
            sys.executable, "-m", "sbatch.launch", "run", "debug",
            f"--run.dir={run_dir}", f"--redis.url={redis.url}", f"--run.max_steps={steps}",
            '--orchestrator.tasks=[{env="reverse", target=0.5}]', "--run.timeout_s=500",
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

        hist = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [h["step"] for h in hist] == list(range(1, steps + 1))
        rewards = [h["reward_by_env"]["reverse"] for h in hist]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
        assert first < 0.2, f"random-init reward should be a few percent, got {first}"
        assert last > 0.5, f"reward did not rise: first {first:.3f} last10 {last:.3f}"

        cfg = load_resolved(run_dir / "config.json")
        bound = cfg.orchestrator.max_off_policy_steps
        assert max(h["staleness_max"] for h in hist) <= bound

        bus = Bus(redis.url, cfg.redis.prefix)
        ledger = bus.ledger()
        started, trained, dropped = ledger["started"], ledger["trained"], ledger["dropped"]
        assert len(trained) == steps * cfg.orchestrator.batch_size
        assert all(c == 1 for c in trained.values()), "a group was trained twice"
        assert set(trained).isdisjoint(dropped)
        assert started == set(trained) | set(dropped), "a started rollout was neither trained nor dropped"

        versions: set[int] = set()
        for key in bus.r.scan_iter(match=f"{cfg.redis.prefix}:rollout:*"):
            group = RolloutGroup.model_validate_json(bus.r.get(key))
            for s in group.samples:
                versions.update(v for v in s.versions if v >= 0)
        assert len(versions) >= 2, f"decode served only versions {versions}"

        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
        assert "reward" in proc.stdout and "groups started" in proc.stdout
