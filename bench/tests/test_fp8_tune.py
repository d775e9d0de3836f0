"""bench/fp8/tune.py on CPU: its grid, compile-task list and table merge, the --skip-triton and
--dry-run modes, and (slow) its compile phase and tuning flow under the Triton interpreter (its
GPU parts run on the H200)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ops.fp8 import triton_gemm as kern

REPO = Path(__file__).resolve().parents[2]
LARGE = {"block_m": 128, "block_n": 256, "group_m": 8, "num_warps": 8, "num_stages": 3}


def _table(dense: list[dict], grouped: list[dict] | None = None, buckets: list[int] | None = None) -> dict:
    return {
        "version": 1,
        "m_buckets": buckets or sorted({e["m"] for e in dense}),
        "dense": dense,
        "grouped": grouped or [],
    }


def _load_tune() -> object:
    sys.path.insert(0, str(REPO / "bench" / "fp8"))  # tune.py imports gemm.py as `gemm`
    spec = importlib.util.spec_from_file_location("fp8_tune_bench", REPO / "bench" / "fp8" / "tune.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


tune = _load_tune()


def test_tune_skip_triton_keeps_the_tables_triton_entries() -> None:
    old = kern.Fp8Table.model_validate(
        _table(
            [
                {"m": 512, "n": 2048, "k": 7168, "choice": "triton", "config": LARGE},
                {"m": 4096, "n": 2048, "k": 7168, "choice": "torch"},
            ]
        )
    )
    rows = [
        {"M": m, "N": 2048, "K": 7168, "us": {"torch": 9.0, "cuda": 8.0},
         "choice": {"choice": "cuda", "config": None, "linear": "separate"}}
        for m in (512, 4096)
    ]  # fmt: skip
    errors: list[str] = []
    kept = tune.keep_triton_entries(old, rows, errors)
    assert [r["M"] for r in kept] == [4096] and errors == [
        "dense 512x2048x7168: the table's Triton entry kept (--skip-triton)"
    ]
    new = {(e.m, e.n, e.k): e for e in tune.merge_table(old, kept, [], "run").dense}
    assert new[(512, 2048, 7168)].choice == "triton" and new[(4096, 2048, 7168)].choice == "cuda"
    assert new[(4096, 2048, 7168)].us == {"torch": 9.0, "cuda": 8.0}
    proc = subprocess.run(
        [sys.executable, "bench/fp8/tune.py", "--skip-triton", "--m", "128,4096", "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 2 and "--skip-triton is for M > 256" in proc.stderr


def test_tune_grid_respects_hardware_limits() -> None:
    sms = 132
    for m, n, k in [(64, 2048, 7168), (128, 7168, 2048), (256, 18432, 7168)]:
        grid = tune.dense_grid(m, n, k, sms)
        assert len(grid) >= 30 and len(set(grid)) == len(grid)
        kb = k // 128
        for c in grid:
            assert c.kernel == "tiled" and c.block_m <= 64 and tune.smem_estimate(c) <= tune.SMEM_BYTES
            assert kb // c.split_k >= 2, c
            assert c.split_k == 1 or c.fused_reduce or (c.block_m, c.block_n) == (64, 128), c
        assert {c.num_stages for c in grid} >= {4, 5, 6}
        assert any(c.split_k > 1 and c.fused_reduce for c in grid) == (m == 64 or n < 18432)
    large = tune.dense_grid(8192, 18432, 7168, sms)
    assert {(c.block_m, c.block_n) for c in large if c.kernel == "tma"} >= {
        (128, 256),
        (256, 128),
        (128, 128),
    }
    assert any(c.warp_spec for c in large) and all(c.split_k == 1 for c in large)
    assert not any(c.kernel == "tma" for c in tune.dense_grid(8192, 1000, 1300, sms))  # TMA alignment


def test_tune_compile_tasks_are_deduplicated() -> None:
    tasks = tune.build_tasks([64, 4096], grouped=True)
    keys = [(t[0], t[1]) for t in tasks]
    assert len(keys) == len(set(keys))
    kinds = {t[0] for t in tasks}
    assert kinds == {"dense", "fused", "grouped"}
    assert all(tune.fused_ok(t[1]) for t in tasks if t[0] == "fused")
    assert len(tasks) < 700  # ~5 minutes on 15 compile processes


def test_tune_merge_keeps_old_entries_and_round_trips(tmp_path: Path) -> None:
    old = kern.load_table(kern.TABLE_PATH)
    cfg = kern.GemmConfig(32, 256, 2, 1, 8, 5, fused_reduce=True)
    dense = [
        {"M": 64, "N": 7168, "K": 2048, "us": {"bf16": 16.0, "chosen_gemm": 8.0, "torch": None},
         "choice": {"choice": "triton", "config": vars(cfg) | {}, "linear": "fused"}},
        {"M": 8192, "N": 2048, "K": 7168, "us": {"bf16": 330.0}, "choice": {"choice": "torch", "config": None,
                                                                           "linear": "separate"}},
        {"M": 128, "N": 7168, "K": 2048, "us": {}, "errors": {"choice": "no verified option"}},
    ]  # fmt: skip
    grouped = [{"E": 32, "T": 256, "N": 4096, "K": 7168, "us": {"chosen": 100.0},
                "choice": {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 5}}]  # fmt: skip
    new = tune.merge_table(old, dense, grouped, "test run")
    path = tmp_path / "t.json"
    tune.write_table(new, path)
    back = kern.load_table(path)
    by_key = {(e.m, e.n, e.k): e for e in back.dense}
    e = by_key[(64, 7168, 2048)]
    assert e.choice == "triton" and e.config.gemm() == cfg and e.fused_config.gemm() == cfg  # type: ignore[union-attr]
    assert e.source == "test run" and e.us == {"bf16": 16.0, "chosen_gemm": 8.0}
    assert by_key[(8192, 2048, 7168)].source == "test run"
    # Not re-measured (or no verified option): the old entry stays, with its source.
    for key in {(o.m, o.n, o.k) for o in old.dense} - {(64, 7168, 2048), (8192, 2048, 7168)}:
        assert by_key[key] == next(o for o in old.dense if (o.m, o.n, o.k) == key)
    assert len(back.dense) == len(old.dense)
    g = next(g for g in back.grouped if g.n == 4096 and g.rows_per_expert == 8.0)
    assert (g.block_m, g.block_n, g.num_stages, g.source) == (32, 64, 5, "test run")


def test_tune_dry_run_lists_the_grid() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/fp8/tune.py", "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert res["compile_tasks"] == sum(res["by_kind"].values()) and res["by_kind"]["fused"] > 0
    assert len(res["dense_per_shape"]) == 20  # 5 M x 4 (N, K)


@pytest.mark.slow  # spawns 2 worker processes running the interpreter (~45 s)
def test_tune_compile_phase_end_to_end_on_cpu() -> None:
    """tune.py's parallel compile phase as it runs on the H200 (spawned workers, pickled tasks,
    per-task results), on tiny shapes under the interpreter: every kernel kind launches, and a
    config that cannot run a shape is reported as failed (pruned), not raised."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "RELAY_TUNE_DEVICE": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "bench/fp8/tune.py", "--smoke", "--workers", "2"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 5
    bad = {name: r for name, r in res.items() if not r["ok"]}
    assert list(bad) == ["dense m16n64k128_s1_g1_w4_st2_tma"] and "% 16" in bad[list(bad)[0]]["error"]
    assert {name.split()[0] for name, r in res.items() if r["ok"]} == {"dense", "fused", "grouped"}


