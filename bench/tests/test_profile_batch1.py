"""bench/engine/profile_batch1.py's --compare, without a GPU: which switches it takes, and which
logits rows its tolerance check reads (the H200 runs the rest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_compare_refuses_what_is_not_a_boolean_engine_switch(tmp_path: Path) -> None:
    for bad in ("gemv_prologues", "pdl,dtype"):
        r = subprocess.run(
            [
                sys.executable,
                "bench/engine/profile_batch1.py",
                "--smoke",
                "--compare",
                bad,
                "--out",
                str(tmp_path / "x.json"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            timeout=120,
        )
        assert r.returncode == 2 and "not boolean EngineConfig fields" in r.stderr, r.stderr[-500:]
        assert not (tmp_path / "x.json").exists()


def test_tolerance_reads_rows_up_to_the_first_differing_token() -> None:
    sys.path.insert(0, str(ROOT))  # imported here: the script imports triton (see test_l2_prefetch.py)
    from bench.engine.profile_batch1 import rows_before_divergence

    a = torch.tensor([[0.0, 1.0], [2.0, 1.0], [0.0, 3.0], [5.0, 0.0]])
    same = [(a[i : i + 1], a[i : i + 1].clone()) for i in range(4)]
    assert len(rows_before_divergence(same)) == 4
    flipped = [*same[:1], (a[1:2], torch.tensor([[1.0, 2.0]])), *same[2:]]
    assert len(rows_before_divergence(flipped)) == 2  # the row whose argmax differs is the last read
    assert rows_before_divergence([]) == []
