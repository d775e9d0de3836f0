"""bench/fp8/gemm.py's self-check bounds pass correctly rounded results and catch real defects (CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from ops.fp8 import recipe as ref

REPO = Path(__file__).resolve().parents[2]
# bench/ is scripts, not a package: load the GEMM benchmark's self-check functions from its file.
_spec = importlib.util.spec_from_file_location("fp8_gemm_bench", REPO / "bench" / "fp8" / "gemm.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_self_check_bounds_pass_rounding_and_catch_defects() -> None:
    g = torch.Generator().manual_seed(0)
    m, n, k = 40, 300, 1300
    aq, as_ = ref.quantize_act(torch.randn(m, k, generator=g))
    wq, ws = ref.quantize_weight(torch.randn(n, k, generator=g) * 0.02)
    want = ref.fp8_gemm_reference(aq, as_, wq, ws)
    absref = ref.fp8_gemm_reference(bench.fp8_abs(aq), as_, bench.fp8_abs(wq), ws)
    assert torch.isfinite(absref).all()
    assert (absref >= want.abs() - 1e-4).all()
    # Correct results: exact, correctly rounded to bf16, and the error H200 run 1 measured for every
    # wgmma config (1.27e-4 Frobenius, ~2^-13 relative).
    wgmma_like = want * (1 + 2.0**-13 * torch.sign(torch.randn(m, n, generator=g)))
    assert bench.accuracy(want, want.to(torch.bfloat16), want, absref, "mma")["ok"]
    assert bench.accuracy(wgmma_like, wgmma_like.to(torch.bfloat16), want, absref, "wgmma")["ok"]
    assert not bench.accuracy(wgmma_like, None, want, absref, "mma")["ok"]  # mma is held tighter
    # Defects: a dropped K block, the ragged last K block (20 wide) dropped, a wrong edge tile.
    no_kb = ref.fp8_gemm_reference(aq[:, 128:], as_[:, 1:], wq[:, 128:], ws[:, 1:])
    no_tail = ref.fp8_gemm_reference(aq[:, :1280], as_[:, :10], wq[:, :1280], ws[:, :10])
    bad_edge = want.clone()
    bad_edge[:, 256:] = want[:, 212:256]  # last N tile (44 columns) read from wrapped columns
    bad_scale = want.clone()
    bad_scale[:, 256:] *= 1.01  # a 1% error on that tile: caught by the fp32 check
    assert not bench.accuracy(bad_scale, None, want, absref, "wgmma")["ok"]
    for bad in (no_kb, no_tail, bad_edge):
        for kind in ("mma", "wgmma"):
            assert not bench.accuracy(bad, None, want, absref, kind)["ok"]
            assert not bench.accuracy(None, bad.to(torch.bfloat16), want, absref, kind)["ok"]
