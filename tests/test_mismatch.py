"""Trainer/inference mismatch metrics (trainer/mismatch.py) and their wiring into the trainer's
step (trainer/train.py): known inputs, cross-rank reduction, and a real train step, dense and MoE
(with and without Router Replay)."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.moe import run_one_step
from helpers.trainer_process import assert_first_adam_step_close

from services.common import routing as wire
from services.common.config import RunConfig, load_config
from services.common.schemas import RolloutGroup, Sample, TrainerStepMetrics
from trainer.loss import token_logprobs
from trainer.mismatch import MismatchStats, micro_batch_versions, token_mismatch
from trainer.model import moe_layer_ids
from trainer.replay import routing
from trainer.train import Dist, Trainer


def k3(r: float) -> float:
    return r - 1.0 - math.log(r)


def test_token_mismatch_on_known_inputs() -> None:
    p_train = torch.tensor([[0.5, 0.2, 0.9, 0.1, 0.7]])
    p_infer = torch.tensor([[0.4, 0.5, 0.9, 0.3, 0.01]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last position is not trained
    on_policy = torch.tensor([[True, False, True, False, True]])  # the rest: stale tokens
    st = token_mismatch(p_train.log(), p_infer.log(), mask, on_policy)
    ratios = [0.5 / 0.4, 0.2 / 0.5, 1.0, 0.1 / 0.3]
    assert st.tokens == 4
    assert st.k3_sum == pytest.approx(sum(k3(r) for r in ratios), rel=1e-5)
    assert st.p_abs_sum == pytest.approx(0.1 + 0.3 + 0.0 + 0.2, rel=1e-5)
    assert st.p_abs_max == pytest.approx(0.3, rel=1e-5)
    assert st.ratio_out == 2  # 0.4 and 1/3 are below 0.5; 1.25 and 1 are inside
    s = st.summary()
    assert s["mismatch_kl_k3"] == pytest.approx(sum(k3(r) for r in ratios) / 4, rel=1e-5)
    assert s["mismatch_p_abs_mean"] == pytest.approx(0.15, rel=1e-5)
    assert s["mismatch_p_abs_max"] == pytest.approx(0.3, rel=1e-5)
    assert s["mismatch_ratio_out_frac"] == 0.5
    assert st.on_policy_tokens == 2  # position 4 is on-policy but not trained
    assert s["mismatch_kl_k3_on_policy"] == pytest.approx((k3(1.25) + k3(1.0)) / 2, rel=1e-5)
    assert token_mismatch(p_train.log(), p_infer.log(), mask).summary()["mismatch_kl_k3_on_policy"] is None
    assert s["routing_agreement"] == [] and s["routing_agreement_mean"] is None


def test_identical_logprobs_have_zero_mismatch_and_extreme_ratios_stay_finite() -> None:
    lp = torch.log(torch.tensor([0.3, 0.6, 0.05]))
    st = token_mismatch(lp, lp.clone(), torch.ones(3))
    assert (st.k3_sum, st.p_abs_sum, st.p_abs_max, st.ratio_out) == (0.0, 0.0, 0.0, 0.0)
    # A token the trainer finds 1e300 times likelier than inference did: finite, counted as out.
    st = token_mismatch(torch.tensor([0.0]), torch.tensor([-700.0]), torch.ones(1))
    assert math.isfinite(st.k3_sum) and st.k3_sum > 1e300 and st.ratio_out == 1
    assert token_mismatch(lp, lp, torch.zeros(3)).tokens == 0  # nothing trained: nothing counted


def test_stats_accumulate_and_reduce_like_ranks() -> None:
    a = token_mismatch(
        torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([0.4, 0.5])), torch.ones(2)
    )
    a.add_routing(torch.tensor([3.0, 4.0]), torch.tensor([4.0, 4.0]), torch.tensor([4.0, 4.0]))
    b = token_mismatch(torch.log(torch.tensor([0.9])), torch.log(torch.tensor([0.1])), torch.ones(1))
    b.add_routing(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0]), torch.tensor([2.0, 0.0]))
    whole = MismatchStats()
    whole.add(a)
    whole.add(b)
    # What train.py does across ranks: sum one tensor, max the other.
    summed = a.sum_tensor(2) + b.sum_tensor(2)
    maxed = torch.maximum(a.max_tensor(), b.max_tensor())
    reduced = MismatchStats.from_tensors(summed, maxed, 2)
    assert reduced == whole
    s = reduced.summary()
    assert s["mismatch_p_abs_max"] == pytest.approx(0.8)
    assert s["routing_agreement"] == [pytest.approx(4 / 6), pytest.approx(4 / 4)]
    assert s["routing_agreement_mean"] == pytest.approx(8 / 10)
    assert s["routing_replayed_frac"] == 1.0
    # A layer that saw no recorded token reports None, not a made-up number.
    empty = MismatchStats(route_agree=[0.0], route_total=[0.0], route_replayed=[0.0])
    assert empty.summary()["routing_agreement"] == [None]
    # The summary is exactly the TrainerStepMetrics fields.
    assert set(s) <= set(TrainerStepMetrics.model_fields)


# ------------------------------------------------------------------ a real trainer step


def make_trainer(name: str, redis_url: str, tmp_path: Path, **trainer: object) -> Trainer:
    cfg = load_config(name)
    tree = cfg.model_dump()
    tree["redis"]["prefix"] = f"mm-{uuid.uuid4().hex[:8]}"
    tree["trainer"].update(trainer)
    t = Trainer(RunConfig.model_validate(tree), tmp_path, redis_url, Dist("cpu"))
    t.setup()
    return t


def samples_with_logprobs(
    t: Trainer,
    n: int,
    length: int,
    delta: float,
    routes: torch.Tensor | None,
    replay: bool,
    version: int = 0,
) -> list[Sample]:
    """Samples whose inference log-probs are the trainer's current ones minus `delta` (computed
    under `routes` when given), so the step's mismatch is known exactly."""
    m = t.cfg.model
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(1, m.vocab_size, (n, length), generator=g)
    with torch.no_grad(), routing(t.model, routes, replay=replay):
        logp, _ = token_logprobs(t.model, toks)
    out = []
    for i in range(n):
        mask = [0] * 3 + [1] * (length - 3)
        lp = [0.0] + [
            float(x) - delta if mk else 0.0 for x, mk in zip(logp[i].tolist(), mask[1:], strict=True)
        ]
        re = None
        if routes is not None:
            dtype = wire.routing_dtype(m.n_routed_experts)
            arr = np.full((length, *routes.shape[2:]), wire.unrecorded(dtype), dtype=dtype)
            arr[:-1] = routes[i].numpy().astype(dtype)
            re = wire.encode(arr)
        out.append(
            Sample(
                rollout_id=f"s{i}",
                tokens=toks[i].tolist(),
                loss_mask=mask,
                logprobs=lp,
                versions=[-1] * 3 + [version] * (length - 3),
                reward=float(i % 2),
                advantage=float(i % 2) - 0.5,
                routed_experts=re,
            )
        )
    return out


