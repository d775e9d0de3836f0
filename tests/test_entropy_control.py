import pytest

from services.common.config import load_config
from trainer.entropy import EntropyControl


def test_fixed_coefficient_never_moves() -> None:
    c = EntropyControl(coef=0.01)
    assert not c.adaptive and c.needs_grad
    for h in (0.0, 5.0):
        assert c.update(h) == 0.01
    assert not EntropyControl(coef=0.0).needs_grad


def test_adaptive_rises_below_target_and_falls_above() -> None:
    c = EntropyControl(coef=0.0, target=0.5, lr=0.01, coef_max=0.02)
    assert c.needs_grad  # may act later even at coefficient 0
    assert c.update(2.0) == 0.0  # above target: clamped at 0
    assert c.update(0.3) == pytest.approx(0.002)  # 0.01 * (0.5 - 0.3)
    for _ in range(50):
        c.update(0.0)
    assert c.coef == 0.02  # clamped at coef_max
    c.update(1.5)
    assert c.coef == pytest.approx(0.01)


def test_state_round_trip_only_when_adaptive() -> None:
    a = EntropyControl(coef=0.0, target=0.5, lr=0.01, coef_max=0.05)
    a.update(0.0)
    b = EntropyControl(coef=0.0, target=0.5, lr=0.01, coef_max=0.05)
    b.load_state_dict(a.state_dict())
    assert b.coef == a.coef > 0
    fixed = EntropyControl(coef=0.003)
    fixed.load_state_dict({"coef": 0.5})
    assert fixed.coef == 0.003


def test_config_rejects_a_target_without_room_to_act() -> None:
    with pytest.raises(Exception, match="entropy_coef_max"):
        load_config("debug", ["--trainer.entropy_target=0.3", "--trainer.entropy_coef_max=0"])


def test_trainer_steers_the_coefficient(redis_url: str, tmp_path) -> None:
    import uuid

    from services.common.config import RunConfig
    from services.common.schemas import RolloutGroup, Sample
    from trainer.train import Dist, Trainer

    cfg = load_config("debug")
    tree = cfg.model_dump()
    tree["redis"]["prefix"] = f"ent-{uuid.uuid4().hex[:8]}"
    # A target above any reachable entropy: the coefficient must rise by lr * (target - H).
    tree["trainer"].update(entropy_target=10.0, entropy_coef_lr=0.001, entropy_coef_max=1.0)
    t = Trainer(RunConfig.model_validate(tree), tmp_path, redis_url, Dist("cpu"))
    t.setup()
    samples = [
        Sample(
            rollout_id=f"s{i}",
            tokens=[5, 6, 7, 8, 9, 10],
            loss_mask=[0, 0, 0, 1, 1, 1],
            logprobs=[0.0, 0.0, 0.0, -4.0, -4.0, -4.0],
            versions=[-1, -1, -1, 0, 0, 0],
            reward=float(i % 2),
            advantage=float(i % 2) - 0.5,
        )
        for i in range(4)
    ]
    groups = [RolloutGroup(group_id="g", env="reverse", seed=0, samples=samples)]
    first = t.train_step(groups)
    assert first.entropy_coef == 0.0
    assert t.entropy.coef == pytest.approx(0.001 * (10.0 - first.entropy))
    second = t.train_step(groups)
    assert second.entropy_coef == pytest.approx(0.001 * (10.0 - first.entropy))
    assert t.entropy.coef > second.entropy_coef
