"""bench/kv/common.py's step-attribution helpers for the interference bench (bench/kv/interference.py):
the GC trace, the background-event timeline and the stall sampler (CPU)."""

from __future__ import annotations

import gc
import importlib.util
import sys
import time
from pathlib import Path

# bench/ is not a package on the tests' path: load its helpers from the file.
_spec = importlib.util.spec_from_file_location("kv_common", Path(__file__).parents[2] / "bench/kv/common.py")
assert _spec is not None and _spec.loader is not None
common = sys.modules["kv_common"] = importlib.util.module_from_spec(_spec)  # dataclasses need it
_spec.loader.exec_module(common)
GcTrace, Timeline = common.GcTrace, common.Timeline


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
