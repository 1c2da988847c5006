"""``deepspeed-knap calibrate``: recovers a known cost model exactly, times real FLUX blocks on CPU,
and writes a file the config's cost_model section reads."""

import json

import pytest

from deepspeed_knap.cli import main
from deepspeed_knap.runtime.config import get_knapformer_config

A, B, OVERHEAD = 3e-6, 2e-10, 0.02


def exact_step(seq_len: int) -> float:
    """A step that reports a known cost (the calibrate protocol: a returned number is the seconds)."""
    return OVERHEAD + A * seq_len + B * seq_len**2


def test_fit_recovers_a_known_model_and_the_config_reads_it(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--out", str(out), "--callable", "tests.unit.test_calibrate:exact_step",
                 "--seq-lens", "100,1000,5000,20000", "--repeats", "1", "--route-gbps", "50",
                 "--route-token-bytes", "256"]) == 0  # fmt: skip
    written = json.loads(out.read_text())
    # Given, not timed: 4 exchanges of a 256-byte row at 50 GB/s.
    assert written["route_coef"] == pytest.approx(4 * 256 / 50e9, rel=1e-12)
    assert written["linear_coef"] == pytest.approx(A, rel=1e-9)
    assert written["quadratic_coef"] == pytest.approx(B, rel=1e-9)
    assert written["overhead_s"] == pytest.approx(OVERHEAD, rel=1e-9)
    assert written["r2"] == pytest.approx(1.0) and written["max_rel_error"] < 1e-9
    model = get_knapformer_config({"knapformer": {"cost_model": {"calibration_file": str(out)}}}).cost_model.build()
    assert (model.linear_coef, model.quadratic_coef) == (written["linear_coef"], written["quadratic_coef"])
    assert model.route_coef == written["route_coef"]
    printed = capsys.readouterr().out
    assert "R^2 = 1.0000" in printed and "alltoall_coef = 0: the file prices Ulysses all-to-alls as free" in printed
    assert main(["calibrate", "--out", str(out), "--callable", "tests.unit.test_calibrate:exact_step",
                 "--route-gbps", "50"]) == 2  # fmt: skip
    assert "--route-gbps 50.0 and --route-token-bytes None: give both" in capsys.readouterr().err


def test_flux_blocks_on_cpu_smoke(tmp_path, capsys):
    out, plot = tmp_path / "cal.json", tmp_path / "cal.png"
    assert main(["calibrate", "--out", str(out), "--seq-lens", "128,512,1024,2048", "--repeats", "3", "--heads", "2",
                 "--head-dim", "8", "--double-blocks", "1", "--single-blocks", "2", "--plot", str(plot),
                 "--alltoall-gbps", "0.4"]) == 0  # fmt: skip
    written = json.loads(out.read_text())
    # Given, not timed: 8 exchanges per block of 16-wide fp32 rows, 3 blocks, at 0.4 GB/s; the same
    # price as the FLOP preset's formula gives at that bandwidth.
    from deepspeed_knap.cost.model import CostModel

    preset = CostModel.from_model_dims(hidden=16, double_blocks=1, single_blocks=2, bytes_per_element=4,
                                       alltoall_gbps=0.4)  # fmt: skip
    assert written["alltoall_coef"] == pytest.approx(8 * 16 * 4 * 3 / 0.4e9, rel=1e-12)
    assert written["alltoall_coef"] == pytest.approx(preset.alltoall_coef, rel=1e-12)
    model = get_knapformer_config({"knapformer": {"cost_model": {"calibration_file": str(out)}}}).cost_model.build()
    assert model.alltoall_coef == written["alltoall_coef"]
    assert "alltoall_coef = 3.84e-06 s per token" in capsys.readouterr().out
    assert main(["calibrate", "--out", str(out), "--callable", "tests.unit.test_calibrate:exact_step",
                 "--alltoall-gbps", "1"]) == 2  # fmt: skip
    assert "a --callable has no known width" in capsys.readouterr().err
    assert written["seq_lens"] == [128, 512, 1024, 2048] and all(t > 0 for t in written["seconds"])
    assert written["linear_coef"] + written["quadratic_coef"] > 0 and plot.stat().st_size > 0