def group(samples: list[Sample]) -> list[RolloutGroup]:
    return [RolloutGroup(group_id="g0", env="reverse", seed=0, samples=samples)]


def test_dense_step_reports_mismatch(redis_url: str, tmp_path: Path) -> None:
    t = make_trainer("debug", redis_url, tmp_path, micro_batch_tokens=40)
    delta = 0.1  # logp_infer = logp_train - 0.1 on every trained token: r = e^0.1
    res = t.train_step(group(samples_with_logprobs(t, 6, 12, delta, None, False)))
    mm = res.mismatch
    assert mm["mismatch_kl_k3"] == pytest.approx(k3(math.exp(delta)), rel=1e-4)
    assert mm["mismatch_ratio_out_frac"] == 0.0
    assert mm["mismatch_p_abs_max"] > mm["mismatch_p_abs_mean"] > 0.0
    assert mm["routing_agreement"] == [] and mm["routing_replayed_frac"] is None
    assert mm["mismatch_kl_k3_on_policy"] == pytest.approx(mm["mismatch_kl_k3"], rel=1e-9)  # all fresh
    # ...and they reach the step's metrics record (Redis -> metrics.jsonl, /v1/metrics).
    from trainer.train import Batch

    rec = t._metrics(
        0, Batch(stop=False, groups=group(samples_with_logprobs(t, 2, 5, 0, None, False))), res, 0.0
    )
    assert rec.mismatch_kl_k3 == mm["mismatch_kl_k3"] and rec.routing_agreement == []


