"""Step attribution for the interference bench (bench/kv/interference.py): the engine's per-phase
step times, the GC trace, the background-event timeline, and the host tuning the services apply."""

from __future__ import annotations

import atexit
import gc
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.schemas import GenerateRequest, SamplingParams
from services.engine import LLMEngine
from services.engine.host_tuning import collect_frozen, tune_after_startup
from services.engine.stats import PHASES

# bench/ is not a package on the tests' path: load its helpers from the file (as test_bench_r3.py).
_spec = importlib.util.spec_from_file_location("kv_common", Path(__file__).parents[1] / "bench/kv/common.py")
assert _spec is not None and _spec.loader is not None
common = sys.modules["kv_common"] = importlib.util.module_from_spec(_spec)  # dataclasses need it
_spec.loader.exec_module(common)
GcTrace, Timeline, engine_config, make_model_dir = (
    common.GcTrace,
    common.Timeline,
    common.engine_config,
    common.make_model_dir,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir("tiny", tmp_path_factory.mktemp("m") / "model")


@pytest.mark.parametrize("overlap", [False, True])
def test_every_step_records_its_phases(model_dir: Path, overlap: bool) -> None:
    cfg = engine_config("cpu", "float32", 256, block_size=16, num_kv_blocks=64, max_batch_size=4)
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


def test_gc_trace_times_collections_and_attributes_them_to_a_window() -> None:
    with GcTrace() as trace:
        t0 = time.perf_counter()
        gc.collect()
        t1 = time.perf_counter()
    assert [g for _, _, g in trace.collections] == [2]
    assert trace.summary()["gen2"]["n"] == 1
    assert 0 < trace.ms_within(t0, t1) <= (t1 - t0) * 1000
    assert trace.ms_within(t1, t1 + 1) == 0.0
    assert gc.callbacks.count(trace._cb) == 0  # removed on exit


def test_timeline_reports_overlapping_events() -> None:
    tl = Timeline()
    with tl.span("pull", id="long-0") as d:
        d["pages"] = 3
    a, b = tl.events[0][1], tl.events[0][2]
    tl.add("stage_first", b + 1.0, b + 2.0, id="long-0")
    assert tl.overlapping(a, b + 0.5) == ["pull id=long-0 pages=3"]
    assert tl.overlapping(b + 1.5, b + 1.6) == ["stage_first id=long-0"]
    assert [e[0] for e in tl.compact(a)] == ["pull", "stage_first"]


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


def _blocked_in_the_driver() -> None:
    time.sleep(0.04)  # stands for a CUDA call that releases the GIL and blocks


def test_stall_sampler_names_where_a_slow_step_waited() -> None:
    s = common.StallSampler(after_ms=5.0, period_ms=0.5)
    try:
        s.step_begin(1.0)
        s.step_end()  # a fast step: nothing recorded
        s.step_begin(2.0)
        _blocked_in_the_driver()
        s.step_end()
    finally:
        s.close()
    assert list(s.steps) == [2.0]  # under the caller's key, as interference.py looks it up
    rec = s.steps[2.0]
    assert rec["samples"], rec
    first = rec["samples"][0]
    assert first["in_step_ms"] >= 5.0
    assert any("_blocked_in_the_driver" in f for f in first["threads"]["LOOP"])
    assert "stall-sampler" not in first["threads"]  # its own frames are left out
