"""The dataflow kernel probe (bench/engine/dataflow_probe.py + dataflow_kernel.cu) on a machine
without a GPU: the weight packing the kernel's producer streams, read back the way the kernel's
consumers index it, computes the torch chain; and the CUDA source still builds and exports the
shapes the Python side packs for. Its speed and its result on a GPU are the probe's to measure."""

from __future__ import annotations

import pytest
import torch

from bench.engine import dataflow_probe as probe
from bench.engine.gemv_chain import random_weights, reference
from ops.fp8.cuda import nvcc


def test_packed_tiles_compute_the_reference_chain() -> None:
    weights, h0 = random_weights(2, torch.device("cpu"))
    want = reference(weights, h0, 2)
    got = probe.emulate(probe.pack(weights, 2), h0, 2)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-2


def test_a_wrong_tile_order_is_caught() -> None:
    """The check above can fail: stages of each program's q/k/v slice swapped give another result."""
    weights, h0 = random_weights(1, torch.device("cpu"))
    packed = probe.pack(weights, 1)
    r, k, ck = probe.PHASES[0][1:]
    qkv = packed[:, :, : r * k].view(1, probe.P, k // ck, r * ck)
    packed[:, :, : r * k] = qkv.flip(2).reshape(1, probe.P, r * k)
    got = probe.emulate(packed, h0, 1)
    want = reference(weights, h0, 1)
    assert float((got - want).abs().max() / want.abs().max()) > 0.1


def test_kernel_builds_and_agrees_on_shapes(tmp_path) -> None:  # noqa: ANN001
    if nvcc.nvcc_path() is None:
        pytest.skip("nvcc not installed")
    lib = probe.bind(nvcc.build(probe.SOURCE, tmp_path / "dataflow.so"))
    assert lib.relay_dataflow_layer_bytes() == 2 * probe.LAYER_ELEMS == 245760
    assert lib.relay_dataflow_programs() == probe.P
    assert lib.relay_dataflow_trace_marks() == len(probe.TRACE_MARKS)
    nothing = [None, 0, None, None, None, None, None, None, 1, 0]  # buffers, layers, base
    launch = lib.relay_dataflow_launch
    assert launch(*nothing, 0, 1, 5, 0, None, None) == -3  # 4 or 8 warps
    assert launch(*nothing, 7, 1, 4, 0, None, None) == -1  # unknown mode


def test_trace_summary_reads_the_intervals_and_the_exchange_latency() -> None:
    """A synthetic trace with known timings: each phase waits 3 us, loads 1, computes 2 and
    publishes in 0.5; program p publishes p ns late; the next phase releases every program 4 us
    after the last program's publication."""
    layers, marks = 4, len(probe.TRACE_MARKS)
    t = torch.zeros(layers * 4, probe.P, marks, dtype=torch.int64)
    skew = torch.arange(probe.P)
    last_pub = 0
    for i in range(layers * 4):
        release = last_pub + 4000
        t[i, :, 0] = release - 3000
        t[i, :, 1] = release
        t[i, :, 2] = release + 1000
        t[i, :, 3] = release + 3000
        t[i, :, 4] = release + 3500 + skew
        last_pub = int(t[i, :, 4].max())
    got = probe.trace_summary(t.view(layers, 4, probe.P, marks))
    for name, *_ in probe.PHASES:
        ph = got["phases"][name]
        assert ph["wait_us"] == pytest.approx(3.0)
        assert ph["inputs_us"] == pytest.approx(1.0)
        assert ph["gemv_us"] == pytest.approx(2.0)
        assert ph["publish_us"] == pytest.approx(0.5, abs=0.07)  # + the skew's median
        assert ph["release_after_last_publish_us"] == pytest.approx(4.0)
        assert ph["publish_spread_us"] == pytest.approx((probe.P - 1) / 1e3)
    assert got["layer_us"] == pytest.approx(4 * (4.0 + 3.5 + (probe.P - 1) / 1e3))
