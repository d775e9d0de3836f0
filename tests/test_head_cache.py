"""The chunked LM head keeps the forward's onehot - p for its backward
(`trainer.head_cache_gib`) instead of recomputing the logits there.

On CPU (eager) the cached backward must give the SAME gradients as the recomputing one, to the
bit (torch.equal): q is the same function of the same float32 logits and lse. Also: the head equals
the plain full-vocabulary computation, the budget decides (a budget one byte short recomputes),
nothing is kept past the backward, the knob reaches the head from the config. The Triton
(`fused`) forms are checked in tests/test_head_kernel.py. The speed is measured on the H200
(docs/trainer.md).
"""

from __future__ import annotations

import gc
import math
import weakref
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from services.common.config import ModelConfig, TrainerSection
from trainer.chunked import (
    ChunkedOutput,
    chunk_onehot_minus_p,
    chunk_stats,
    chunked_logprobs,
    enable_chunked_output,
    head_cache_fits,
)
from trainer.loss import sequence_logprobs
from trainer.model import build_model

N_ROWS, SEQ, DIM, VOCAB = 2, 13, 32, 300  # 26 tokens: ragged last chunks for most chunk sizes
# The cache's size in GiB (q in the GEMM dtype): exactly within this budget.
FITS = {torch.float32: N_ROWS * SEQ * VOCAB * 4 / 2**30, torch.bfloat16: N_ROWS * SEQ * VOCAB * 2 / 2**30}


def _case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    h = torch.randn(N_ROWS, SEQ, DIM, generator=g).to(dtype)
    w = (0.3 * torch.randn(VOCAB, DIM, generator=g)).to(dtype)
    t = torch.randint(0, VOCAB, (N_ROWS, SEQ), generator=g)
    coef = torch.randn(N_ROWS, SEQ, generator=g)  # a per-token upstream gradient (advantages)
    return h, w, t, coef


def _amp(on: bool) -> AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def _head_node(out: torch.Tensor) -> Any:
    """The chunked head's autograd node (its ctx) behind `out`, through views and other ops."""
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "_ChunkedLogProbsBackward":
            return node
        todo.extend(f for f, _ in node.next_functions)
    raise AssertionError("no chunked head in the graph")


def _run(
    dtype: torch.dtype, chunk: int, cache_gib: float, *, autocast: bool = False, fp32: bool = True
) -> tuple[list[torch.Tensor], int | None]:
    """(logp, entropy, grad h, grad w) and how many chunks the forward kept (None: recompute)."""
    h0, w0, t, coef = _case(dtype)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    with _amp(autocast):
        logp, ent = chunked_logprobs(h, w, t, chunk, fp32=fp32, cache_gib=cache_gib)
    kept = _head_node(logp).q_cache
    n_kept = None if kept is None else len(kept)
    (logp * coef).sum().backward()  # outside autocast, as train_step calls it
    assert h.grad is not None and w.grad is not None
    return [logp.detach(), ent.detach(), h.grad, w.grad], n_kept


# ------------------------------------------------------------------ same gradients, to the bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [5, 8, 26, 64])  # ragged last chunk, one chunk, chunk > tokens
def test_cached_head_equals_recompute(dtype: torch.dtype, chunk: int) -> None:
    cached, n_cached = _run(dtype, chunk, cache_gib=1.0)
    recomputed, n_recomputed = _run(dtype, chunk, cache_gib=0.0)
    assert n_cached == math.ceil(N_ROWS * SEQ / chunk) and n_recomputed is None  # both paths ran
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w"), cached, recomputed, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert cached[2].dtype == dtype and cached[3].dtype == dtype
    assert float(cached[3].abs().max()) > 1e-3  # the gradients compared are not all zero


@pytest.mark.parametrize("chunk", [5, 26])
@pytest.mark.parametrize("fp32", [True, False])
def test_cached_head_equals_recompute_under_autocast(chunk: int, fp32: bool) -> None:
    """float32 weights under bf16 autocast (the single-process trainer), float32 logits or
    bf16-rounded ones (trainer.logits_fp32 off): the backward runs outside autocast."""
    cached, n_cached = _run(torch.float32, chunk, 1.0, autocast=True, fp32=fp32)
    recomputed, _ = _run(torch.float32, chunk, 0.0, autocast=True, fp32=fp32)
    assert n_cached == math.ceil(N_ROWS * SEQ / chunk)
    for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w"), cached, recomputed, strict=True):
        assert torch.equal(a, b), name


