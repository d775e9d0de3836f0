"""The train step's hot path reads nothing back from the device: the loss stats, the
mismatch sums and their per-step accumulation run on `meta` tensors (which have no values, so
any .item() / .tolist() / boolean-mask gather / data-dependent shape raises), and give exactly
the values of the float path they replace."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.batch import to_device
from trainer.loss import LossStats, ratio_loss
from trainer.mismatch import RATIO_BAND, MismatchStats, token_mismatch, token_mismatch_tensors
from trainer.packing import PackedMicroBatch, block_causal_mask
from trainer.step_stats import StepStats
from trainer.train import Dist

KW = dict(ratio_low=0.8, ratio_high=1.25)


def batch(seed: int, n: int = 257) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(1, n, generator=g) * 5
    infer = logp + 0.3 * torch.randn(1, n, generator=g)
    adv = torch.randn(1, n, generator=g)
    mask = (torch.rand(1, n, generator=g) > 0.3).float()
    ent = torch.rand(1, n, generator=g) * 3
    return logp, infer, adv, mask, ent


def old_loss_stats(logp, infer, mask, ent, loss) -> tuple[float, float, float, float]:  # noqa: ANN001
    """The values ratio_loss's stats held before: four .item() reads of float32 sums."""
    raw = torch.exp(logp - infer)
    in_band = ((raw >= KW["ratio_low"]) & (raw <= KW["ratio_high"])).float()
    return (
        float(mask.sum().item()),
        float((mask * (1.0 - in_band)).sum().item()),
        float((ent * mask).sum().item()),
        float(loss.detach().item()),
    )


def old_token_mismatch(a, b, mask, on_policy) -> MismatchStats:  # noqa: ANN001
    """token_mismatch as it was: boolean-mask gathers and .item() reads."""
    m = mask.reshape(-1) > 0
    a, b = a.reshape(-1)[m].double(), b.reshape(-1)[m].double()
    log_r = a - b
    r = torch.exp(log_r.clamp(max=700.0))
    k3 = r - 1.0 - log_r
    p_abs = (a.exp() - b.exp()).abs()
    fresh = on_policy.reshape(-1)[m]
    return MismatchStats(
        tokens=float(a.numel()),
        on_policy_tokens=float(fresh.sum().item()),
        on_policy_k3_sum=float(k3[fresh].sum().item()),
        k3_sum=float(k3.sum().item()),
        p_abs_sum=float(p_abs.sum().item()),
        p_abs_max=float(p_abs.max().item()),
        ratio_out=float(((r < RATIO_BAND[0]) | (r > RATIO_BAND[1])).sum().item()),
    )


def test_ratio_loss_stats_stay_on_the_device_and_equal_the_float_path() -> None:
    logp, infer, adv, mask, ent = batch(0)
    loss, st = ratio_loss(logp, infer, adv, mask, total_loss_tokens=300, entropy=ent, **KW)
    assert (st.loss_tokens, st.masked_tokens, st.entropy_sum, st.loss_sum) == old_loss_stats(
        logp, infer, mask, ent, loss
    )
    assert st.masked_tokens > 0 and st.as_tensor().dtype == torch.float64
    # No host read at all: the same call on tensors without values.
    meta = [t.to("meta") for t in (logp, infer, adv, mask, ent)]
    loss_m, st_m = ratio_loss(*meta[:4], total_loss_tokens=300, entropy=meta[4], **KW)
    assert loss_m.device.type == "meta" and st_m.as_tensor().shape == (4,)
    acc = LossStats()
    acc.add(st_m)
    acc.add(st_m)
    assert acc.as_tensor().device.type == "meta"
    with pytest.raises(RuntimeError):  # reading a field is the (one) host copy
        _ = st_m.loss_sum


def test_loss_stats_add_like_python_floats() -> None:
    a, b = LossStats.of_tensor(torch.tensor([3.0, 1.0, 0.5, -0.0])), LossStats(2.0, 0.0, 0.25, -0.0)
    acc = LossStats()
    assert acc.loss_tokens == 0.0 and acc.as_tensor().tolist() == [0.0] * 4
    acc.add(a)
    acc.add(b)
    assert (acc.loss_tokens, acc.masked_tokens, acc.entropy_sum) == (5.0, 1.0, 0.75)
    # 0.0 + -0.0 + -0.0 is 0.0 for Python floats: the tensor sum keeps that sign too
    assert math.copysign(1.0, acc.loss_sum) == 1.0
    assert LossStats.from_tensor(acc.as_tensor()).entropy_sum == 0.75


