"""Step attribution: the engine's per-phase step times (services/engine/stats.py), and the host tuning
the services apply (services/engine/host_tuning.py)."""

from __future__ import annotations

import atexit
import gc
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.config import EngineConfig
from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.host_tuning import collect_frozen, tune_after_startup
from services.engine.stats import PHASES


@pytest.mark.parametrize("overlap", [False, True])
def test_every_step_records_its_phases(model_dir: Path, overlap: bool) -> None:
    cfg = EngineConfig(
        device="cpu", dtype="float32", max_seq_len=256, block_size=16, num_kv_blocks=64, max_batch_size=4
    )
    cfg.overlap_schedule = overlap
    eng = LLMEngine(model_dir, cfg, version=0)
    eng.add_request(
        GenerateRequest(input_ids=list(range(1, 40)), sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    )
    t0 = time.perf_counter()
    eng.step()
    wall = time.perf_counter() - t0
    ph = eng.stats.last_step_phases
    assert tuple(ph) == PHASES
    assert all(v >= 0 for v in ph.values())
    # The phases partition the step: their sum is the step's wall time, less the few calls between.
    assert 0.5 * wall <= sum(ph.values()) <= wall
    assert ph["forward"] > 0  # a 39-token prefill forward on CPU is not free


def test_tune_after_startup_freezes_and_shortens_the_switch_interval() -> None:
    thresholds, interval = gc.get_threshold(), sys.getswitchinterval()
    try:
        info = tune_after_startup(gen0=5000, switch_interval_s=0.001)
        # Frozen objects still die by reference count (another thread's, here pytest-xdist's):
        # the count can only have dropped since the function read it (a CI run saw 2 fewer).
        assert 1000 < gc.get_freeze_count() <= info["frozen_objects"]
        assert gc.get_threshold()[0] == 5000
        assert sys.getswitchinterval() == pytest.approx(0.001)
        # Frozen objects are skipped: a full collection now walks only what was created since.
        t0 = time.perf_counter()
        gc.collect()
        assert time.perf_counter() - t0 < 0.05
    finally:  # leave the test process as it was
        atexit.unregister(collect_frozen)
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)


def test_frozen_startup_objects_are_freed_at_exit() -> None:
    """The services freeze their start-up objects; a process that exits after that must not
    leave libtriton's objects to the interpreter's teardown ("nanobind: leaked ..." on stderr)."""
    code = (
        "from services.engine import LLMEngine\n"
        "from services.engine.host_tuning import tune_after_startup\n"
        "import triton._C.libtriton\n"
        "tune_after_startup()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]