def test_chunk_math_is_the_softmax_and_its_gradient() -> None:
    """The building blocks against autograd through the full log-softmax: the stats are
    (logsumexp, log-prob of the target, entropy), and onehot - p is d(logp)/d(logits)."""
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(7, VOCAB, generator=g, dtype=torch.float64)
    t = torch.randint(0, VOCAB, (7,), generator=g)
    z, lp, ent = chunk_stats(logits.float().clone(), t)
    ls = logits.log_softmax(-1)
    torch.testing.assert_close(z, logits.logsumexp(-1).float())
    torch.testing.assert_close(lp, ls.gather(-1, t[:, None])[:, 0].float())
    torch.testing.assert_close(ent, -(ls.exp() * ls).sum(-1).float())
    x = logits.clone().requires_grad_()
    up = torch.randn(7, generator=g, dtype=torch.float64)
    (x.log_softmax(-1).gather(-1, t[:, None])[:, 0] * up).sum().backward()
    for dt in (torch.float32, torch.bfloat16):
        q = chunk_onehot_minus_p(logits.float(), z, t, dt)
        assert q.dtype == dt
        torch.testing.assert_close(
            (q.double() * up[:, None]), x.grad, rtol=0.01 if dt != torch.float32 else 1e-5, atol=1e-6
        )
    assert float(x.grad.abs().max()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_equals_the_full_logits_computation(dtype: torch.dtype) -> None:
    """logp, entropy and both gradients of the chunked head (with and without the cache) against
    autograd through float32 logits and a full log-softmax, to the GEMM dtype's rounding."""
    h0, w0, t, coef = _case(dtype)
    h, w = h0.clone().double().requires_grad_(), w0.clone().double().requires_grad_()
    ls = (h @ w.t()).log_softmax(-1)
    logp = ls.gather(-1, t[..., None])[..., 0]
    ent = -(ls.exp() * ls).sum(-1)
    gh, gw = torch.autograd.grad((logp * coef.double()).sum(), (h, w))
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.03, "atol": 0.02}
    for cache in (1.0, 0.0):
        got, _ = _run(dtype, 8, cache)
        for name, a, b in zip(("logp", "entropy", "grad_h", "grad_w"), got, (logp, ent, gh, gw), strict=True):
            torch.testing.assert_close(a.double(), b.detach(), **tol, msg=name)


# ------------------------------------------------------------------ the budget


