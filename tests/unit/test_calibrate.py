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
    assert main(["calibrate", "--out", str(tmp_path / "x.json"), "--seq-lens", "16,32,64,64"]) == 2
    assert "give at least 4 different lengths" in capsys.readouterr().err


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
