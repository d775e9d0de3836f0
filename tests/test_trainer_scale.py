"""The trainer's scale path on CPU: packing with document masking, chunked log-probs.

Packed and padded micro-batches, chunked and full log-probs, must give the same loss and the
same gradients (1e-5); the chunked path must not materialise a [tokens x vocab] tensor.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from services.common.config import ModelConfig
from services.common.schemas import Sample
from trainer.batch import loss_token_count, micro_batches
from trainer.chunked import chunked_logprobs, enable_chunked_output
from trainer.loss import logprobs_from_logits, micro_batch_logprobs, ratio_loss, token_logprobs
from trainer.model import build_model
from trainer.packing import (
    block_causal_mask,
    enable_document_masking,
    pack,
    packed_micro_batches,
    plan_packs,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _samples(n: int, seed: int, vocab: int = 64, max_len: int = 40) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, max_len + 1, (1,), generator=g))  # includes 1-token samples
        toks = torch.randint(0, vocab, (length,), generator=g).tolist()
        mask = (torch.rand(length, generator=g) < 0.7).int().tolist()
        logp = (-4.0 + 0.5 * torch.randn(length, generator=g)).tolist()
        out.append(
            Sample(
                rollout_id=f"r{i}",
                tokens=toks,
                loss_mask=mask,
                logprobs=logp,
                versions=[0] * length,
                reward=0.0,
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    return out


def _model(m: ModelConfig) -> torch.nn.Module:
    # torchtitan's own init (no init_std): sharp logits, so attention leaks would show.
    model = build_model(m, seed=0)
    return enable_chunked_output(enable_document_masking(model))


def _step(
    model: torch.nn.Module, samples: list[Sample], *, packing: bool, budget: int, chunk: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """The trainer's per-step loss (sum over micro-batches) and the accumulated gradients."""
    model.zero_grad(set_to_none=True)
    n = loss_token_count(samples)
    mbs = packed_micro_batches(samples, budget) if packing else micro_batches(samples, budget)
    total = 0.0
    for mb in mbs:
        logp, ent = micro_batch_logprobs(model, mb, chunk)
        loss, _ = ratio_loss(
            logp,
            mb.logp_infer,
            mb.advantages,
            mb.loss_mask,
            ratio_low=1e-30,
            ratio_high=1e30,
            total_loss_tokens=n,
            entropy=ent,
        )
        loss.backward()
        total += float(loss.detach())
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return total, grads


@pytest.mark.parametrize(
    ("gqa", "budget", "chunk"),
    [(False, 64, 0), (False, 200, 0), (True, 64, 0), (False, 64, 7), (True, 10_000, 16)],
)
def test_packed_loss_and_grads_equal_padded(gqa: bool, budget: int, chunk: int) -> None:
    m = ModelConfig(n_kv_heads=2) if gqa else ModelConfig()
    model = _model(m)
    samples = _samples(24, seed=3)
    ref_loss, ref_g = _step(model, samples, packing=False, budget=budget, chunk=0)
    loss, g = _step(model, samples, packing=True, budget=budget, chunk=chunk)
    assert len(packed_micro_batches(samples, budget)) < len(micro_batches(samples, budget)) or budget > 1000
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert g.keys() == ref_g.keys() and len(g) > 0
    for k in g:
        torch.testing.assert_close(g[k], ref_g[k], **TOL, msg=k)


def test_packing_needs_document_mask_and_positions() -> None:
    """Packed per-token log-probs equal each sample run alone; without the document mask they
    do not, so the equality above is not vacuous. The row (~100 tokens) is longer than the
    model's max_seq_len (32): per-sample positions keep RoPE inside its cache. (Within one
    sample RoPE only sees relative offsets, so restarting positions changes no value.)"""
    model = _model(ModelConfig(max_seq_len=32))
    samples = [s for s in _samples(8, seed=5, max_len=33) if len(s.tokens) >= 3]
    mb = pack(samples)
    assert mb.inputs.shape[1] > 32
    with torch.no_grad():
        packed, _ = micro_batch_logprobs(model, mb)
        alone = torch.cat([token_logprobs(model, torch.tensor([s.tokens]))[0][0] for s in samples])
        torch.testing.assert_close(packed[0], alone, **TOL)
        no_mask, _ = logprobs_from_logits(model(mb.inputs, positions=mb.positions), mb.targets)
        assert (no_mask[0] - alone).abs().max() > 1e-2


