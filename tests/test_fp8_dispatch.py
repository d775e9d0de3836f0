"""FP8 GEMM dispatch tuned from the H200 measurements, on CPU:

- "auto" follows the measured table (ops/fp8/triton_gemm.TUNED_CONFIGS) and its
  fallback; every config in the table computes the reference's function (Triton interpreter);
- the cuBLAS block-wise call meets the layout cuBLAS demands on the H200 for ragged shapes
  ("scale_b must have shape 12 x 8 ... got [11, 8]" otherwise): checked with a stand-in for
  F.scaled_mm, which has no block-wise CPU kernel, that enforces those rules and computes the
  product through the reference;
- the reference's scale is the IEEE quotient amax / 448.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import triton_interp

from ops.fp8 import dispatch as fl
from ops.fp8 import recipe as ref
from ops.fp8 import triton_gemm as kern

CUDA = torch.device("cuda")  # only its type is read: table hits never touch a GPU
CPU = torch.device("cpu")


def test_auto_follows_measured_table_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    # The table was measured on Hopper, where the CUDA kernel's entries apply (elsewhere they fall
    # back to cuBLAS: tests/test_fp8_tuning.py).
    monkeypatch.setattr(fl, "cuda_kernel_usable", lambda device: device.type == "cuda")
    for (bucket, n, k), want in kern.TUNED_CONFIGS.items():
        i = kern.M_BUCKETS.index(bucket)
        lo = kern.M_BUCKETS[i - 1] + 1 if i else 1
        for m in (lo, bucket):  # both ends of the bucket get the bucket's measurement
            assert fl.auto_choice(m, n, k, CUDA) == want, (m, n, k)
            backend = want if want in (kern.TORCH, kern.CUDA) else "triton"
            assert fl.resolve_backend("auto", m, CUDA, n, k) == backend
    # The committed table file itself (raw JSON, not the loader) is what "auto" follows: every
    # measured shape picks its recorded winner, not the heuristic's.
    raw = json.loads(kern.TABLE_PATH.read_text())
    assert raw["dense"], "the committed table has no dense entries"
    for e in raw["dense"]:
        want = kern.GemmConfig(**e["config"]) if e["choice"] == "triton" else e["choice"]
        assert fl.auto_choice(e["m"], e["n"], e["k"], CUDA) == want, e
    # Above the largest bucket a shape follows the largest bucket's measurement.
    top = kern.M_BUCKETS[-1]
    for (bucket, n, k), want in kern.TUNED_CONFIGS.items():
        if bucket == top:
            assert fl.auto_choice(4 * top + 3, n, k, CUDA) == want, (n, k)


def test_auto_fallback_for_unmeasured_shapes() -> None:
    # Unseen (N, K): Triton heuristic up to TRITON_MAX_M, cuBLAS above.
    assert fl.auto_choice(fl.TRITON_MAX_M, 3072, 1024, CPU) == kern.pick_config(fl.TRITON_MAX_M, 3072, 1024)
    assert fl.auto_choice(fl.TRITON_MAX_M + 1, 3072, 1024, CPU) == kern.TORCH
    assert isinstance(fl.auto_choice(64, None, None, CPU), kern.GemmConfig)  # no (N, K): M decides
    assert fl.auto_choice(4096, None, None, CPU) == kern.TORCH
    # The heuristic keeps run 1's winning family at decode M: one wgmma warpgroup of 64 rows.
    cfg = kern.pick_config(64, 7168, 2048)
    assert (cfg.block_m, cfg.block_n, cfg.split_k, cfg.num_warps) == (64, 128, 1, 4)
    assert kern.pick_config(64, 256, 7168).split_k == 2  # 4 tiles on 132 SMs over 56 K blocks
    # CPU never uses the table.
    assert fl.resolve_backend("auto", 64, CPU, 7168, 2048) == "reference"


def test_table_entries_are_launchable_configs() -> None:
    for (bucket, n, k), cfg in kern.TUNED_CONFIGS.items():
        assert bucket in kern.M_BUCKETS
        # dispatch at that bucket's M reads exactly this entry
        assert kern.tuned_choice(bucket, n, k) == cfg, (bucket, n, k)
        if cfg in (kern.TORCH, kern.CUDA):
            continue
        assert isinstance(cfg, kern.GemmConfig)
        for v in (cfg.block_m, cfg.block_n):
            assert v in (16, 32, 64, 128, 256), cfg
        k_blocks = k // 128
        # the launcher would silently clamp a larger split; each split must own >= 2 K blocks
        assert cfg.split_k == max(1, min(cfg.split_k, k_blocks)), cfg
        assert k_blocks // cfg.split_k >= 2, (k, cfg)
        # bench/fp8/tune.py's grid goes to 6 stages (decode M: deep weight-streaming pipelines)
        assert cfg.num_warps in (4, 8) and 2 <= cfg.num_stages <= 6, cfg


TABLE_CHECK = textwrap.dedent(
    """
    import json, torch
    from ops.fp8.recipe import quantize_act, quantize_weight, fp8_gemm_reference
    from ops.fp8.triton_gemm import (
        TUNED_CONFIGS, GemmConfig, triton_fp8_gemm, triton_fp8_linear_fused, triton_quantize_act)
    g = torch.Generator().manual_seed(0)
    cfgs = list(dict.fromkeys(c for c in TUNED_CONFIGS.values() if isinstance(c, GemmConfig)))
    # Split-K with a ragged split (two-kernel and in-kernel reduction) and a large-M tile.
    cfgs += [GemmConfig(64, 128, 3, 1, 4, 2), GemmConfig(128, 64, 1, 8, 4, 2)]
    cfgs += [GemmConfig(32, 64, 3, 1, 4, 2, fused_reduce=True)]
    out = []
    for i, cfg in enumerate(cfgs):
        # Ragged M/N/K (edge tiles masked), K long enough for split-K to split.
        m, n, k = (70, 200, 1100) if cfg.block_m < 128 else (130, 260, 700)
        x, w = torch.randn(m, k, generator=g) * 3, torch.randn(n, k, generator=g)
        aq, as_ = quantize_act(x); wq, ws = quantize_weight(w)
        want = fp8_gemm_reference(aq, as_, wq, ws)
        got = triton_fp8_gemm(aq, as_, wq, ws, torch.float32, cfg)
        out.append({"cfg": cfg.name(), "err": ((got - want).norm() / want.norm()).item()})
    # The fused quantise+GEMM kernel: the same bits as the quantiser kernel + the GEMM kernel
    # (both go through the interpreter's fp8 cast, so CPU can compare them exactly).
    fused = []
    for (m, n, k), cfg, pow2, dt in [((5, 200, 300), GemmConfig(16, 64, 2, 1, 4, 2), False, torch.float32),
                                     ((70, 260, 700), None, True, torch.bfloat16),
                                     ((37, 130, 1100), GemmConfig(64, 128, 3, 1, 4, 2), False, torch.float32)]:
        x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g))).to(dt)
        wq, ws = quantize_weight(torch.randn(n, k, generator=g))
        q, s = triton_quantize_act(x, pow2)
        two = triton_fp8_gemm(q, s, wq, ws, torch.float32, cfg)
        fused.append(bool(torch.equal(two, triton_fp8_linear_fused(x, wq, ws, torch.float32, cfg, pow2))))
    print(json.dumps({"table": out, "fused_equal": fused}))
    """
)


@pytest.mark.slow  # the Triton interpreter runs every program in Python (~20-60 s)
def test_table_configs_and_fused_kernel_match_under_interpreter() -> None:
    res = triton_interp.run_script_interpreted(TABLE_CHECK, timeout_s=600)
    table = res["table"]
    assert len(table) >= 5 and any(c["cfg"].endswith("_fr") for c in table)
    for case in table:
        assert case["err"] < 1e-5, case  # fp32 output: summation order only
    assert res["fused_equal"] == [True, True, True]  # split-K, pow2 + bf16 input, ragged


def _cublas_blockwise_standin(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    recipe_a: object,
    scale_b: torch.Tensor,
    recipe_b: object,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """F.scaled_mm block-wise has no CPU kernel: enforce the layout cuBLAS demands on the H200
    (K blocks of scale_b padded to a multiple of 4; M a multiple of 4, as reported by other
    users of this path), then compute the product."""
    assert recipe_a == F.ScalingType.BlockWise1x128 and recipe_b == F.ScalingType.BlockWise128x128
    m, k = a.shape
    n = b.shape[1]
    assert k % 128 == 0 and n % 128 == 0 and m % 4 == 0, (m, n, k)
    kb, kb4 = k // 128, -(-k // 512) * 4
    assert a.stride(1) == 1 and b.stride(0) == 1  # a row-major, b = w.t() column-major
    assert tuple(scale_a.shape) == (m, kb) and scale_a.stride(0) == 1, (scale_a.shape, scale_a.stride())
    assert tuple(scale_b.shape) == (kb4, n // 128), (scale_b.shape, kb4)
    assert scale_b.stride() == (1, kb4), scale_b.stride()
    w_scale = scale_b[:kb].t().contiguous()
    return ref.fp8_gemm_reference(a, scale_a.contiguous(), b.t().contiguous(), w_scale, output_dtype)


@pytest.mark.parametrize("shape", [(5, 384, 640), (300, 1000, 1300), (77, 1000, 1100), (64, 256, 2048)])
def test_scaled_mm_call_meets_cublas_layout(
    shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    m, n, k = shape
    g = torch.Generator().manual_seed(m)
    aq, as_ = ref.quantize_act(torch.randn(m, k, generator=g))
    wq, ws = ref.quantize_weight(torch.randn(n, k, generator=g))
    monkeypatch.setattr(F, "scaled_mm", _cublas_blockwise_standin)
    want = ref.fp8_gemm_reference(aq, as_, wq, ws)
    for a_scale in (as_, as_.t().contiguous().t()):  # the reference's row-major and Triton's layout
        got = ref._scaled_mm_blockwise(aq, a_scale, wq, ws, torch.float32)
        assert got.shape == (m, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_scale_is_the_ieee_quotient() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4096, generator=g) * torch.exp(3 * torch.randn(64, 4096, generator=g))
    _, s = ref.quantize_act(x)
    amax = x.unflatten(-1, (-1, 128)).abs().amax(-1)
    exact = (amax.double() / 448.0).float()  # float64 quotient rounded once: the IEEE fp32 quotient
    assert torch.equal(s, exact)
    assert not torch.equal(exact, amax * (1.0 / 448.0))  # a reciprocal multiply would differ
