"""Unit tests of the trainer's loss and batch building (pure functions, no Redis)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from services.common.config import ModelConfig, RunConfig
from services.common.schemas import Sample
from trainer.batch import (
    collate,
    loss_token_count,
    micro_batches,
    plan_micro_batches,
    split_for_ranks,
    truncate,
)
from trainer.launch import trainer_command
from trainer.loss import logprobs_from_logits, ratio_loss, token_logprobs
from trainer.model import build_model
from trainer.train import latest_checkpoint, write_checkpoint

LOW, HIGH = 0.5, 2.0


def _logits(b: int = 3, t: int = 5, v: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, v, generator=g).requires_grad_(True)


def _targets(b: int = 3, t: int = 5, v: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(seed))


def test_on_policy_ratio_is_reinforce_gradient() -> None:
    logits, targets = _logits(), _targets()
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([0.5, -1.25, 2.0])
    logp, _ = logprobs_from_logits(logits, targets)
    n = int(mask.sum())
    loss, stats = ratio_loss(
        logp, logp.detach(), adv, mask, ratio_low=LOW, ratio_high=HIGH, total_loss_tokens=n
    )
    (g_ratio,) = torch.autograd.grad(loss, logits)

    logits2 = logits.detach().clone().requires_grad_(True)
    logp2, _ = logprobs_from_logits(logits2, targets)
    reinforce = -(adv[:, None] * logp2 * mask).sum() / n
    (g_ref,) = torch.autograd.grad(reinforce, logits2)

    torch.testing.assert_close(g_ratio, g_ref, rtol=1e-6, atol=1e-7)
    # On-policy the loss value is -mean(A) over loss tokens (ratio = 1).
    assert loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item() / n, rel=1e-6)
    assert stats.loss_tokens == n and stats.masked_tokens == 0


def test_tokens_outside_band_get_zero_gradient() -> None:
    logits, targets = _logits(), _targets()
    mask = torch.ones(3, 5)
    logp, _ = logprobs_from_logits(logits, targets)
    infer = logp.detach().clone()
    infer[0, 1] -= 1.0  # ratio e^1 = 2.72 > HIGH
    infer[1, 3] += 1.0  # ratio e^-1 = 0.37 < LOW
    infer[2, 2] += math.log(HIGH) * 0.5  # ratio 1/sqrt(2): inside, keeps its gradient
    infer[2, 4] = -200.0  # huge ratio: masked, and must not turn into NaN
    loss, stats = ratio_loss(
        logp, infer, torch.ones(3), mask, ratio_low=LOW, ratio_high=HIGH, total_loss_tokens=15
    )
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(g).all()
    for b, t in [(0, 1), (1, 3), (2, 4)]:
        assert g[b, t].abs().max().item() == 0.0
    assert g[2, 2].abs().max().item() > 0.0 and g[0, 0].abs().max().item() > 0.0
    assert stats.masked_tokens == 3 and stats.loss_tokens == 15


def test_normalised_by_step_token_count_across_micro_batches() -> None:
    logits, targets = _logits(b=4), _targets(b=4)
    mask = (torch.rand(4, 5, generator=torch.Generator().manual_seed(3)) > 0.3).float()
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0])
    logp, _ = logprobs_from_logits(logits, targets)
    infer = logp.detach() + 0.1 * torch.randn(4, 5, generator=torch.Generator().manual_seed(4))
    n = int(mask.sum())
    kw = {"ratio_low": LOW, "ratio_high": HIGH, "total_loss_tokens": n}
    full, _ = ratio_loss(logp, infer, adv, mask, **kw)
    (g_full,) = torch.autograd.grad(full, logits, retain_graph=True)
    # Two micro-batches, each divided by the STEP's count, sum to the full-batch loss/gradient.
    a, _ = ratio_loss(logp[:2], infer[:2], adv[:2], mask[:2], **kw)
    b, _ = ratio_loss(logp[2:], infer[2:], adv[2:], mask[2:], **kw)
    (g_parts,) = torch.autograd.grad(a + b, logits)
    assert (a + b).item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(g_parts, g_full)
    # Halving the normaliser doubles the loss: it is a sum over tokens / N, not a per-sample mean.
    half, _ = ratio_loss(logp, infer, adv, mask, ratio_low=LOW, ratio_high=HIGH, total_loss_tokens=n * 2)
    assert half.item() == pytest.approx(full.item() / 2, rel=1e-6)
    with pytest.raises(ValueError):
        ratio_loss(logp, infer, adv, mask, ratio_low=LOW, ratio_high=HIGH, total_loss_tokens=0)


def test_entropy_of_uniform_is_log_vocab() -> None:
    logp, ent = logprobs_from_logits(torch.zeros(2, 3, 11), torch.zeros(2, 3, dtype=torch.long))
    torch.testing.assert_close(ent, torch.full((2, 3), math.log(11)))
    torch.testing.assert_close(logp, torch.full((2, 3), -math.log(11)))


def _sample(
    tokens: list[int], n_prompt: int, logprobs: list[float] | None = None, adv: float = 0.0
) -> Sample:
    n = len(tokens)
    mask = [0] * n_prompt + [1] * (n - n_prompt)
    lps = (
        logprobs if logprobs is not None else [0.0] * n_prompt + [-1.0 - 0.1 * i for i in range(n - n_prompt)]
    )
    return Sample(
        rollout_id=f"r{len(tokens)}-{n_prompt}",
        tokens=tokens,
        loss_mask=mask,
        logprobs=lps,
        versions=[-1 if m == 0 else 0 for m in mask],
        reward=0.0,
        advantage=adv,
    )


def test_collate_shifts_mask_and_logprobs_onto_targets() -> None:
    s1 = _sample([5, 6, 7, 8, 9], n_prompt=2, adv=0.5)
    s2 = _sample([11, 12, 13], n_prompt=1, adv=-1.0)
    mb = collate([s1, s2], pad_id=0)
    assert mb.tokens.shape == (2, 5) and mb.loss_mask.shape == (2, 4)
    for i, s in enumerate([s1, s2]):
        for t in range(len(s.tokens) - 1):
            assert mb.targets[i, t].item() == s.tokens[t + 1]
            assert mb.loss_mask[i, t].item() == s.loss_mask[t + 1]
            assert mb.logp_infer[i, t].item() == pytest.approx(s.logprobs[t + 1])
    assert mb.loss_mask[1, 2:].sum().item() == 0  # padding is never trained
    # the sample's advantage on each of its target columns, 0 on padding
    assert mb.advantages.tolist() == [[0.5] * 4, [-1.0, -1.0, 0.0, 0.0]]
    assert mb.n_tokens == 8 and loss_token_count([s1, s2]) == 5


def test_sampled_logprobs_line_up_with_trainer_logits() -> None:
    """Sample like an engine (record the log-prob of each sampled token from the logits that
    produced it), then check the trainer's batch + token_logprobs reproduce them exactly at
    the loss-mask positions, for rows of different lengths (padding included)."""
    torch.manual_seed(0)
    m = ModelConfig()
    model = build_model(m, seed=0)
    samples = []
    gen = torch.Generator().manual_seed(1)
    for n_prompt, n_new in [(3, 5), (6, 2), (2, 7)]:
        toks = torch.randint(0, m.vocab_size, (n_prompt,), generator=gen).tolist()
        lps = [0.0] * n_prompt
        with torch.no_grad():
            for _ in range(n_new):
                logp = model(torch.tensor([toks])).float().log_softmax(-1)[0, -1]
                nxt = int(torch.multinomial(logp.exp(), 1, generator=gen).item())
                toks.append(nxt)
                lps.append(float(logp[nxt]))
        samples.append(_sample(toks, n_prompt, lps))
    mb = collate(samples)
    with torch.no_grad():
        logp, ent = token_logprobs(model, mb.tokens)
    assert logp.shape == mb.loss_mask.shape == ent.shape
    sel = mb.loss_mask.bool()
    assert int(sel.sum()) == 14
    torch.testing.assert_close(logp[sel], mb.logp_infer[sel], rtol=0, atol=1e-5)


def test_micro_batch_plan_respects_budget() -> None:
    lengths = [10, 3, 7, 7, 25, 1, 4, 9]
    plans = plan_micro_batches(lengths, token_budget=20)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for p in plans:
        longest = max(lengths[i] for i in p)
        assert len(p) * longest <= 20 or len(p) == 1  # an over-long sample gets its own
    samples = [_sample(list(range(1, n + 2)), 1) for n in lengths]
    mbs = micro_batches(samples, token_budget=20)
    assert sum(mb.tokens.shape[0] for mb in mbs) == len(samples)


def test_split_for_ranks_and_truncate() -> None:
    samples = [_sample(list(range(1, n + 2)), 1) for n in [4, 9, 2, 6, 5]]
    parts = split_for_ranks(samples, 2)
    assert sorted(len(s.tokens) for p in parts for s in p) == sorted(len(s.tokens) for s in samples)
    assert [len(p) for p in parts] == [3, 2]
    assert split_for_ranks(samples, 1) == [sorted(samples, key=lambda s: -len(s.tokens))]
    t = truncate(samples[1], 4)
    assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs) == len(t.versions) == 4
    assert truncate(samples[2], 4) is samples[2]


def test_trainer_command() -> None:
    cfg = RunConfig()
    one = trainer_command(cfg, "/r", "redis://x")
    assert one[:3] == [sys.executable, "-m", "trainer"]
    assert one[3:] == ["--config", "/r/config.json", "--redis-url", "redis://x", "--run-dir", "/r"]
    cfg.trainer.nproc = 2
    two = trainer_command(cfg, "/r", "redis://x")
    assert two[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=2" in two
    assert two[-8:] == ["-m", "trainer", *one[3:]]


def test_latest_checkpoint_ignores_partial(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for s in (2, 4, 6):
        write_checkpoint(tmp_path, s, {"step": s})
    (tmp_path / "checkpoints" / ".step_8.tmp-1").mkdir()  # a crashed write
    (tmp_path / "checkpoints" / "step_10").mkdir()  # no state file: incomplete
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == 6
    assert not (tmp_path / "checkpoints" / "step_2").exists()  # pruned: keep the newest two


def test_entropy_bonus_adds_the_entropy_gradient() -> None:
    """loss(entropy_coef=c) = policy loss - c * sum(entropy * mask) / N, with the entropy's own
    gradient; without entropy_grad the bonus is refused rather than silently a no-op."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([0.5, -0.25])
    kw = {"ratio_low": 0.5, "ratio_high": 2.0, "total_loss_tokens": 7}

    logp, ent = logprobs_from_logits(logits, targets, entropy_grad=True)
    assert ent.requires_grad
    with_bonus, _ = ratio_loss(logp, logp.detach(), adv, mask, entropy=ent, entropy_coef=0.1, **kw)
    (g_bonus,) = torch.autograd.grad(with_bonus, logits)

    logp2, ent2 = logprobs_from_logits(logits, targets, entropy_grad=True)
    plain, _ = ratio_loss(logp2, logp2.detach(), adv, mask, entropy=ent2, **kw)
    (g_plain,) = torch.autograd.grad(plain, logits, retain_graph=True)
    expected = plain - 0.1 * (ent2 * mask).sum() / 7
    (g_expected,) = torch.autograd.grad(expected, logits)
    assert torch.allclose(g_bonus, g_expected, atol=1e-7)
    assert not torch.allclose(g_bonus, g_plain, atol=1e-4)

    logp3, ent3 = logprobs_from_logits(logits, targets)  # logging-only entropy
    assert not ent3.requires_grad
    with pytest.raises(ValueError, match="entropy_grad"):
        ratio_loss(logp3, logp3.detach(), adv, mask, entropy=ent3, entropy_coef=0.1, **kw)