TUNE_FLOW = textwrap.dedent(
    """
    import importlib.util, json, sys, time
    from pathlib import Path
    import torch
    sys.path.insert(0, "bench/fp8")
    spec = importlib.util.spec_from_file_location("fp8_tune_flow", "bench/fp8/tune.py")
    tune = importlib.util.module_from_spec(spec); sys.modules[spec.name] = tune; spec.loader.exec_module(tune)
    from ops.fp8 import triton_gemm as kern

    class WallTimer:
        # tune.Timer needs CUDA graphs; on CPU: one call, wall microseconds (real, just coarse)
        def time(self, fn, reps):
            t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e6

    m, n, k = 16, 256, 512
    grid = tune.dense_grid(m, n, k)
    picked = [c for c in grid if (c.block_m, c.block_n, c.num_stages) == (16, 128, 4) and c.split_k in (1, 2)]
    compiled = {(kind, c): {"ok": True, "n_spills": 0} for c in picked for kind in ("dense", "fused")}
    compiled[("dense", grid[0])] = {"ok": True, "n_spills": 3}  # spilled: never timed
    dev = torch.device("cpu")
    far = time.perf_counter() + 900
    row = tune.tune_dense(m, n, k, dev, WallTimer(), compiled, far)
    g = tune.GroupedConfig(16, 64, 4, 3)  # in grouped_grid(40, 4)
    case = ("tiny", 4, 40, 256, 256)
    grow = tune.tune_grouped(case, dev, WallTimer(), {("grouped", g): {"ok": True}}, far)
    table = tune.merge_table(kern.load_table(), [row], [grow], "cpu flow test")
    print(json.dumps({"row": row, "grouped": grow, "picked": [c.name() for c in picked],
                      "spilled": grid[0].name(), "table": table.model_dump()}, default=str))
    """
)


@pytest.mark.slow  # the interpreter runs each candidate several times (~40 s)
def test_tune_flow_on_cpu_picks_a_verified_winner() -> None:
    """tune_dense / linear_options / tune_grouped / merge_table end to end on a tiny shape under
    the interpreter, with wall-clock timing standing in for CUDA-graph replays (which need a GPU):
    only compiled, non-spilling configs are timed, cuBLAS (no CPU kernel) drops out with its
    error, every candidate is checked against the reference, the fused linear is offered only
    with bits equal to quantiser + GEMM, and the winner lands in the table."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", TUNE_FLOW], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    row, picked = res["row"], res["picked"]
    assert len(picked) >= 2 and set(row["screen_us"]) == set(picked)  # the spilled one was not timed
    assert res["spilled"] not in row["screen_us"]
    assert not row["torch_ok"] and "torch" in row["errors"]  # no block-wise scaled_mm on CPU
    assert set(row["checked"]) == set(picked) and all(c["ok"] for c in row["checked"].values())
    fused = {name: v for name, v in row["linear_us"].items() if name.startswith("fused")}
    assert fused and all(v["bits_equal"] for v in fused.values())
    choice = row["choice"]
    assert choice["choice"] == "triton" and kern.GemmConfig(**choice["config"]).name() in picked
    entry = next(e for e in res["table"]["dense"] if (e["m"], e["n"], e["k"]) == (16, 256, 512))
    assert entry["source"] == "cpu flow test" and entry["config"] == choice["config"]
    assert entry["linear"] == choice["linear"]
    grow = res["grouped"]
    assert grow["choice"] == {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 3}, grow
    assert any(
        g["rows_per_expert"] == 10.0 and g["source"] == "cpu flow test" for g in res["table"]["grouped"]
    )
