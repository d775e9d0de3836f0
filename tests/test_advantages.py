import math

from services.orchestrator.rollout import group_advantages


def test_mean_baseline() -> None:
    assert group_advantages([1.0, 0.0, 0.5, 0.5], std_norm=False) == [0.5, -0.5, 0.0, 0.0]


def test_std_normalised_has_unit_variance() -> None:
    adv = group_advantages([1.0, 0.0, 0.25, 0.25], std_norm=True)
    assert math.isclose(sum(adv), 0.0, abs_tol=1e-12)
    assert math.isclose(sum(a * a for a in adv) / len(adv), 1.0, rel_tol=1e-12)


def test_constant_group_has_no_signal() -> None:
    assert group_advantages([0.7] * 8, std_norm=True) == [0.0] * 8
    assert all(abs(a) < 1e-12 for a in group_advantages([0.7] * 8, std_norm=False))


def test_baseline_prior_counts_full_reward_samples() -> None:
    # b = (sum + k) / (n + k): a group that got nothing is pushed away from what it sampled,
    # an all-right group still gets 0, and k = 0 is the plain group mean.
    assert group_advantages([0.0] * 4, std_norm=False, prior=2.0) == [-2 / 6] * 4
    assert all(abs(a) < 1e-12 for a in group_advantages([1.0] * 4, std_norm=False, prior=2.0))
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], std_norm=False, prior=1.0)
    assert adv == [1 - 2 / 5, -2 / 5, -2 / 5, -2 / 5]
    assert group_advantages([1.0, 0.0], std_norm=False, prior=0.0) == [0.5, -0.5]
