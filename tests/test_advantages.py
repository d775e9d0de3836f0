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
