"""Trainer MFU paths on CPU: the fast paths compute what the plain ones do.

- the chunked log-prob head's per-chunk math (the torch form; the Triton form is checked against
  it in tests/test_head_kernel.py) equals the full log-softmax path, values and gradients;
- the weight-gradient GEMM helper equals the float32 product;
- trainer.sdpa_backend / sdpa_expand_kv reach every block, and expanding the kv heads gives
  enable_gqa's outputs and gradients.
The speed itself is measured on the H200 (bench/trainer/).
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from services.common.config import ModelConfig, TrainerSection
from trainer.attention import SDPA_PRIORITY, DocumentAttention, expand_kv
from trainer.chunked import (
    _mm_float32,
    chunk_onehot_minus_p,
    chunk_stats,
    enable_chunked_output,
)
from trainer.loss import logprobs_from_logits
from trainer.model import build_model
from trainer.parallel import parallelize


def _head_case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(29, 16, generator=g).to(dtype)
    w = (0.5 * torch.randn(97, 16, generator=g)).to(dtype)
    t = torch.randint(0, 97, (29,), generator=g)
    up = torch.randn(29, generator=g)
    return h, w, t, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_math_equals_full_log_softmax(dtype: torch.dtype) -> None:
    h, w, t, up = _head_case(dtype)
    logits = h @ w.t()  # in the model dtype, as the head computes it
    ref_lp, ref_ent = logprobs_from_logits(logits, t)
    lse, lp, ent = chunk_stats(logits.clone(), t)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1), rtol=1e-6, atol=1e-6)
    # d(sum up * logp)/d logits from autograd through the full path, in float32: up * q row by
    # row (the head scales the GEMMs' [c x D] operands by up instead of q).
    x = logits.float().requires_grad_(True)
    (ref_d,) = torch.autograd.grad((logprobs_from_logits(x, t)[0] * up).sum(), x)
    q = chunk_onehot_minus_p(logits.clone(), lse, t, dtype)
    assert q.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q.float() * up[:, None], ref_d, rtol=tol, atol=tol)
    assert float(ref_d.abs().max()) > 1e-2  # the comparison means something


def test_weight_gradient_gemm_equals_float32_product() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 33, generator=g)
    b = torch.randn(33, 16, generator=g)
    torch.testing.assert_close(_mm_float32(a, b), a @ b, rtol=0, atol=0)
    ab, bb = a.bfloat16(), b.bfloat16()
    out = _mm_float32(ab.t().contiguous().t(), bb)  # a transposed view, as d.t() in the head
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ab.float() @ bb.float(), rtol=1e-6, atol=1e-5)


# ------------------------------------------------------------------ SDPA backend knobs

M = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64)


def test_sdpa_knobs_validate_and_reach_every_block() -> None:
    with pytest.raises(ValidationError, match="sdpa_backend"):
        TrainerSection(sdpa_backend="fastest")  # type: ignore[arg-type]
    model = enable_chunked_output(build_model(M, seed=0))
    tc = TrainerSection(sdpa_backend="efficient", sdpa_expand_kv=True)
    model, _, _ = parallelize(model, tc, 1, torch.device("cpu"), distributed=False)
    inner = [layer.attention.inner_attention for layer in model.layers.values()]  # type: ignore[union-attr]
    assert len(inner) == 2 and all(isinstance(m, DocumentAttention) for m in inner)
    assert all(m.expand_kv and m.sdpa_backends == SDPA_PRIORITY["efficient"] for m in inner)
    # The default is what the trainer always ran: torchtitan's own priority list.
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    assert DocumentAttention().sdpa_backends == ScaledDotProductAttentionWrapper().sdpa_backends
    for name, order in SDPA_PRIORITY.items():  # every forced list still ends in the CPU's MATH
        assert order[-1] == torch.nn.attention.SDPBackend.MATH, name


@pytest.mark.parametrize("masked", [False, True])
def test_expanded_kv_equals_enable_gqa(masked: bool) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 21, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 21, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 21, 8, generator=g, requires_grad=True)
    dout = torch.randn(1, 4, 21, 8, generator=g)
    from trainer.packing import block_causal_mask

    outs = []
    for expand in (False, True):
        m = DocumentAttention("sdpa", "auto", expand_kv=expand)
        m.mask = block_causal_mask([9, 12]) if masked else None
        out = m(q, k, v, scale=8**-0.5, enable_gqa=True)
        outs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    ke, _ = expand_kv(k, v, 4)
    assert ke.shape == (1, 4, 21, 8) and torch.equal(ke[:, 1], k[:, 0]) and torch.equal(ke[:, 2], k[:, 1])
