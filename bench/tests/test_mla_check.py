"""bench/models/mla_check.py runs end to end on CPU (--smoke: tiny shapes, the Triton kernels under
the interpreter in its own process): every check passes and the timing section is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_mla_check_smoke(tmp_path: Path) -> None:
    out = tmp_path / "mla_check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    script = REPO / "bench" / "models" / "mla_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--time", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("command", "date", "machine", "baseline"):
        assert key in result
    assert result["ok"] and result["kernels"]["ok"] and result["engine"]["ok"]
    for name in ("dense_split", "sparse_split"):
        assert result["kernels"][name]["max_abs_err"] < 2e-2  # bf16 pool (mla_check.BF16_TOL)
    for model in ("debug-kimi", "debug-glm5"):
        assert result["engine"][model]["triton_greedy_equal"] == "6/6"
    timing = result["timing"]
    assert {"b4_dense", "b4_sparse"} <= set(timing)
    assert timing["b4_dense"]["torch_gather_sdpa_ms"] > 0 and timing["b4_sparse"]["index_scores_ms"] > 0
