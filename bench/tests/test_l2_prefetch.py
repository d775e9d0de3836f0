"""bench/engine/l2_prefetch.py: what can be checked without a GPU. The probe itself needs one
(its kernels are a TMA bulk prefetch and L2 eviction hints); on CPU it must refuse clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("n_ops", "distance"), [(112, 1), (112, 2), (112, 4), (3, 4), (1, 1)])
def test_every_weight_is_fetched_once_before_its_op(n_ops: int, distance: int) -> None:
    # Imported here, not at collection: the script imports triton, which the interpreter-backed
    # kernel test files must import first (tests/helpers/triton_interp.py).
    sys.path.insert(0, str(ROOT))
    from bench.engine.l2_prefetch import prefetch_plan

    plan = prefetch_plan(n_ops, distance)
    fetched = [j for ops in plan for j in ops]
    assert sorted(fetched) == list(range(n_ops))
    for i, ops in enumerate(plan):
        for j in ops:
            assert i <= j and (i == 0 or j - i == distance)  # never after its op starts, never further ahead


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_refuses_without_cuda(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "bench/engine/l2_prefetch.py", "--out", str(tmp_path / "x.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert r.returncode != 0 and "needs CUDA" in r.stderr
    assert not (tmp_path / "x.json").exists()