@pytest.mark.parametrize(("replay", "packing"), [(True, False), (False, False), (True, True)])
def test_moe_step_replays_recorded_routing(
    redis_url: str, tmp_path: Path, replay: bool, packing: bool
) -> None:
    """Inference log-probs computed under recorded routes that are NOT the trainer's own choice:
    with replay the trainer reproduces them exactly (mismatch 0); without, it does not. Padded
    (2 micro-batches) and packed micro-batches."""
    t = make_trainer(
        "debug-moe", redis_url, tmp_path, router_replay=replay, micro_batch_tokens=20, packing=packing
    )
    m = t.cfg.model
    with torch.no_grad():  # decisive routing, so a different expert set changes log-probs
        for layer in moe_layer_ids(m):
            moe = t.model.layers[str(layer)].moe
            moe.router.gate.weight.normal_(0.0, 1.0)
            for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
                w.normal_(0.0, 0.3)
    n, length = 4, 10
    g = torch.Generator().manual_seed(5)
    routes = torch.rand(n, length - 1, len(moe_layer_ids(m)), m.n_routed_experts, generator=g)
    routes = routes.topk(m.n_experts_per_tok, dim=-1).indices
    samples = samples_with_logprobs(t, n, length, 0.0, routes, replay=True)
    mm = t.train_step(group(samples)).mismatch
    assert len(mm["routing_agreement"]) == 2
    recorded = n * (length - 1)
    if replay:
        assert mm["mismatch_kl_k3"] < 1e-9 and mm["mismatch_p_abs_max"] < 1e-5
        assert mm["routing_replayed_frac"] == 1.0
    else:
        assert mm["mismatch_kl_k3"] > 1e-4
        assert mm["routing_replayed_frac"] == 0.0
    # Random recorded sets rarely equal the trainer's own top-2 of 8.
    assert 0.0 <= mm["routing_agreement_mean"] < 0.5
    assert all(a is not None and a * recorded == round(a * recorded) for a in mm["routing_agreement"])


def test_on_policy_mismatch_excludes_stale_tokens(redis_url: str, tmp_path: Path) -> None:
    """Trainer at version 1: fresh samples (min_version 1) match exactly, stale ones (version 0)
    carry a policy lag of delta. The on-policy KL sees only the former; the overall one both."""
    t = make_trainer("debug", redis_url, tmp_path, micro_batch_tokens=30)
    t.version = 1  # as after one committed step; train_step compares token versions with it
    delta = 0.2
    fresh = samples_with_logprobs(t, 3, 12, 0.0, None, False, version=1)
    stale = samples_with_logprobs(t, 3, 12, delta, None, False, version=0)
    stale = [s.model_copy(update={"rollout_id": f"old{i}"}) for i, s in enumerate(stale)]
    mm = t.train_step(group(fresh + stale)).mismatch
    assert mm["mismatch_kl_k3_on_policy"] == pytest.approx(0.0, abs=1e-9)
    assert mm["mismatch_kl_k3"] == pytest.approx(k3(math.exp(delta)) / 2, rel=1e-4)


@pytest.mark.parametrize("packing", [False, True])
def test_micro_batch_versions_align_with_loss_mask(packing: bool) -> None:
    from trainer.batch import micro_batches
    from trainer.packing import packed_micro_batches

    samples = [
        Sample(
            rollout_id=f"s{i}",
            tokens=list(range(1, n + 1)),
            loss_mask=[0, 0] + [1] * (n - 2),
            logprobs=[0.0] * n,
            versions=[-1, -1] + [i] * (n - 3) + [i + 1],  # weights changed before the last token
            reward=0.0,
        )
        for i, n in enumerate([7, 3, 9, 5])
    ]
    mbs = packed_micro_batches(samples, 12) if packing else micro_batches(samples, 12)
    vs = micro_batch_versions(samples, packing, 12)
    assert len(vs) == len(mbs) > 1
    for mb, v in zip(mbs, vs, strict=True):
        assert v.shape == mb.loss_mask.shape
        # every scored position carries its sample's min_version (here = its index); pads -2
        assert ((v >= 0) | (v == -2)).all() and (v[mb.loss_mask > 0] >= 0).all()
        assert set(v[v >= 0].tolist()) <= {0, 1, 2, 3}


