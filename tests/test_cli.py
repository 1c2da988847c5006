"""``deepspeed-knap plan`` end to end: table, JSON, plot, lengths file, errors."""

import json
import subprocess
import sys

import pytest

from deepspeed_knap.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_default_table_compares_all_solvers(capsys):
    code, out, _ = run_cli(capsys, "plan", "--topology", "g4n2", "--workload", "kf_image_video", "--repeat", "1")
    assert code == 0
    for solver in ("none", "knapformer", "refine"):
        assert f"\n{solver} " in out
    assert "lower bound on the modeled step" in out


def test_json_has_the_promised_fields_per_solver(capsys):
    code, out, _ = run_cli(
        capsys, "plan", "--topology", "g1n4+g2n2", "--workload", "long_video", "--json", "--repeat", "1"
    )
    assert code == 0
    report = json.loads(out)
    assert report["num_gpus"] == 8 and set(report["solvers"]) == {"none", "knapformer", "refine"}
    for row in report["solvers"].values():
        assert {"imbalance", "lower_bound", "solve_ms", "gpu_loads", "tokens_moved_fraction"} <= set(row)
        assert len(row["gpu_loads"]) == 8 and row["ratio_to_lower_bound"] >= 1 - 1e-9
    assert report["solvers"]["refine"]["max_load_s"] <= report["solvers"]["knapformer"]["max_load_s"]


def test_lengths_file_cap_and_plot(tmp_path, capsys):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([[4096, 256], [], [16384], [512, 512, 512]]))
    plot = tmp_path / "loads.png"
    code, out, _ = run_cli(capsys, "plan", "--topology", "g2n2", "--lengths", str(lengths), "--max-tokens-per-gpu",
                           "9000", "--solver", "refine", "--plot", str(plot), "--json", "--repeat", "1")  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert set(report["solvers"]) == {"none", "refine"}
    assert report["solvers"]["refine"]["max_gpu_tokens"] <= 9000
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "g8n4+g2"], "malformed topology term 'g2'"),
        (["--topology", "g2n2", "--max-tokens-per-gpu", "100", "--workload", "long_video"], "max_tokens_per_gpu=100"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    code, _, err = run_cli(capsys, "plan", *argv, "--repeat", "1")
    assert code == 2 and message in err


def test_console_entry_point_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "deepspeed_knap.cli", "plan", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "--max-tokens-per-gpu" in result.stdout