def test_budget_decides_and_falls_back_to_the_same_result() -> None:
    fits = FITS[torch.float32]
    assert head_cache_fits(26, VOCAB, fits, 4) and not head_cache_fits(26, VOCAB, fits * (1 - 1e-6), 4)
    assert not head_cache_fits(26, VOCAB, 0.0, 4)
    assert head_cache_fits(16384, 151936, 12.0, 2)  # the 0.6B step's 16k tokens in bf16: 4.6 GiB
    assert not head_cache_fits(16384, 151936, 4.0, 2)
    bf16 = FITS[torch.bfloat16]
    exact, n_exact = _run(torch.bfloat16, 8, bf16)
    short, n_short = _run(torch.bfloat16, 8, bf16 * (1 - 1e-6))  # a few bytes short: recompute
    assert n_exact == 4 and n_short is None
    for a, b in zip(exact, short, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cache_gib"):
        chunked_logprobs(*_case(torch.float32)[:3], 8, cache_gib=-1.0)


def test_no_cache_without_a_backward_to_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad (reference log-probs) or with nothing requiring grad the forward keeps
    nothing (Function.apply still runs it; q would be computed for nothing). Counted by wrapping
    the real q function the forward looks up."""
    import trainer.chunked as chunked

    calls: list[int] = []

    def counting(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> Any:
        calls.append(int(logits.shape[0]))
        return chunk_onehot_minus_p(logits, lse, targets, dtype)

    monkeypatch.setattr(chunked, "chunk_onehot_minus_p", counting)
    h, w, t, _ = _case(torch.float32)
    hr = h.clone().requires_grad_()
    with torch.no_grad():
        lp, _ = chunked_logprobs(hr, w, t, 8, cache_gib=1.0)
    lp2, _ = chunked_logprobs(h, w, t, 8, cache_gib=1.0)  # nothing requires grad
    assert calls == [] and lp2.grad_fn is None
    lp3, _ = chunked_logprobs(hr, w, t, 8, cache_gib=1.0)  # grad on: kept
    assert calls == [8, 8, 8, 2] and len(_head_node(lp3).q_cache) == 4
    assert torch.equal(lp, lp3.detach()) and torch.equal(lp2, lp)


# ------------------------------------------------------------------ nothing kept past the backward


def test_cache_released_by_the_backward() -> None:
    h0, w0, t, coef = _case(torch.bfloat16)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    logp, _ = chunked_logprobs(h, w, t, 8, cache_gib=1.0)
    node = _head_node(logp)
    kept = node.q_cache
    assert kept is not None and len(kept) == 4
    assert [tuple(q.shape) for q in kept] == [(8, VOCAB)] * 3 + [(2, VOCAB)]
    assert all(q.dtype == torch.bfloat16 for q in kept)  # the GEMM dtype
    refs = [weakref.ref(q) for q in kept]
    del kept
    assert all(r() is not None for r in refs)  # the forward's context holds them until backward
    (logp * coef).sum().backward()
    gc.collect()
    # logp (and through it the autograd node) is still alive; the kept chunks are not.
    assert node.q_cache is None
    assert all(r() is None for r in refs)


def test_second_backward_recomputes() -> None:
    """retain_graph: the first backward used and dropped the probabilities, the second
    recomputes the logits, with the same result (as the cache-less head twice)."""
    h0, w0, t, coef = _case(torch.float32)
    grads = []
    for cache in (1.0, 0.0):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logp, _ = chunked_logprobs(h, w, t, 5, cache_gib=cache)
        first = torch.autograd.grad((logp * coef).sum(), (h, w), retain_graph=True)
        second = torch.autograd.grad((logp * coef).sum(), (h, w))
        grads.append((*first, *second))
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ the knob reaches the head


M = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64)


def test_config_field_validates() -> None:
    assert TrainerSection().head_cache_gib == 12.0
    assert TrainerSection(head_cache_gib=0).head_cache_gib == 0.0
    with pytest.raises(ValidationError, match="head_cache_gib"):
        TrainerSection(head_cache_gib=-1.0)
    with pytest.raises(ValidationError, match="head_cache_gib"):
        TrainerSection(head_cache_gib="lots")  # type: ignore[arg-type]


def test_model_head_cache_and_recompute_give_the_same_gradients() -> None:
    """The whole model through the ChunkedOutput head (as train.py builds it): every parameter's
    gradient, with the head's probabilities kept or recomputed, torch.equal."""
    toks = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(5))
    coef = torch.randn(2, 16, generator=torch.Generator().manual_seed(6))
    grads = []
    for cache in (12.0, 0.0):
        model = enable_chunked_output(build_model(M, seed=0), True, cache)
        head = model.output
        assert isinstance(head, ChunkedOutput) and head.head_cache_gib == cache
        logp, _ = sequence_logprobs(model, toks[:, :-1], toks[:, 1:], chunk=6)
        assert (_head_node(logp).q_cache is not None) == (cache > 0)
        (logp * coef).sum().backward()
        named = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        assert head.weight.grad is not None  # the head's weight (tied: the embedding's)
        grads.append({**named, "head": head.weight.grad.clone()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters())) + 1
    for k in grads[0]:
        assert torch.equal(grads[0][k], grads[1][k]), k
    # enable_chunked_output sets the knob again on a second call, and refuses a negative one
    model = enable_chunked_output(build_model(M, seed=0), True, 12.0)
    enable_chunked_output(model, True, 0.0)
    assert model.output.head_cache_gib == 0.0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="head_cache_gib"):
        enable_chunked_output(model, True, -1.0)
