"""bench/engine/multi.py runs end to end on CPU (gloo, 2 ranks under torchrun, tiny shapes): the
2-rank decode through the multi-rank engine's orders, the one-rank baseline in the same process,
the collectives and the bandwidth, in one result file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-dense"])
def test_multi_runs_on_cpu(shape: str, tmp_path: Path) -> None:
    out = tmp_path / "multi.json"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "bench/engine/multi.py", "--shape", shape, "--device", "cpu", "--batch", "4",
        "--context", "16", "--steps", "3", "--warmup", "1", "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["parallel"]["tp"] == 2 and r["parallel"]["ep"] == (2 if shape == "tiny-moe" else 1)
    for side in (r["multi_rank"], r["baseline_one_gpu"]):
        assert side["step_ms_median"] > 0 and side["tok_s_per_gpu"] > 0
    assert r["baseline_one_gpu"]["batch"] == (2 if shape == "tiny-moe" else 4)
    assert r["tok_s_per_gpu_ratio"] > 0
    assert r["collectives_ms"]["all_reduce_batch_x_dim_ms"] > 0
    assert ("moe_all_to_all_per_layer_ms" in r["collectives_ms"]) == (shape == "tiny-moe")
    assert r["bandwidth_gb_s"]["all_to_all_busbw_gb_s"] > 0 and r["command"].startswith("torchrun")