def test_pack_layout_and_plan() -> None:
    s = _samples(5, seed=1)
    s[0] = s[0].model_copy(update={"tokens": [1, 2, 3], "loss_mask": [1, 1, 0], "logprobs": [0.1, 0.2, 0.3]})
    s[1] = s[1].model_copy(update={"tokens": [4, 5], "loss_mask": [0, 1], "logprobs": [0.4, 0.5]})
    mb = pack(s[:2])
    assert mb.inputs.tolist() == [[1, 2, 4]] and mb.targets.tolist() == [[2, 3, 5]]
    assert mb.positions.tolist() == [[0, 1, 0]] and mb.seq_lens == [2, 1]
    assert mb.loss_mask.tolist() == [[1, 0, 1]]
    torch.testing.assert_close(mb.logp_infer, torch.tensor([[0.2, 0.3, 0.5]]))
    assert mb.advantages[0].tolist() == pytest.approx([s[0].advantage] * 2 + [s[1].advantage])
    assert mb.n_tokens == 5
    assert block_causal_mask([2, 1]).int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    lengths = [7, 3, 5, 9, 1, 2]
    plans = plan_packs(lengths, 10)
    assert sorted(i for p in plans for i in p) == list(range(6))
    assert all(sum(lengths[i] for i in p) <= 10 for p in plans)
    assert plan_packs([12, 3], 10) == [[0], [1]]  # too long for the budget: a pack of its own


def test_chunked_logprobs_equal_full() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 37, 16, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(101, 16, generator=g)).requires_grad_(True)
    t = torch.randint(0, 101, (2, 37), generator=g)
    up = torch.randn(2, 37, generator=g)
    ref_lp, ref_ent = logprobs_from_logits(h @ w.t(), t)
    ref_gh, ref_gw = torch.autograd.grad((ref_lp * up).sum(), (h, w))
    for chunk in (1, 8, 37, 74, 1000):
        lp, ent = chunked_logprobs(h, w, t, chunk)
        gh, gw = torch.autograd.grad((lp * up).sum(), (h, w))
        torch.testing.assert_close(lp, ref_lp, **TOL)
        torch.testing.assert_close(ent, ref_ent, **TOL)
        torch.testing.assert_close(gh, ref_gh, **TOL)
        torch.testing.assert_close(gw, ref_gw, **TOL)
        assert not ent.requires_grad
    # Through the model (tied embedding/output): same log-probs and parameter gradients.
    model = _model(ModelConfig())
    toks = torch.randint(0, 64, (3, 20), generator=g)
    grads = []
    for chunk in (0, 9):
        model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs(model, toks, chunk=chunk)
        (lp * up[:, :19].repeat(2, 1)[:3]).sum().backward()
        grads.append((lp.detach(), ent, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (lp0, e0, g0), (lp1, e1, g1) = grads
    torch.testing.assert_close(lp1, lp0, **TOL)
    torch.testing.assert_close(e1, e0, **TOL)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], **TOL, msg=k)
    assert model(toks).shape == (3, 20, 64)  # outside the context the head returns logits


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU tensor memory allocated while `fn` runs, above what was allocated before: torch's
    profiler with profile_memory=True records every allocation/free with the running total."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tdir:
        path = Path(tdir) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    mem = [e["args"] for e in events if e.get("name") == "[memory]"]
    assert mem, "the profiler recorded no allocations"
    before = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    return max(m["Total Allocated"] for m in mem) - before


def logprob_peak_memory(n: int, v: int, d: int, chunk: int) -> tuple[int, float]:
    """Peak bytes of forward + backward of the log-probs of n tokens, vocab v, hidden d
    (chunk 0 = the full [n x v] computation), and the sum of the weight gradient."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = (0.05 * torch.randn(v, d, generator=g)).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g)

    def run() -> None:
        lp = chunked_logprobs(h, w, t, chunk)[0] if chunk else logprobs_from_logits(h @ w.t(), t)[0]
        lp.sum().backward()

    peak = peak_bytes(run)
    assert w.grad is not None
    return peak, float(w.grad.abs().sum())


def test_chunked_logprobs_peak_memory() -> None:
    """Vocab 32k x 2k tokens (one [tokens x vocab] float32 tensor = 256 MiB), forward + backward:
    the full path peaks at several such tensors, the chunked one at a few [chunk x vocab] ones.
    (docs/loss.md has the 8k-token numbers: `logprob_peak_memory(8192, 32768, 64, C)`.)"""
    n, v, d = 2048, 32768, 64
    wall = n * v * 4
    full, gw_full = logprob_peak_memory(n, v, d, 0)
    res = {c: logprob_peak_memory(n, v, d, c) for c in (128, 512)}
    mib = {c: f"{p / 2**20:.0f} MiB" for c, (p, _) in res.items()}
    print(
        f"\n[chunked log-probs] tokens={n} vocab={v} dim={d}: one [tokens x vocab] fp32 ="
        f" {wall / 2**20:.0f} MiB; peak allocated full = {full / 2**20:.0f} MiB, chunked = {mib}"
    )
    assert full >= 3 * wall  # logits, log-softmax, their gradient...
    for c, (peak, gw) in res.items():
        assert gw == pytest.approx(gw_full, rel=1e-5)
        assert peak < 4 * c * v * 4 + 16 * 2**20  # a few [chunk x vocab] tensors + the gradients
    assert res[128][0] < wall / 4
