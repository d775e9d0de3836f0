"""trainer/head_kernel.py (the chunked LM head's softmax math in Triton) against the torch math
of trainer/chunked.py: the statistics in one pass over the vocabulary, onehot - p, and the whole
head with `fused` on, cached and recomputing. On CPU under Triton's interpreter, on a GPU compiled."""

from __future__ import annotations

import pytest
import torch
from helpers import triton_interp

INTERPRET, IN_CHILD, needs_interpreter, triton_interpreter, test_kernel_tests_in_child_process = (
    triton_interp.kernel_test_module(("trainer.head_kernel",), __file__)
)


from trainer import head_kernel  # noqa: E402
from trainer.chunked import chunk_onehot_minus_p, chunk_stats, chunked_logprobs  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _logits(rows: int, vocab: int, scale: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(rows, vocab, generator=g)).to(dtype).to(DEV)


@needs_interpreter
@pytest.mark.parametrize(
    ("vocab", "scale", "dtype"),
    [
        (300, 3.0, torch.float32),  # one partial tile
        (2 * head_kernel.STATS_BLOCK + 77, 2.0, torch.float32),  # several tiles, a ragged last one
        (1000, 4.0, torch.bfloat16),  # model-dtype logits (trainer.logits_fp32 off)
        (700, 80.0, torch.float32),  # extreme logits: p is one-hot to float32 precision
    ],
)
def test_row_stats_and_q_match_the_torch_math(vocab: int, scale: float, dtype: torch.dtype) -> None:
    x = _logits(5, vocab, scale, dtype, seed=vocab)
    t = torch.randint(0, vocab, (5,), generator=torch.Generator().manual_seed(1)).to(DEV)
    lse, logp, ent = head_kernel.row_stats(x, t)
    z, lp, e = chunk_stats(x.clone(), t)
    torch.testing.assert_close(lse, z, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(logp, lp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent, e, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ent).all() and float(ent.min()) >= -1e-5
    ls = x.double().log_softmax(-1)  # both against float64: no cancellation at extreme logits
    torch.testing.assert_close(ent.double(), -(ls.exp() * ls).sum(-1), rtol=1e-4, atol=1e-5)
    for out in (torch.float32, torch.bfloat16):
        q = head_kernel.onehot_minus_p(x, z, t, out)
        want = chunk_onehot_minus_p(x, z, t, out)
        assert q.dtype == out
        torch.testing.assert_close(
            q.float(), want.float(), rtol=1e-5 if out == torch.float32 else 8e-3, atol=1e-7
        )
        # each row sums to 0 (onehot and p both sum to 1); the target's entry is 1 - p > -1e-6
        assert float(q.float().sum(-1).abs().max()) < 1e-3 * (1 if out == torch.float32 else 30)
        assert float(q.float().gather(-1, t[:, None]).min()) > -1e-6


@needs_interpreter
def test_kernels_take_a_strided_chunk_and_refuse_bad_shapes() -> None:
    """A chunk of a larger [N, V] buffer (row stride > V) and an empty chunk; a transposed view
    and mismatched targets are refused with a message."""
    big = _logits(6, 400, 2.0, torch.float32, seed=3)[:, :300]
    t = torch.arange(6, device=DEV) * 7
    lse, logp, _ = head_kernel.row_stats(big, t)
    z, lp, _ = chunk_stats(big.contiguous(), t)
    torch.testing.assert_close(lse, z, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(logp, lp, rtol=1e-6, atol=1e-5)
    empty = head_kernel.row_stats(big[:0], t[:0])
    assert all(v.shape == (0,) for v in empty)
    with pytest.raises(ValueError, match="contiguous rows"):
        head_kernel.row_stats(big.t(), t)
    with pytest.raises(ValueError, match="targets"):
        head_kernel.onehot_minus_p(big, z, t[:3], torch.float32)


@needs_interpreter
@pytest.mark.parametrize("cache", [1.0, 0.0])
def test_fused_head_equals_eager(cache: float) -> None:
    """chunked_logprobs with fused=True (these kernels) against fused=False (torch): logp,
    entropy and both gradients, the cached and the recomputing backward, float32."""
    g = torch.Generator().manual_seed(11)
    h0 = torch.randn(26, 32, generator=g).to(DEV)
    w0 = (0.3 * torch.randn(300, 32, generator=g)).to(DEV)
    t = torch.randint(0, 300, (26,), generator=g).to(DEV)
    coef = torch.randn(26, generator=g).to(DEV)
    res = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logp, ent = chunked_logprobs(h, w, t, 8, fused=fused, cache_gib=cache)
        gh, gw = torch.autograd.grad((logp * coef).sum(), (h, w))
        res.append((logp, ent, gh, gw))
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w"), *res, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    assert float(res[0][3].abs().max()) > 1e-3
