"""Workload model: the formula, FLOP-derived defaults, and the NNLS fit against scipy's."""

import numpy as np
import pytest
from scipy.optimize import nnls

from deepspeed_knap.cost.model import CostModel, default_cost_model, fit_cost_model


def test_formula_splits_compute_and_adds_alltoall_only_for_bags():
    model = CostModel(linear_coef=2.0, quadratic_coef=0.5, alltoall_coef=3.0)
    s = np.array([10.0])
    assert model.per_gpu_time(s, 1) == pytest.approx(2 * 10 + 0.5 * 100)
    assert model.per_gpu_time(s, 4) == pytest.approx((2 * 10 + 0.5 * 100) / 4 + 3.0 * 10 * 3 / 16)
    assert model.per_gpu_time(s, 4, bag_speed=2.0) == pytest.approx((2 * 10 + 0.5 * 100) / 8 + 3.0 * 10 * 3 / 16)


def test_flux_dev_defaults_follow_the_flop_count():
    model = default_cost_model("flux-dev")
    d, blocks, flops = 3072, 19 + 38, 400e12
    # 12 d^2 multiply-adds per token per block (q, k, v, out, MLP 4x), x2 FLOPs, x3 forward + backward.
    assert model.linear_coef == pytest.approx(3 * 2 * 12 * d * d * blocks / flops)
    # 2 s d multiply-adds per token for scores and values, x2 FLOPs, x3.5 with flash recompute.
    assert model.quadratic_coef == pytest.approx(3.5 * 2 * 2 * d * blocks / flops)
    assert model.alltoall_coef == pytest.approx(8 * d * 2 * blocks / 150e9)
    # Sanity: attention overtakes the linear layers near 5 * d tokens.
    crossover = model.linear_coef / model.quadratic_coef
    assert 4 * d < crossover < 6 * d


def test_group_speeds_take_the_slowest_gpu_and_check_the_length():
    model = CostModel(1.0, 0.0, gpu_speed=(1.0, 0.5, 2.0, 2.0))
    assert model.group_speeds((0, 2, 0, 3), (2, 2, 4, 1), 4).tolist() == [0.5, 2.0, 0.5, 2.0]  # groups may overlap
    with pytest.raises(ValueError, match=r"gpu_speed has 4 entries but the balance group has 8 ranks"):
        model.group_speeds((0,), (8,), 8)


@pytest.mark.parametrize("bad", [{"linear_coef": -1.0, "quadratic_coef": 1.0}, {"linear_coef": float("nan"), "quadratic_coef": 1.0},
                                 {"linear_coef": 0.0, "quadratic_coef": 0.0}, {"linear_coef": 1.0, "quadratic_coef": 1.0, "gpu_speed": (1.0, 0.0)}])  # fmt: skip
def test_bad_coefficients_are_rejected(bad):
    with pytest.raises(ValueError):
        CostModel(**bad)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown model preset 'flux-xl'.*flux-dev"):
        default_cost_model("flux-xl")


def test_fit_recovers_exact_coefficients_including_the_alltoall():
    rng = np.random.default_rng(0)
    truth = CostModel(3e-6, 2e-10, 7e-7)
    lengths = rng.integers(256, 120_000, size=40)
    bags = rng.choice([1, 2, 4, 8], size=40)
    fitted = fit_cost_model(lengths, truth.per_gpu_time(lengths, bags), bags)
    assert fitted.linear_coef == pytest.approx(truth.linear_coef, rel=1e-6)
    assert fitted.quadratic_coef == pytest.approx(truth.quadratic_coef, rel=1e-6)
    assert fitted.alltoall_coef == pytest.approx(truth.alltoall_coef, rel=1e-6)


def test_fit_equals_scipy_nnls_on_noisy_and_adversarial_data():
    rng = np.random.default_rng(1)
    for trial in range(20):
        lengths = rng.integers(100, 50_000, size=12).astype(float)
        bags = rng.choice([1, 2, 8], size=12).astype(float)
        # Every third trial has a negative linear term, pushing the unconstrained fit below zero.
        linear = 2e-6 if trial % 3 else -2e-6
        times = (1e-10 * lengths**2 + linear * lengths) / bags + 1e-6 * lengths * (bags - 1) / bags**2
        times = np.maximum(times + rng.normal(0, 1e-4, size=12), 0)
        fitted = fit_cost_model(lengths, times, bags)
        columns = np.stack([lengths / bags, lengths**2 / bags, lengths * (bags - 1) / bags**2], axis=1)
        norms = np.linalg.norm(columns, axis=0)
        reference, _ = nnls(columns / norms, times)
        reference /= norms
        ours = np.array([fitted.linear_coef, fitted.quadratic_coef, fitted.alltoall_coef])
        assert np.all(ours >= 0)
        ours_residual = np.sum((columns @ ours - times) ** 2)
        assert ours_residual <= np.sum((columns @ reference - times) ** 2) * (1 + 1e-9) + 1e-18


def test_fit_rejects_bad_measurements():
    with pytest.raises(ValueError, match="equal lengths"):
        fit_cost_model([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive lengths"):
        fit_cost_model([0, 2, 3], [1.0, 2.0, 3.0])
