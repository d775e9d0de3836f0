"""FP8 block-scaled quantisation and GEMMs, CPU reference path.

Error bound used below (derived in docs/fp8.md): E4M3 has 3 mantissa bits, so round-to-nearest of
a normal value y has |y - q(y)| <= 2^-4 |y| (half an ulp, ulp = 2^-3 * 2^floor(log2 |y|)); below
the smallest normal 2^-6 the spacing is 2^-9, so |y - q(y)| <= 2^-10. With y = x / s this gives,
per element, |x - deq(x)| <= max(2^-4 |x|, 2^-10 s) <= 2^-4 * amax(block) (s <= 2 amax / 448)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.engine_forward import engine_logits
from torch import nn

from ops.fp8.recipe import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    convert_to_fp8,
    dequantize_act,
    dequantize_weight,
    fp8_gemm,
    fp8_gemm_reference,
    group_offsets,
    grouped_fp8_gemm,
    quantize_act,
    quantize_weight,
)
from services.common.config import ModelConfig
from services.engine.models.causal_lm import CausalLM

SLACK = 1 + 1e-6  # float32 rounding of x / s (exact for power-of-two scales)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def heavy_tailed(*shape: int, seed: int) -> torch.Tensor:
    """Values spanning several orders of magnitude (with outliers), like real activations."""
    g = gen(seed)
    return torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(*shape, generator=g))


def block_scale_per_element(scale: torch.Tensor, shape: tuple[int, int], weight: bool) -> torch.Tensor:
    n, k = shape
    s = scale.repeat_interleave(BLOCK, dim=-1)[..., :k]
    return s.repeat_interleave(BLOCK, dim=0)[:n] if weight else s


def assert_within_e4m3_bound(x: torch.Tensor, deq: torch.Tensor, s: torch.Tensor) -> None:
    err = (x - deq).abs()
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s) * SLACK
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("k", [128, 384, 200, 77])
def test_act_roundtrip_error_bound(k: int, pow2: bool) -> None:
    x = heavy_tailed(33, k, seed=k)
    q, s = quantize_act(x, pow2=pow2)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (33, -(-k // BLOCK))
    deq = dequantize_act(q, s)
    s_el = block_scale_per_element(s, (33, k), weight=False)
    assert_within_e4m3_bound(x, deq, s_el)
    # Block-relative form of the same bound: error <= 2^-4 of the block's max |x|.
    blk_amax = torch.nn.functional.pad(x.abs(), (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK)).amax(-1)
    amax = block_scale_per_element(blk_amax, (33, k), weight=False)
    assert bool(((x - deq).abs() <= 2.0**-4 * amax * SLACK).all())
    # Every block uses the full range: its max maps to 448 (pow2: to [224, 448]).
    qmax = dequantize_act(q, torch.ones_like(s)).abs()
    blk_max = torch.nn.functional.pad(qmax, (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK)).amax(-1)
    assert bool((blk_max <= FP8_MAX).all())
    assert bool((blk_max >= (FP8_MAX / 2 if pow2 else FP8_MAX)).all())


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 77), (5, 130)])
def test_weight_roundtrip_error_bound(shape: tuple[int, int], pow2: bool) -> None:
    w = heavy_tailed(*shape, seed=sum(shape)) * 0.02
    q, s = quantize_weight(w, pow2=pow2)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.shape == (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    deq = dequantize_weight(q, s)
    assert_within_e4m3_bound(w, deq, block_scale_per_element(s, shape, weight=True))
    # Relative error in aggregate is ~2^-5 or better for Gaussian-like data.
    rel = ((w - deq).norm() / w.norm()).item()
    assert rel < 2.0**-4


def test_scales_are_powers_of_two_and_not_below_exact_scale() -> None:
    x = heavy_tailed(16, 512, seed=3)
    _, s_exact = quantize_act(x)
    _, s2 = quantize_act(x, pow2=True)
    mant, _ = torch.frexp(s2)
    assert bool((mant == 0.5).all())  # s2 = 0.5 * 2^e exactly
    assert bool((s2 >= s_exact).all()) and bool((s2 < 2 * s_exact).all())
    _, ws2 = quantize_weight(x[:, :300], pow2=True)
    assert bool((torch.frexp(ws2)[0] == 0.5).all())


def test_zero_block_and_exact_values() -> None:
    x = torch.zeros(2, 256)
    # |integers| <= 16 have <= 4 significant bits: exact in E4M3, and so after a power-of-two scale.
    x[1, 128:] = (torch.arange(128) % 33 - 16.0) * 2.0**-7
    q, s = quantize_act(x, pow2=True)
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())
    torch.testing.assert_close(dequantize_act(q, s), x, atol=0, rtol=0)


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(2, 3, 4))
    a, sa = quantize_act(torch.randn(4, 256))
    w, sw = quantize_weight(torch.randn(64, 200))
    with pytest.raises(ValueError, match="K"):
        fp8_gemm(a, sa, w, sw)
    w, sw = quantize_weight(torch.randn(64, 256))
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm(a, sa[:, :1], w, sw)
    with pytest.raises(TypeError):
        fp8_gemm(a.float(), sa, w, sw)
    with pytest.raises(ValueError, match="backend"):
        fp8_gemm(a, sa, w, sw, backend="cutlass")
    with pytest.raises(RuntimeError, match="CUDA"):
        fp8_gemm(a, sa, w, sw, backend="torch")


@pytest.mark.parametrize("mnk", [(64, 256, 384), (7, 200, 300), (1, 128, 77), (130, 96, 1024)])
def test_reference_gemm_equals_dequantized_matmul(mnk: tuple[int, int, int]) -> None:
    m, n, k = mnk
    x = heavy_tailed(m, k, seed=m)
    w = torch.randn(n, k, generator=gen(n)) * 0.05
    a, sa = quantize_act(x)
    b, sb = quantize_weight(w)
    out = fp8_gemm(a, sa, b, sb, out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    ref = (dequantize_act(a, sa).double() @ dequantize_weight(b, sb).double().T).float()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # bf16 output is the same numbers rounded once.
    bf = fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf.float(), out, rtol=2**-8, atol=1e-6)
    # And the whole thing approximates the unquantised product at the E4M3 level.
    exact = x.double() @ w.double().T
    rel = ((out.double() - exact).norm() / exact.norm()).item()
    assert rel < 0.05, rel


def test_grouped_gemm_equals_per_expert_loop() -> None:
    e, n, k = 4, 200, 384
    sizes = [5, 0, 17, 9]
    x = heavy_tailed(sum(sizes), k, seed=11)
    ws = torch.randn(e, n, k, generator=gen(12)) * 0.05
    a, sa = quantize_act(x)
    qs = [quantize_weight(ws[i]) for i in range(e)]
    b = torch.stack([q for q, _ in qs])
    sb = torch.stack([s for _, s in qs])
    offs = group_offsets(sizes)
    assert offs.tolist() == [5, 5, 22, 31] and offs.dtype == torch.int32
    out = grouped_fp8_gemm(a, sa, b, sb, offs, out_dtype=torch.float32)
    start = 0
    for i, size in enumerate(sizes):
        rows = slice(start, start + size)
        want = fp8_gemm(a[rows], sa[rows], b[i], sb[i], out_dtype=torch.float32)
        torch.testing.assert_close(out[rows], want, atol=0, rtol=0)
        start += size
    with pytest.raises(ValueError, match="offs"):
        grouped_fp8_gemm(a, sa, b, sb, [5, 5, 22, 30])
    with pytest.raises(ValueError, match="offsets"):
        grouped_fp8_gemm(a, sa, b, sb, [5, 31])


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (96, 200)])
def test_fp8_linear_close_to_linear(shape: tuple[int, int], pow2: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(shape[1], shape[0], bias=True)
    f8 = Fp8Linear.from_linear(lin, pow2_scales=pow2)
    x = torch.randn(3, 5, shape[1])
    with torch.no_grad():
        ref, out = lin(x), f8(x)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel < 0.05, rel
        # Exactly the reference GEMM on the quantised operands.
        xq, xs = quantize_act(x.reshape(-1, shape[1]), pow2)
        want = dequantize_act(xq, xs) @ f8.dequantized_weight().T + lin.bias
        torch.testing.assert_close(out.reshape(-1, shape[0]), want, rtol=1e-5, atol=1e-5)
        # A weight update re-quantises in place.
        f8.load_weight(lin.weight * 2, lin.bias)
        torch.testing.assert_close(
            f8.dequantized_weight(), dequantize_weight(*quantize_weight(lin.weight * 2, pow2))
        )


@pytest.mark.parametrize("dims", [(256, 384, 64), (192, 320, 48)], ids=["aligned", "ragged"])
def test_engine_decoder_with_fp8_linears_close(dims: tuple[int, int, int]) -> None:
    dim, hidden, head_dim = dims
    m = ModelConfig(
        vocab_size=512,
        dim=dim,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=head_dim,
        hidden_dim=hidden,
        max_seq_len=64,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    ref_model = CausalLM(m, 64).eval()
    fp8_model = copy.deepcopy(ref_model)
    converted = convert_to_fp8(fp8_model)
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    per_layer += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert converted == [f"model.layers.{i}.{p}" for i in range(2) for p in per_layer]
    assert isinstance(fp8_model.lm_head, nn.Linear)
    tokens = torch.randint(0, m.vocab_size, (2, 40), generator=gen(5))
    ref = engine_logits(ref_model, m, tokens)
    out = engine_logits(fp8_model, m, tokens)
    rel = ((out - ref).norm() / ref.norm()).item()
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    print(f"fp8 engine decoder {dims}: logits rel err {rel:.3e}, KL(ref||fp8) {kl:.3e}")
    assert rel < 0.05, rel
    assert kl < 1e-3, kl