def test_too_few_lengths_is_a_clear_error(tmp_path, capsys):
    """calibrate and doctor alike (doctor fitted 3 parameters to 2 lengths and called it a perfect fit)."""
    for command in (["calibrate", "--out", str(tmp_path / "x.json")], ["doctor", "--out", str(tmp_path / "doctor")]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--seq-lens", "16,32,64,64"])
        assert exit_info.value.code == 2 and "give at least 4 different lengths" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_wan_blocks_on_cpu_and_the_heads_reach_the_cost_model(tmp_path, capsys):
    """--wan times a Wan block of a preset's dims (wan-tiny: 12 heads of 6, 2 layers, 8 text rows); the
    file carries the heads, so groups they do not divide are priced (a group of 8 runs 2 of 12 heads)."""
    out = tmp_path / "wan.json"
    assert main(["calibrate", "--out", str(out), "--seq-lens", "64,128,256,512", "--repeats", "1",
                 "--wan", "wan-tiny"]) == 0  # fmt: skip
    written = json.loads(out.read_text())
    assert written["blocks"] == "Wan wan-tiny: 2 blocks, 12x6 heads, 8 text rows" and written["num_heads"] == 12
    assert all(t > 0 for t in written["seconds"]) and written["linear_coef"] + written["quadratic_coef"] > 0
    model = get_knapformer_config({"knapformer": {"cost_model": {"calibration_file": str(out)}}}).cost_model.build()
    assert model.num_heads == 12 and model.head_factor(8) == pytest.approx(2 * 8 / 12)
    capsys.readouterr()
    assert main(["calibrate", "--out", str(out), "--seq-lens", "64,128,256,1500", "--wan", "wan-tiny"]) == 2
    assert "lengths above 1024 must be multiples of 1024; got 1500" in capsys.readouterr().err


def _times(seq_lens, a, b, overhead, slow=(), ranks=4, noise=0.0, seed=0):
    """``[ranks][M]`` seconds of ``overhead + a s + b s^2``, rank ``r`` in ``slow`` (a dict of
    factors) that many times slower, with relative noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    s = np.asarray(seq_lens, dtype=float)
    base = overhead + a * s + b * s * s
    return [(base * dict(slow).get(r, 1.0) * (1 + noise * rng.standard_normal(len(s)))).tolist() for r in range(ranks)]


SEQ_LENS = [1024, 2048, 4096, 8192]


def test_startup_model_fits_the_ranks_times_and_calls_only_a_slow_rank():
    from deepspeed_knap.cost.calibrate import startup_model
    from deepspeed_knap.cost.model import CostModel

    prior = CostModel(1e-6, 1e-10, alltoall_coef=2e-7, sequence_coef=1e-3, route_coef=5e-8)
    a, b = 4e-5, 3e-9
    result = startup_model(prior, SEQ_LENS, _times(SEQ_LENS, a, b, 0.2, slow={2: 2.0}, ranks=5, noise=0.01))
    model = result.model
    assert model.linear_coef == pytest.approx(a, rel=0.15) and model.quadratic_coef == pytest.approx(b, rel=0.05)
    assert (
        result.speeds[2] == pytest.approx(0.5, abs=1 / 32)
        and [s for r, s in enumerate(result.speeds) if r != 2] == [1.0] * 4
    )
    assert model.gpu_speed == result.speeds
    # The prior's link and per-sequence prices scale as its compute did; its route prices are kept.
    scale = (a * 8192 + b * 8192**2) / (1e-6 * 8192 + 1e-10 * 8192**2)
    assert result.scale == pytest.approx(scale, rel=0.05)
    assert model.alltoall_coef == pytest.approx(2e-7 * result.scale) and model.sequence_coef == pytest.approx(
        1e-3 * result.scale
    )
    assert model.route_coef == 5e-8
    assert result.fit["alltoall"] == "scaled"


def test_startup_model_takes_the_ranks_timed_exchange_price():
    """Timed Ulysses exchanges replace the scaled prior's ``c``: the lower median of the ranks that
    timed one (as for the compute), with ``c'`` in the prior's ratio to ``c``; the compute is as before."""
    import dataclasses

    from deepspeed_knap.cost.calibrate import startup_model
    from deepspeed_knap.cost.model import CostModel

    prior = CostModel(1e-6, 1e-10, alltoall_coef=2e-7, inter_node_alltoall_coef=6e-7, sequence_coef=1e-3)
    times = _times(SEQ_LENS, 4e-5, 3e-9, 0.2, ranks=5)
    scaled = startup_model(prior, SEQ_LENS, times)
    timed = startup_model(prior, SEQ_LENS, times, [3e-6, None, 1e-6, 2e-6, 9e-6])
    assert timed.fit["alltoall"] == "timed" and timed.model.alltoall_coef == 2e-6  # lower median of 4
    assert timed.model.inter_node_alltoall_coef == pytest.approx(6e-6)
    assert timed.model.sequence_coef == scaled.model.sequence_coef  # still scaled as the compute was
    assert (timed.model.linear_coef, timed.model.quadratic_coef) == (scaled.model.linear_coef,
                                                                     scaled.model.quadratic_coef)  # fmt: skip
    assert startup_model(prior, SEQ_LENS, times, [None] * 5).model == scaled.model  # no rank in a group
    # Prices the user gave stay as given, 0 included; the compute is fitted as before.
    kept = startup_model(dataclasses.replace(prior, alltoall_coef=0.0), SEQ_LENS, times, None, ["alltoall_coef"])
    assert kept.fit["alltoall"] == "given" and kept.model.alltoall_coef == 0.0
    assert kept.model.linear_coef == scaled.model.linear_coef
    c_prime = startup_model(prior, SEQ_LENS, times, [3e-6, 3e-6, 3e-6, 3e-6, 3e-6], ["inter_node_alltoall_coef"])
    assert c_prime.model.alltoall_coef == 3e-6 and c_prime.model.inter_node_alltoall_coef == 6e-7
    with pytest.raises(ValueError, match="positive all-to-all prices"):
        startup_model(prior, SEQ_LENS, times, [1e-6, 0.0, None, None, None])


def test_startup_model_on_equal_ranks_with_noise_calls_no_speed():
    """1,024 simulated ranks timing alike within 5% noise: no rank is called, over 20 draws."""
    from deepspeed_knap.cost.calibrate import startup_model
    from deepspeed_knap.cost.model import CostModel

    for seed in range(20):
        times = _times(SEQ_LENS, 4e-5, 3e-9, 0.1, ranks=1024, noise=0.05, seed=seed)
        result = startup_model(CostModel(1e-6, 1e-10), SEQ_LENS, times)
        assert set(result.speeds) == {1.0} and result.model.gpu_speed is None


def test_startup_model_refuses_what_it_cannot_fit():
    from deepspeed_knap.cost.calibrate import startup_model
    from deepspeed_knap.cost.model import CostModel

    with pytest.raises(ValueError, match="needs >= 3 different lengths"):
        startup_model(CostModel(1, 1), [64, 64, 128], [[1.0, 1.0, 2.0]])
    with pytest.raises(ValueError, match="positive seconds"):
        startup_model(CostModel(1, 1), [64, 128, 256], [[1.0, 0.0, 2.0]])
    with pytest.raises(ValueError, match="do not grow with the length"):
        startup_model(CostModel(1, 1), [64, 128, 256], [[1.0, 1.0, 1.0]])


def test_startup_calibration_config_and_when_auto_turns_it_on():
    base = {"enabled": True, "topology": "auto"}
    read = lambda cost_model: get_knapformer_config({"knapformer": {**base, "cost_model": cost_model}}).cost_model  # noqa: E731
    preset, measured = read({"model": "flux-dev"}), read({"linear_coef": 1.0, "quadratic_coef": 1.0})
    assert preset.startup_calibration.enabled == "auto" and preset.startup_calibration.seq_lens == SEQ_LENS
    assert preset.calibrates_at_start(True, "flux") and not preset.calibrates_at_start(False, "flux")
    assert not preset.calibrates_at_start(True, None) and not measured.calibrates_at_start(True, "flux")
    on = read({"model": "flux-dev", "startup_calibration": True})
    assert on.calibrates_at_start(False, "wan") and not read({"startup_calibration": False}).calibrates_at_start(
        True, "wan"
    )
    with pytest.raises(ValueError, match="this model has no family"):
        on.calibrates_at_start(True, None)
    # The default lengths stop at the memory cap (no GPU holds more); lengths given are timed as given.
    assert on.startup_calibration.timed_lengths(None) == SEQ_LENS
    assert on.startup_calibration.timed_lengths(5000) == [1024, 2048, 4096]
    assert on.startup_calibration.timed_lengths(3000) == [750, 1500, 3000]
    # Under a cap of a few tokens: the half and the quarter rounded up, so that 3 tokens still give 3 lengths.
    assert on.startup_calibration.timed_lengths(3) == [1, 2, 3]
    assert on.startup_calibration.timed_lengths(2) == [1, 2]
    # Fewer than 3 (a cap of 1 or 2): true is refused as the config is read (either spelling), "auto" does not time.
    capped = {**base, "max_tokens_per_gpu": 2}
    for spelling in ("cost_model", "workload"):
        with pytest.raises(ValueError, match=r'"max_tokens_per_gpu": 2 leaves "startup_calibration" \("enabled": true'):
            get_knapformer_config({"knapformer": {**capped, spelling: {"startup_calibration": True}}})
    for allowed in ({"knapformer": {**capped, "cost_model": {"startup_calibration": {"enabled": True,
                                                                                     "seq_lens": [1, 2, 4]}}}},
                    {"knapformer": {**capped, "enabled": False, "cost_model": {"startup_calibration": True}}}):  # fmt: skip
        get_knapformer_config(allowed)
    auto = get_knapformer_config({"knapformer": capped}).cost_model
    assert auto.calibrates_at_start(True, "flux", 3) and not auto.calibrates_at_start(True, "flux", 2)
    given = read({"startup_calibration": {"seq_lens": [512, 8192, 16384]}}).startup_calibration
    assert given.timed_lengths(5000) == [512, 8192, 16384]
    for bad, message in [({"seq_lens": [64, 64, 128]}, "at least 3 different lengths"),
                         ({"repeats": 0}, "repeats"), ({"lengths": [1]}, "lengths")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            read({"startup_calibration": bad})


def test_block_fraction_scales_a_copy_of_whole_ratios():
    from deepspeed_knap.models.timing import block_fraction

    keys = ("num_layers", "num_single_layers")
    assert block_fraction({"num_layers": 19, "num_single_layers": 38}, keys) == (
        {"num_layers": 1, "num_single_layers": 2},
        19.0,
    )
    assert block_fraction({"num_layers": 8, "num_single_layers": 48}, keys) == (
        {"num_layers": 1, "num_single_layers": 6},
        8.0,
    )
    assert block_fraction({"num_layers": 40}, ("num_layers",)) == ({"num_layers": 1}, 40.0)
    with pytest.raises(ValueError, match="gives no blocks"):
        block_fraction({"num_layers": 0}, ("num_layers",))


@pytest.mark.parametrize(("checkpointing", "frozen"), [(False, False), (True, False), (False, True)])
def test_every_family_s_blocks_are_timed_with_checkpointing_and_frozen_blocks(checkpointing, frozen):
    """The start-up timer runs every registered family's tiny model (FLUX.3 calls its blocks' parts
    from functions, a double-stream model's last text modules get no gradient), with its gradient
    checkpointing, and with its blocks frozen (LoRA's base weights: the backward still runs through
    them): its hooks find where the blocks' work starts and ends, forward and backward, and the seconds
    are positive (whether they grow with the length is the fit's to check: a loaded CPU's timings at
    these lengths do not always). What it says the whole model's blocks exchange is one Ulysses
    attention of the config's heads per block, and half of one more per checkpointed block (its
    recompute runs the forward's two all-to-alls of the four)."""
    import torch

    from deepspeed_knap.cost.calibrate import time_lengths
    from deepspeed_knap.models.registry import family_names, spec
    from deepspeed_knap.models.timing import model_step_timer

    for family in family_names():
        model = spec(family).model_class(**spec(family).tiny_config, gradient_checkpointing=checkpointing)
        for block in model.block_stack if frozen else ():
            block.requires_grad_(False)
        step = model_step_timer(model, "cpu", torch.float32)
        times = time_lengths(step, [128, 256], 1, progress=False)
        assert all(0 < t < float("inf") for t in times), (family, times)
        config = spec(family).tiny_config
        blocks = sum(config[key] for key in spec(family).block_counts)
        calls = blocks * (1.5 if checkpointing else 1.0)
        assert step.ulysses_calls == [[config["num_attention_heads"], config["attention_head_dim"], "float32", calls]]


def test_a_term_the_lengths_do_not_show_keeps_the_prior_s_ratio_scaled():
    """H200 (run17), Qwen-Image's block stack at 1k-8k tokens: a fixed cost hid the linear work, and
    the free fit put a at 0. Then the prior's a : b stands, scaled to the times."""
    import numpy as np

    from deepspeed_knap.cost.calibrate import fit_times, startup_model
    from deepspeed_knap.cost.model import CostModel

    times = [0.463, 0.427, 0.711, 1.502]
    assert fit_times(SEQ_LENS, times)[0].linear_coef == 0
    result = startup_model(CostModel(1e-6, 1e-10), SEQ_LENS, [times, times])
    assert result.fit["shape"] == "prior"
    assert result.model.linear_coef / result.model.quadratic_coef == pytest.approx(1e4)
    s = np.asarray(SEQ_LENS, dtype=float)
    predicted = result.fit["overhead_s"] + result.model.linear_coef * s + result.model.quadratic_coef * s * s
    assert np.abs(predicted - np.asarray(times)).max() < 0.1
    assert startup_model(CostModel(1e-6, 1e-10), SEQ_LENS, _times(SEQ_LENS, 4e-5, 3e-9, 0.2)).fit["shape"] == "fitted"


def test_startup_speeds_reach_each_balance_group_as_its_own_and_stay_bounded():
    """Every rank of the world is timed, but a balance group's planner prices its own ranks: with
    two replicas of g2 (4 ranks) and rank 3 slow, the model had 4 speeds for a group of 2, and the
    first plan raised (or applied replica 0's speeds to every replica). A rank 100x slower rounded to
    a speed of 0, which the cost model refused."""
    from types import SimpleNamespace

    from deepspeed_knap.cost.calibrate import startup_model
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.planner import build_topology, plan_loads, plan_routing
    from deepspeed_knap.runtime.calibration import _for_balance_group

    prior = CostModel(1e-6, 1e-10)
    world = startup_model(prior, SEQ_LENS, _times(SEQ_LENS, 4e-5, 3e-9, 0.2, slow={3: 2.0}, ranks=4, noise=0.0))
    assert world.speeds == (1.0, 1.0, 1.0, 0.5)
    topology = build_topology("g2n1", 4)  # a balance group of 2 ranks, 2 replicas
    for replica, expected in ((0, None), (1, (1.0, 0.5))):
        groups = SimpleNamespace(topology=topology, replica=replica)
        model = _for_balance_group(world, groups).model
        assert model.gpu_speed == expected and _for_balance_group(world, groups).speeds == world.speeds
        plan = plan_routing([[300, 200], [500]], topology, model)  # plans and prices its 2 GPUs
        assert len(plan_loads(plan, model)) == 2
    crawling = startup_model(prior, SEQ_LENS, _times(SEQ_LENS, 4e-5, 3e-9, 0.2, slow={2: 100.0}, ranks=4, noise=0.0))
    assert crawling.speeds[2] == 0.25 and crawling.model.gpu_speed[2] == 0.25  # 1/4, not 0


def test_a_calibration_file_s_heads_are_a_positive_whole_number(tmp_path):
    """int() turned 12.5 heads into 12 and true into 1, and 0 into no heads at all."""
    from deepspeed_knap.cost.calibrate import read_calibration

    for heads in (12.5, True, 0, "12"):
        (tmp_path / "c.json").write_text(json.dumps({"linear_coef": 1e-6, "quadratic_coef": 1e-10, "num_heads": heads}))
        with pytest.raises(ValueError, match="num_heads must be a positive integer"):
            read_calibration(tmp_path / "c.json")
    (tmp_path / "c.json").write_text(json.dumps({"linear_coef": 1e-6, "quadratic_coef": 1e-10, "num_heads": 12}))
    assert read_calibration(tmp_path / "c.json").num_heads == 12


def test_startup_model_keeps_a_given_per_sequence_price_and_c_prime_beside_a_given_c():
    """A measured sequence_coef was scaled as the FLOP prior's compute; and with c given (not timed)
    c' was scaled while c stayed, breaking the c' : c ratio the docs promise."""
    from deepspeed_knap.cost.calibrate import startup_model
    from deepspeed_knap.cost.model import CostModel

    prior = CostModel(1e-6, 1e-10, alltoall_coef=2e-7, inter_node_alltoall_coef=8e-7, sequence_coef=1e-3)
    times = _times(SEQ_LENS, 4e-5, 3e-9, 0.2, ranks=3, noise=0.0)
    model = startup_model(prior, SEQ_LENS, times, given=("alltoall_coef", "sequence_coef")).model
    assert (model.alltoall_coef, model.inter_node_alltoall_coef, model.sequence_coef) == (2e-7, 8e-7, 1e-3)
    scaled = startup_model(prior, SEQ_LENS, times).model  # nothing given: all scale alike, the ratio kept
    assert scaled.inter_node_alltoall_coef / scaled.alltoall_coef == pytest.approx(4.0)
    assert scaled.sequence_coef != 1e-3
