"""``deepspeed-knap plan`` end to end: table, JSON, plot, lengths file, errors."""

import argparse
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
    code, out, _ = run_cli(capsys, "plan", "--topology", "g4n2", "--mix", "kf_image_video", "--repeat", "1")
    assert code == 0
    for solver in ("none", "knapformer", "refine"):
        assert f"\n{solver} " in out
    assert "lower bound on the modeled step" in out


def test_json_has_the_promised_fields_per_solver(capsys):
    code, out, _ = run_cli(capsys, "plan", "--topology", "g1n4+g2n2", "--mix", "long_video", "--json", "--repeat", "1")
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


def test_auto_compares_against_the_flexible_bound(capsys):
    code, out, _ = run_cli(capsys, "plan", "--topology", "auto", "--gpus", "16", "--mix", "kf_mixed_res",
                           "--json", "--repeat", "1")  # fmt: skip
    report = json.loads(out)
    assert code == 0 and report["num_gpus"] == 16 and report["max_degree"] == 8
    assert set(report["solvers"]) == {"none", "refine"}  # knapformer needs fixed bags
    refine = report["solvers"]["refine"]
    assert refine["lower_bound"] == report["flexible_lower_bound"] <= refine["max_load_s"]
    code, out, _ = run_cli(capsys, "plan", "--topology", "g8n2", "--mix", "kf_mixed_res", "--json", "--repeat", "1")
    fixed = json.loads(out)
    # The elastic bound relaxes the fixed one: every fixed plan is an auto plan.
    assert fixed["flexible_lower_bound"] == report["flexible_lower_bound"] <= fixed["solvers"]["refine"]["lower_bound"]


def test_auto_with_groups_of_whole_nodes_reports_the_bound_of_its_cap(tmp_path, capsys):
    """9,000 tokens under a cap of 3,000 need the group of both 2-GPU nodes, which only the cap opens."""
    lengths = tmp_path / "long.json"
    lengths.write_text("[[9000], [100], [200], [300]]")
    code, out, _ = run_cli(capsys, "plan", "--topology", "auto", "--gpus-per-node", "2", "--max-degree", "4",
                           "--lengths", str(lengths), "--max-tokens-per-gpu", "3000", "--json", "--repeat", "1")  # fmt: skip
    refine = json.loads(out)["solvers"]["refine"]
    assert code == 0 and refine["max_gpu_tokens"] <= 3000
    assert refine["lower_bound"] == json.loads(out)["flexible_lower_bound"] <= refine["max_load_s"]


def test_a_bag_only_it_can_hold_under_the_cap_is_planned_with_no_flexible_bound(tmp_path, capsys):
    """30,000 tokens under a cap of 10,000 fit the bag of 3 GPUs, not the groups of 1 and 2 the
    flexible bound prices: the plan is reported with that bound n/a (it refused the command)."""
    lengths = tmp_path / "long.json"
    lengths.write_text("[[30000], [], []]")
    argv = ["plan", "--topology", "g3n1", "--lengths", str(lengths), "--max-tokens-per-gpu", "10000", "--repeat", "1"]
    code, out, _ = run_cli(capsys, *argv, "--json")
    report = json.loads(out)
    assert code == 0 and report["flexible_lower_bound"] is None
    assert report["solvers"]["refine"]["max_gpu_tokens"] == 10000
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0 and "(auto): n/a (such groups cannot hold every sequence under the cap)" in out


def test_bags_that_cross_nodes_are_planned_with_a_note(capsys):
    """g6n2 over nodes of 4: a bag of 6 holds part of a node, which a training config refuses; plan
    prices it and says so (it said nothing). So does g2n1+g1n1, aligned within one group of 3 but not
    in the copies training lays back to back. Bags of whole nodes (g8n4 over nodes of 4) are aligned."""
    for topology in ("g6n2", "g2n1+g1n1"):
        code, out, _ = run_cli(capsys, "plan", "--topology", topology, "--gpus-per-node", "4", "--repeat", "1")
        assert code == 0 and "note: bags cross node boundaries (nodes of 4 GPUs) here" in out, topology
    code, out, _ = run_cli(capsys, "plan", "--topology", "g8n4", "--gpus-per-node", "4", "--repeat", "1", "--json")
    assert code == 0 and json.loads(out)["node_aligned"] is True


