"""The Triton GEMM's candidate-only kernels (bench/kernels/triton_gemm_variants.py) under the
Triton interpreter: the persistent TMA kernel (ragged M, lagged scaling, warp-specialised loop)
and the tiled lagged-scaling loop equal the dequantised reference; a plain config is the product's
config and runs the product kernel; the table takes product configs only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import json, torch
    from ops.fp8.recipe import quantize_act, quantize_weight, fp8_gemm_reference
    from ops.fp8 import triton_gemm as kern
    from bench.kernels.triton_gemm_variants import VariantConfig, supports, variant_fp8_gemm
    g = torch.Generator().manual_seed(0)
    cases = [((130, 272, 640), VariantConfig(128, 128, 1, 8, 8, 3, kernel="tma")),
             ((130, 272, 640), VariantConfig(64, 256, 1, 2, 8, 3, kernel="tma", lag=True)),
             ((300, 256, 512), VariantConfig(128, 256, 1, 8, 8, 3, kernel="tma", warp_spec=True)),
             ((130, 260, 700), VariantConfig(128, 64, 1, 8, 4, 2, lag=True)),
             ((70, 200, 1100), VariantConfig(64, 128, 3, 1, 4, 2))]
    out = []
    for (m, n, k), cfg in cases:
        x, w = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g)
        aq, as_ = quantize_act(x); wq, ws = quantize_weight(w)
        want = fp8_gemm_reference(aq, as_, wq, ws)
        got = variant_fp8_gemm(aq, as_, wq, ws, torch.float32, cfg)
        out.append({"cfg": cfg.name(), "err": ((got - want).norm() / want.norm()).item()})
    plain = VariantConfig(64, 128, 3, 1, 4, 2).product()
    print(json.dumps({"cases": out, "plain": plain == kern.GemmConfig(64, 128, 3, 1, 4, 2),
                      "tma_product": VariantConfig(128, 128, kernel="tma").product() is None,
                      "unaligned": supports(VariantConfig(128, 128, kernel="tma"), 64, 128, 200)}))
    """
)


@pytest.mark.slow  # the Triton interpreter runs every program in Python (~30 s)
def test_variant_kernels_match_reference_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    names = [c["cfg"] for c in res["cases"]]
    assert [
        n.endswith(t) for n, t in zip(names, ("_tma", "_lag_tma", "_tma_ws", "_lag", "_st2"), strict=True)
    ] == [True] * 5
    for case in res["cases"]:
        assert case["err"] < 1e-5, case  # fp32 output: summation order only
    assert res["plain"] and res["tma_product"] and not res["unaligned"]


def test_candidate_options_are_checked() -> None:
    sys.path.insert(0, str(REPO))
    from bench.kernels.triton_gemm_variants import VariantConfig

    with pytest.raises(ValueError, match="kernel"):
        VariantConfig(kernel="cutlass")
    with pytest.raises(ValueError, match="split-K"):
        VariantConfig(128, 128, 2, kernel="tma")
