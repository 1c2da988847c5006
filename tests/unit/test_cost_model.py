"""Cost model: the formula (heads the degree does not divide included), FLOP-derived defaults (FLUX
and Wan), and the NNLS fit against scipy's."""

import argparse
import dataclasses

import numpy as np
import pytest
from scipy.optimize import nnls

from deepspeed_knap.cost.model import COEFFICIENTS, CostModel, degree_efficiency_pairs, fit_cost_model
from deepspeed_knap.models.registry import PRESETS, default_cost_model
from deepspeed_knap.models.wan.spec import from_wan_dims
from deepspeed_knap.planner import build_topology, plan_routing


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


# ---------------------------------------------------------------------------------------------------
# Heads the degree does not divide (issue 23, item 3) and the Wan presets (item 4).


def _busiest_member_heads(heads: int, group: int) -> int:
    """Heads of a group's busiest member, split near-equally as KnapDistributedAttention does."""
    return max(heads // group + (member < heads % group) for member in range(group))


def test_attention_over_heads_the_degree_does_not_divide_runs_at_the_busiest_members_pace():
    a, b, c, s = 2e-6, 3e-10, 1e-7, 50_000.0
    model = CostModel(a, b, c, num_heads=12)
    for g in (1, 2, 3, 4, 5, 6, 8, 12):
        # Each member spends a*s/G on its tokens and b*s^2 * h/H on its h heads of attention; the
        # group waits for its member with the most heads.
        expected = a * s / g + b * s * s * _busiest_member_heads(12, g) / 12 + c * s * (g - 1) / g**2
        assert model.per_gpu_time(np.array([s]), g)[0] == pytest.approx(expected, rel=1e-12), g
    # 12 heads in a group of 8: members of 2 heads and of 1; the group runs at the 2-head pace,
    # 4/3 of an even split's attention.
    assert model.head_factor(np.array([1, 2, 3, 4, 8])).tolist() == [1.0, 1.0, 1.0, 1.0, 4 / 3]
    assert model.head_factor(8) == pytest.approx(np.ceil(12 / 8) * 8 / 12)


def test_unknown_or_divisible_heads_price_exactly_as_before():
    even = CostModel(2e-6, 3e-10, 1e-7, degree_efficiency=((4, 0.9),))
    lengths = np.array([[1.0], [257.0], [4096.0], [75_600.0]])
    sizes = np.array([[1, 2, 4, 8]])
    for heads in (8, 24, 40 * 8):  # divisible by every size here: bit-identical, not approximately
        assert np.array_equal(dataclasses.replace(even, num_heads=heads).per_gpu_time(lengths, sizes),
                              even.per_gpu_time(lengths, sizes))  # fmt: skip
    assert np.array_equal(even.head_factor(sizes), np.ones((1, 4)))
    assert np.all(CostModel(2e-6, 3e-10, num_heads=12).per_gpu_time(lengths, sizes)[:, -1] >
                  even.per_gpu_time(lengths, sizes)[:, -1] - 1e-7 * lengths[:, 0] * 7 / 64)  # fmt: skip


@pytest.mark.parametrize("heads", [0, -3, 2.5, True, "12"])
def test_bad_head_counts_are_refused(heads):
    with pytest.raises(ValueError, match="num_heads must be a positive integer"):
        CostModel(1.0, 1.0, num_heads=heads)


@pytest.mark.parametrize(
    ("name", "d", "ffn", "heads", "layers"),
    [("wan2.1-1.3b", 1536, 8960, 12, 30), ("wan2.1-14b", 5120, 13824, 40, 40), ("wan2.2-ti2v-5b", 3072, 14336, 24, 30)],
)
def test_wan_presets_follow_the_flop_count(name, d, ffn, heads, layers):
    model = default_cost_model(name)
    flops, text = 400e12, 512
    # Per video token and block: 4 d^2 (self-attention projections) + 2 d^2 (cross-attention q, out)
    # + 2 d ffn (FFN), x2 FLOPs, x3 forward + backward; cross-attention over 512 text rows, 2 * 512 * d
    # multiply-adds, x2, x3.5 like attention.
    assert model.linear_coef == pytest.approx(
        (3 * 2 * (6 * d * d + 2 * d * ffn) + 3.5 * 2 * 2 * text * d) * layers / flops
    )
    assert model.quadratic_coef == pytest.approx(3.5 * 2 * 2 * d * layers / flops)
    # Every member projects the text to keys and values itself: 2 * 512 * d^2 per block, whatever G.
    assert model.sequence_coef == pytest.approx(3 * 2 * 2 * text * d * d * layers / flops)
    assert model.alltoall_coef == pytest.approx(8 * d * 2 * layers / 150e9)
    assert model.num_heads == heads
    # The per-sequence term is on every GPU of the group, undivided.
    s = np.array([32_760.0])
    for g in (1, 2, 4, 8):
        expected = (model.linear_coef * s + model.quadratic_coef * s * s * model.head_factor(g)) / g
        expected += model.sequence_coef + model.alltoall_coef * s * (g - 1) / g**2
        assert model.per_gpu_time(s, g) == pytest.approx(expected, rel=1e-12)
    lora = default_cost_model(name, frozen_base=True)
    assert lora.sequence_coef == pytest.approx(model.sequence_coef * 2 / 3)
    assert lora.quadratic_coef == model.quadratic_coef


def test_wan_14b_magnitudes_match_the_design_notes():
    model = default_cost_model("wan2.1-14b")
    # docs/design.md: the text K/V projection is 53.7 GFLOP per block forward, 6.4 TFLOP per step
    # with backward over 40 blocks: at 400 TFLOP/s, 16 ms per sequence and member.
    assert model.sequence_coef == pytest.approx(6.44e12 / 400e12, rel=0.01)
    # Cross-attention over 512 text rows is about 2% of a video token's linear work.
    d, ffn = 5120, 13824
    cross = 3.5 * 2 * 2 * 512 * d / (3 * 2 * (6 * d * d + 2 * d * ffn))
    assert 0.015 < cross < 0.025


def test_wan_dims_and_flux_dims_do_not_mix():
    assert default_cost_model({"dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30}).num_heads == 12
    with pytest.raises(ValueError, match=r"hidden are not dims of Wan 2\.x preset 'wan2\.1-14b', which takes dim, "):
        default_cost_model("wan2.1-14b", hidden=64)
    with pytest.raises(ValueError, match=r"model dims dim, hidden mix the dims of different models"):
        default_cost_model({"dim": 1536, "hidden": 64})
    with pytest.raises(ValueError, match="not a whole number of heads"):
        from_wan_dims(dim=1000, num_heads=12)


def test_the_config_block_and_the_cli_take_wan_presets():
    from deepspeed_knap.commands.plan import parse_model
    from deepspeed_knap.runtime.config import KnapCostModelConfig

    assert KnapCostModelConfig(model="wan2.1-14b").build() == default_cost_model("wan2.1-14b")
    lora = KnapCostModelConfig(model="wan2.1-1.3b", frozen_base=True, tflops=200).build()
    assert lora == default_cost_model("wan2.1-1.3b", frozen_base=True, tflops=200)
    with pytest.raises(ValueError, match=r"Wan 2\.x preset 'wan2\.1-14b' takes none"):
        KnapCostModelConfig(model="wan2.1-14b", hidden=4096)
    assert parse_model("wan2.2-ti2v-5b") == PRESETS["wan2.2-ti2v-5b"][1]
    assert parse_model("num_layers=20") == {**PRESETS["wan2.1-14b"][1], "num_layers": 20}
    assert parse_model("hidden=64") == {**PRESETS["flux-dev"][1], "hidden": 64}
    # Qwen-Image's dims are FLUX.3's but mode_blocks: over Qwen-Image's preset, FLUX.3's adds 5 blocks.
    qwen = ",".join(f"{key}={value}" for key, value in PRESETS["qwen-image"][1].items())
    assert parse_model(qwen) == PRESETS["qwen-image"][1]
    assert parse_model("mode_blocks=3") == {**PRESETS["flux3"][1], "mode_blocks": 3}
    with pytest.raises(argparse.ArgumentTypeError, match=r"key=number pairs of one family's dims"):
        parse_model("hidden=64,dim=128")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ([], None), ([[2, 0.9], [4, 1]], ((2, 0.9), (4, 1.0))), ([[8.0, 0.5]], ((8, 0.5),))],
)
def test_degree_efficiency_pairs_reads_what_calibrate_writes(value, expected):
    pairs = degree_efficiency_pairs(value)
    assert pairs == expected
    assert all(type(g) is int and type(e) is float for g, e in pairs or ())  # 8.0 -> 8, 1 -> 1.0


@pytest.mark.parametrize(
    "value",
    [[[8.7, 0.9]], [[2, 0.9, 1]], [[True, 0.9]], [[2, True]], [[2, "0.9"]], [[float("inf"), 0.9]], [[2, float("nan")]],
     {"2": 0.9}, [["two", 0.9]], [2, 0.9], np.array([[2, 0.9]]), 0, [[10**400, 0.9]], [[2, 0.9], [2, 0.5]],
     [[0, 0.9]], [[2, 0]], [[2, 2.5]]],
)  # fmt: skip
def test_degree_efficiency_pairs_refuses_anything_else_naming_it(value):
    with pytest.raises(ValueError, match=r"degree_efficiency = .*; expected \[\[bag size, efficiency\], \.\.\.\]"):
        degree_efficiency_pairs(value)


@pytest.mark.parametrize("name", COEFFICIENTS)
def test_each_coefficient_flows_through_the_config_block_calibration_files_and_the_refit(name, tmp_path):
    """One name per coefficient: a value given for it in the "knapformer" block reaches the cost
    model, a calibration file carries it, and the online refit plans with it (and keeps it where it
    does not fit it). A coefficient added to COEFFICIENTS must pass all three."""
    import dataclasses

    from deepspeed_knap.cost.calibrate import read_calibration, write_calibration
    from deepspeed_knap.cost.online import FITTED, OnlineCostModel, OnlineSettings
    from deepspeed_knap.runtime.config import KnapCostModelConfig

    assert name in {field.name for field in dataclasses.fields(CostModel)}
    value = 1.25e-7
    model = dataclasses.replace(CostModel(2e-6, 3e-10), **{name: value})
    given = {"linear_coef": 2e-6, "quadratic_coef": 3e-10, name: value}
    assert KnapCostModelConfig(**given).build() == model
    write_calibration(tmp_path / "calibration.json", model, [1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0], {}, {})
    assert read_calibration(tmp_path / "calibration.json") == model
    online = OnlineCostModel(model, 2, OnlineSettings(warmup_steps=1))
    assert getattr(online.model(), name) == value
    plan = plan_routing([[300, 20], [40]], build_topology("g1n2"), model, "refine")
    for _ in range(3):
        online.observe(plan, [3000, 2000], [-1, -1])
    assert online.compute_fitted
    assert name in FITTED or getattr(online.model(), name) == value