@pytest.mark.slow  # torchrun start-up: ~20 s alone, minutes on a loaded machine
def test_moe_two_processes_match_one(redis_url: str, tmp_path: Path) -> None:
    """debug-moe with replay through 1 process and through torchrun --nproc_per_node=2 (gloo,
    FSDP2): the same update, and the same mismatch/routing metrics after the cross-rank reduction
    (sums, and a max for p_abs_max)."""
    from trainer.model import build_model

    base = load_config("debug-moe")
    m = base.model
    model = build_model(m, seed=base.run.seed, init_std=base.trainer.init_std)  # = step_0
    gen = torch.Generator().manual_seed(9)
    layers, k = len(moe_layer_ids(m)), m.n_experts_per_tok
    groups = []
    for gi in range(2):
        samples = []
        for i in range(4):
            n = 8 + 3 * gi + i  # different lengths, so ranks get different micro-batches
            toks = torch.randint(2, m.vocab_size, (1, n), generator=gen)
            routes = torch.rand(1, n - 1, layers, m.n_routed_experts, generator=gen).topk(k, dim=-1).indices
            with torch.no_grad(), routing(model, routes, replay=True):
                lp, _ = token_logprobs(model, toks)
            arr = np.full((n, layers, k), 255, dtype=np.uint8)
            arr[:-1] = routes[0].numpy()
            jitter = 0.05 * (i - 1.5)  # some mismatch, different per sample
            samples.append(
                Sample(
                    rollout_id=f"g{gi}.{i}",
                    tokens=toks[0].tolist(),
                    loss_mask=[0] * 3 + [1] * (n - 3),
                    logprobs=[0.0] * 3 + [float(x) + jitter for x in lp[0, 2:].tolist()],
                    versions=[-1] * 3 + [0] * (n - 3),
                    reward=float(i % 2),
                    advantage=float(i % 2) - 0.5,
                    routed_experts=wire.encode(arr),
                )
            )
        groups.append(RolloutGroup(group_id=f"same-{gi}", env="reverse", seed=gi, samples=samples))

    outs = []
    for nproc in (1, 2):
        run_dir = tmp_path / f"run{nproc}"
        run_dir.mkdir()
        tree = base.model_dump()
        tree["redis"]["prefix"] = f"mm2-{uuid.uuid4().hex[:8]}"
        tree["run"].update(max_steps=1, dir=str(run_dir))
        tree["orchestrator"]["batch_size"] = 2
        tree["trainer"].update(nproc=nproc, micro_batch_tokens=30)
        outs.append(run_one_step(RunConfig.model_validate(tree), run_dir, redis_url, groups, timeout_s=180))

    (m1, w1), (m2, w2) = outs
    assert m1.routing_replayed_frac == 1.0 and m1.mismatch_kl_k3 > 0
    assert m1.mismatch_kl_k3_on_policy == pytest.approx(m1.mismatch_kl_k3)  # every token is version 0
    for f in (
        "loss",
        "grad_norm",
        "mismatch_kl_k3",
        "mismatch_p_abs_max",
        "mismatch_p_abs_mean",
        "mismatch_ratio_out_frac",
        "routing_agreement_mean",
        "routing_replayed_frac",
    ):
        assert getattr(m2, f) == pytest.approx(getattr(m1, f), rel=1e-5, abs=1e-7), f
    assert m2.routing_agreement == pytest.approx(m1.routing_agreement)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in w1
    # 1e-5: the MoE's per-rank expert sums; the first Adam step's near-eps elements may show more.
    assert_first_adam_step_close(w1, w2, lr=base.trainer.lr, close=1e-5)