def test_text_says_one_sequence_not_one_sequences(tmp_path, capsys):
    lengths = tmp_path / "one.json"
    lengths.write_text("[[4096], []]")
    code, out, _ = run_cli(capsys, "plan", "--topology", "g2n1", "--lengths", str(lengths), "--repeat", "1")
    assert code == 0 and "1 sequence, 4,096 tokens" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "g8n4+g2"], "malformed topology term 'g2'"),
        (["--topology", "g2n2", "--max-tokens-per-gpu", "100", "--mix", "long_video"], "max_tokens_per_gpu=100"),
        (["--lengths", "/nonexistent/lengths.json"], "cannot read --lengths /nonexistent/lengths.json"),
        (["--topology", "g8n4", "--max-degree", "4"], "--max-degree 4 applies to --topology auto only"),
        (["--topology", "auto", "--max-degree", "3"], "max_degree must be a power of two"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    code, _, err = run_cli(capsys, "plan", *argv, "--repeat", "1")
    assert code == 2 and message in err and err.startswith("deepspeed-knap plan: error: ")


@pytest.mark.parametrize("content, message", [("[1, 2]", "one list of lengths per rank"),
                                              ("[[1.5], []]", "rank 0: sequence 0 has length 1.5")])  # fmt: skip
def test_bad_lengths_files_exit_2_naming_the_problem(tmp_path, capsys, content, message):
    lengths = tmp_path / "bad.json"
    lengths.write_text(content)
    code, _, err = run_cli(capsys, "plan", "--topology", "g2n1", "--lengths", str(lengths), "--repeat", "1")
    assert code == 2 and message in err


def test_piping_into_head_ends_quietly():
    result = subprocess.run(
        f"{sys.executable} -m deepspeed_knap.cli plan --topology g1n8 --mix kf_lowres --repeat 1 | head -1",
        shell=True, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith("topology g1n8")
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_plan_help_describes_plan_only_and_each_default_once():
    from deepspeed_knap.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    assert ":mod:" not in text and "calibrate" not in text and "--topology auto" in text
    options = text[text.index("options:") :]
    solver_help = options[options.index("--solver") : options.index("--model")]
    assert solver_help.count("default") == 1


def test_every_command_help_shows_its_defaults_and_keeps_its_examples():
    """Every command's and benchmark's help names each option's default (the benchmarks' and
    doctor's named none) but a flag's, and keeps its description's lines as written (generate's
    examples ran together into one paragraph)."""
    from deepspeed_knap.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    benches = commands.pop("bench")._subparsers._group_actions[0].choices
    parsers = commands | {f"bench {name}": parser for name, parser in benches.items()}
    assert len(parsers) == 11
    for name, parser in parsers.items():
        shown = [action for action in parser._actions if action.option_strings and action.help
                 and action.default not in (None, argparse.SUPPRESS) and action.nargs != 0]  # fmt: skip
        formatter = parser._get_formatter()
        assert shown and all("%(default)" in formatter._get_help_string(action) for action in shown), name
        assert not any("%(default)" in formatter._get_help_string(action) for action in parser._actions
                       if action.nargs == 0), name  # fmt: skip
    generate = parsers["generate"].format_help()
    assert "\n    deepspeed-knap generate --requests prompts.jsonl --tiny --out images/" in generate
    assert "(default: False)" not in generate


def test_console_entry_point_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "deepspeed_knap.cli", "plan", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "--max-tokens-per-gpu" in result.stdout


@pytest.mark.parametrize(
    "content, topology, message",
    [
        (
            "[[9223372036854775807], [5]]",
            "g1n2",
            "rank 0: sequence 0 has length 9223372036854775807, over 2**40 tokens",
        ),
        ("[[1e300]]", "g1n1", "rank 0: sequence 0 has length 1e+300 (a float)"),
        ("[[Infinity]]", "g1n1", "rank 0: sequence 0 has length inf (a float)"),
        (
            "[[4611686018427387904, 4611686018427387904]]",
            "g1n1",
            "sequence 0 has length 4611686018427387904, over 2**40",
        ),
        ("[[true]]", "g1n1", "rank 0: sequence 0 has length True (a bool)"),
        ("[[2.5]]", "g1n1", "rank 0: sequence 0 has length 2.5 (a float)"),
    ],
)
def test_lengths_that_are_no_integers_in_range_exit_2_on_one_line(tmp_path, capsys, content, topology, message):
    """Issue 22: such lengths were cast (a negative token total, -2**63 for a huge float); now refused."""
    lengths = tmp_path / "bad.json"
    lengths.write_text(content)
    code, out, err = run_cli(capsys, "plan", "--topology", topology, "--lengths", str(lengths), "--repeat", "1")
    assert code == 2 and out == "" and message in err and err.count("\n") == 1