def test_mismatch_sums_without_gathers() -> None:
    logp, infer, _, mask, _ = batch(1)
    on_policy = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) > 0.5
    new, old = token_mismatch(logp, infer, mask, on_policy), old_token_mismatch(logp, infer, mask, on_policy)
    # counts and the max exactly; float64 sums up to summation order
    for f in ("tokens", "ratio_out", "on_policy_tokens", "p_abs_max"):
        assert getattr(new, f) == getattr(old, f), f
    for f in ("k3_sum", "p_abs_sum", "on_policy_k3_sum"):
        assert getattr(new, f) == pytest.approx(getattr(old, f), rel=1e-12, abs=0.0), f
    assert new.ratio_out > 0 and 0 < new.on_policy_tokens < new.tokens
    # an inf log-prob outside the mask must not reach the sums (where, not multiply)
    bad = logp.clone()
    bad[mask == 0] = -math.inf
    assert token_mismatch(bad, infer, mask, on_policy) == new
    sums, mx = token_mismatch_tensors(*(t.to("meta") for t in (logp, infer, mask, on_policy)))
    assert sums.shape == (6,) and mx.shape == (1,) and sums.device.type == "meta"


def micro_batch(seed: int) -> tuple[PackedMicroBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp, infer, adv, mask, ent = batch(seed, n=100 + seed)
    n = logp.shape[1]
    mb = PackedMicroBatch(
        inputs=torch.zeros(1, n, dtype=torch.long),
        targets=torch.zeros(1, n, dtype=torch.long),
        positions=torch.arange(n).unsqueeze(0),
        loss_mask=mask,
        logp_infer=infer,
        advantages=adv,
        seq_lens=[n],
        n_tokens=n + 1,
    )
    return mb, logp, ent, torch.rand(1, n, generator=torch.Generator().manual_seed(seed)) > 0.4


def test_step_stats_equal_the_per_micro_batch_float_path() -> None:
    """Three micro-batches accumulated on the device and read once vs the old path: LossStats of
    floats added in Python, MismatchStats added in Python, the token count as an int."""
    acc = StepStats(torch.device("cpu"), moe_layers=0)
    old_loss = [0.0] * 4
    old_mm = MismatchStats()
    tokens = 0
    for seed in range(3):
        mb, logp, ent, on_policy = micro_batch(seed)
        loss, st = ratio_loss(
            logp, mb.logp_infer, mb.advantages, mb.loss_mask, total_loss_tokens=500, entropy=ent, **KW
        )
        acc.add(st, logp, mb, on_policy)
        old_loss = [
            x + y
            for x, y in zip(
                old_loss, old_loss_stats(logp, mb.logp_infer, mb.loss_mask, ent, loss), strict=True
            )
        ]
        old_mm.add(old_token_mismatch(logp, mb.logp_infer, mb.loss_mask, on_policy))
        tokens += mb.n_tokens
    norm = torch.tensor(1.2345678, dtype=torch.float32)
    g, n_tok, mm, gn = acc.read(norm, Dist("cpu").all_reduce_)  # world 1: no reduction
    assert [g.loss_tokens, g.masked_tokens, g.entropy_sum, g.loss_sum] == old_loss
    assert n_tok == tokens and gn == float(norm.item())
    assert (mm.tokens, mm.ratio_out, mm.on_policy_tokens, mm.p_abs_max) == (
        old_mm.tokens,
        old_mm.ratio_out,
        old_mm.on_policy_tokens,
        old_mm.p_abs_max,
    )
    assert mm.k3_sum == pytest.approx(old_mm.k3_sum, rel=1e-12, abs=0.0)
    assert mm.summary()["mismatch_kl_k3"] == pytest.approx(old_mm.summary()["mismatch_kl_k3"], rel=1e-12)


def test_step_stats_accumulate_without_host_reads() -> None:
    acc = StepStats(torch.device("meta"), moe_layers=2)
    for seed in range(2):
        mb, logp, ent, on_policy = micro_batch(seed)
        meta = PackedMicroBatch(
            **{
                k: getattr(mb, k).to("meta")
                for k in ("inputs", "targets", "positions", "loss_mask", "logp_infer", "advantages")
            },
            seq_lens=mb.seq_lens,
            n_tokens=mb.n_tokens,
        )
        _, st = ratio_loss(
            logp.to("meta"), meta.logp_infer, meta.advantages, meta.loss_mask, total_loss_tokens=9, **KW
        )
        acc.add(st, logp.to("meta"), meta, on_policy.to("meta"))
    assert acc.mm_sum is not None and acc.mm_sum.device.type == "meta"


def test_host_tensors_reach_the_device_unchanged() -> None:
    t = torch.arange(5)
    assert to_device(t, torch.device("cpu")) is t  # CPU training: no copy
    # the dense document mask: output size from the host, same mask as before
    m = block_causal_mask([2, 3])
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, want)
