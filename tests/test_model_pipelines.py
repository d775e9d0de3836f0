"""The tiny configs of the large model families through the whole pipeline (separate processes,
a real Redis, `python -m sbatch.launch run <config>`), kept short: a few synchronous steps
(max_off_policy_steps 0, so every sample is on-policy) on small batches. The float32 engine and
trainer must agree on every sampled token's log-prob (on-policy k3 mismatch at float32 rounding)
and on every MoE routing decision, and the run must account for every rollout. Learning itself is
shown by `make launch MODEL=<config>` runs (docs/models.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import REPO_ROOT
from services.common.redis_server import RedisServer

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.mark.parametrize(
    "config",
    [
        "debug-kimi",
        # ~1 min on the loaded 2-core CI machine, as debug-kimi: `make test-full` only; the engine
        # side is covered in `make test` by tests/test_nemotron_engine.py
        pytest.param("debug-nemotron", marks=pytest.mark.full),
        pytest.param("debug-glm5", marks=pytest.mark.full),
    ],
)
def test_short_run_engine_equals_trainer_on_policy(tmp_path: Path, config: str) -> None:
    run_dir = tmp_path / "run"
    with RedisServer(tmp_path / "redis") as redis:
        cmd = [
            sys.executable, "-m", "sbatch.launch", "run", config,
            f"--run.dir={run_dir}", f"--redis.url={redis.url}", f"--run.max_steps={STEPS}",
            "--run.stop_on_targets=false", "--run.timeout_s=300",
            "--orchestrator.batch_size=4", "--orchestrator.group_size=4",
            "--orchestrator.max_off_policy_steps=0",
        ]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    hist = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
    for h in hist:
        assert h["staleness_max"] == 0
        # float32 on both sides: the same function, rounding apart (a flipped expert or attention
        # key would cost orders of magnitude more)
        assert h["mismatch_kl_k3_on_policy"] is not None and abs(h["mismatch_kl_k3_on_policy"]) < 1e-8, h
        assert h["routing_replayed_frac"] == 1.0 and h["routing_agreement_mean"] == 1.0, h
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ledger"]["lost"] == 0 and summary["ledger"]["trained_twice"] == 0
