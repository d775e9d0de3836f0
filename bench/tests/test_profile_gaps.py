"""bench/trainer/profile_step.py's GPU idle attribution (idle_report): known intervals in Kineto's
chrome-trace format -> the gaps, the host op each is attributed to, and the sums per op; then a
real CPU profile through the same function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "trainer"


@pytest.fixture(scope="module")
def ps() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import profile_step
    finally:
        sys.path.remove(str(BENCH))
    return profile_step


def op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def call(name: str, ts: float, dur: float, corr: int | None = None, tid: int = 1) -> dict[str, Any]:
    e = op(name, ts, dur, tid, cat="cuda_runtime")
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def kernel(name: str, corr: int, ts: float, dur: float, cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}  # fmt: skip


def synthetic_trace(step_range: str) -> list[dict[str, Any]]:
    """Two profiled steps (times in us).

    Step 0 [0, 1000]: a GEMM 20-100; then .item(): a D2H copy 120-125 and the host blocked in
    cudaStreamSynchronize 115-395, so the next kernel is launched at 430 and runs at 450 (gap
    125-450, 325 us); the autograd thread launches at 680 from aten::sum (gap 600-690, 90 us,
    main thread idle in Python); the step's closing cudaDeviceSynchronize (gap 800-1000, 200 us).
    Gaps 0-20 and 100-120 are under the 50 us threshold.
    Step 1 [2000, 2300]: host Python between two ops (gap 2100-2220, 120 us, no op active)."""
    return [
        op(step_range, 0, 1000, cat="user_annotation"),
        op("aten::mm", 10, 20),
        call("cudaLaunchKernel", 15, 2, corr=1),
        op("aten::item", 105, 300),
        op("aten::_local_scalar_dense", 110, 290),
        call("cudaMemcpyAsync", 112, 2, corr=2),
        call("cudaStreamSynchronize", 115, 280),
        op("aten::mul", 420, 20),
        call("cudaLaunchKernel", 430, 2, corr=3),
        op("autograd::engine::evaluate_function: MulBackward0", 600, 100, tid=2),
        op("aten::sum", 600, 90, tid=2),
        call("cudaLaunchKernel", 680, 2, corr=4, tid=2),
        call("cudaDeviceSynchronize", 790, 205),
        kernel("nvjet_gemm", 1, 20, 80),
        kernel("Memcpy DtoH (Device -> Pageable)", 2, 120, 5, cat="gpu_memcpy"),
        kernel("elementwise_mul", 3, 450, 150),
        kernel("reduce_sum", 4, 690, 110),
        op(step_range, 2000, 300, cat="user_annotation"),
        op("aten::add", 2001, 9),
        call("cudaLaunchKernel", 2005, 2, corr=5),
        op("aten::relu", 2200, 10),
        call("cudaLaunchKernel", 2205, 2, corr=6),
        kernel("add", 5, 2010, 90),
        kernel("relu", 6, 2220, 80),
    ]


def test_idle_intervals_merge_overlapping_streams(ps: Any) -> None:
    W = ps.Work
    work = [W(10, 50, "a"), W(30, 80, "b"), W(100, 120, "c"), W(0, 5, "before")]
    gaps = ps.idle_intervals(work, 5, 150)
    assert [(a, b) for a, b, _ in gaps] == [(5, 10), (80, 100), (120, 150)]
    assert [w.name if w else None for _, _, w in gaps] == ["a", "c", None]
    assert ps.idle_intervals([W(0, 200, "long")], 5, 150) == []


def test_gaps_are_attributed_to_the_host_op(ps: Any) -> None:
    rep = ps.idle_report(synthetic_trace(ps.STEP_RANGE), cuda=True, threshold_us=50.0)
    assert rep["steps"] == 2
    s0, s1 = rep["per_step"]
    assert s0["window_ms"] == pytest.approx(1.0) and s1["window_ms"] == pytest.approx(0.3)
    # every idle microsecond of step 0: 20 + 20 small, 325 + 90 + 200 listed
    assert s0["idle_ms"] == pytest.approx(0.655) and s0["idle_listed_ms"] == pytest.approx(0.615)
    assert s0["small_gaps"] == {"count": 2, "ms": pytest.approx(0.04)}
    g = s0["gaps"]
    assert [(x["start_ms"], x["dur_us"]) for x in g] == [(0.125, 325), (0.6, 90), (0.8, 200)]
    # .item(): the host was blocked in the sync when the GPU went idle
    assert g[0]["cpu_op"] == "aten::_local_scalar_dense / cudaStreamSynchronize"
    assert g[0]["stack"] == ["aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize"]
    assert g[0]["next_kernel"] == "elementwise_mul"
    assert g[0]["launched_by"] == "aten::mul / cudaLaunchKernel"
    assert g[0]["launch_after_idle_us"] == pytest.approx(305)
    # the autograd thread (it launches the next kernel) rather than the idle main thread
    assert g[1]["cpu_op"] == "aten::sum" and g[1]["thread"] == "2"
    assert g[1]["launched_by"] == "aten::sum / cudaLaunchKernel"
    # the step's closing sync: a gap to the window's end, no next kernel
    assert g[2]["cpu_op"] == "cudaDeviceSynchronize" and "next_kernel" not in g[2]
    (h,) = s1["gaps"]
    assert (h["start_ms"], h["dur_us"], h["cpu_op"]) == (pytest.approx(0.1), 120, ps.NO_OP)
    assert h["launched_by"] == "aten::relu / cudaLaunchKernel" and h["launch_after_idle_us"] == 105
    # sums per attributed op, per step (2 steps)
    by = rep["by_op"]
    assert list(by) == [
        "aten::_local_scalar_dense / cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        ps.NO_OP,
        "aten::sum",
    ]
    assert by["aten::_local_scalar_dense / cudaStreamSynchronize"] == {
        "ms_per_step": pytest.approx(0.1625),
        "gaps_per_step": 0.5,
    }
    assert by[ps.NO_OP]["ms_per_step"] == pytest.approx(0.06)
    assert sum(v["ms_per_step"] for v in by.values()) == pytest.approx(rep["idle_listed_ms_per_step"])
    assert rep["idle_ms_per_step"] == pytest.approx((0.655 + 0.13) / 2)
    assert rep["by_next_launch"]["aten::mul / cudaLaunchKernel"]["ms_per_step"] == pytest.approx(0.1625)


def test_threshold_and_listing_cap(ps: Any) -> None:
    rep = ps.idle_report(synthetic_trace(ps.STEP_RANGE), cuda=True, threshold_us=100.0, max_listed=1)
    s0 = rep["per_step"][0]
    # 325 and 200 are over 100 us; 90 joins the small ones; only one listed, one counted
    assert s0["small_gaps"]["count"] == 3 and s0["idle_listed_ms"] == pytest.approx(0.525)
    assert len(s0["gaps"]) == 1 and s0["gaps_not_listed"] == 1
    assert sum(v["ms_per_step"] for v in rep["by_op"].values()) == pytest.approx(
        rep["idle_listed_ms_per_step"]
    )


def test_without_step_ranges_the_whole_trace_is_one_window(ps: Any) -> None:
    events = [e for e in synthetic_trace(ps.STEP_RANGE) if e["name"] != ps.STEP_RANGE]
    assert ps.step_windows(events) == [(10, 2300)]
    rep = ps.idle_report(events, cuda=True)
    assert rep["steps"] == 1 and rep["per_step"][0]["idle_ms"] > 0


def test_real_cpu_profile(ps: Any) -> None:
    """A real torch.profiler trace (CPU): the ops' spans are the work, the gaps between them
    host Python; the report's sums add up and every listed gap is over the threshold."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function(ps.STEP_RANGE):
                y = x @ x
                acc = 0.0
                for _ in range(20000):  # host-only Python: the "device" idles
                    acc += 1.0
                y = torch.relu(y + acc)
    rep = ps.idle_report(ps.trace_events(prof), cuda=False, threshold_us=50.0)
    assert rep["steps"] == 2
    for st in rep["per_step"]:
        assert 0 < st["idle_listed_ms"] <= st["idle_ms"] <= st["window_ms"]
        assert st["gaps"] and all(g["dur_us"] > 50.0 for g in st["gaps"])
    assert sum(v["ms_per_step"] for v in rep["by_op"].values()) == pytest.approx(
        rep["idle_listed_ms_per_step"]
    )
