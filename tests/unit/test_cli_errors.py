"""A user's mistake never shows a traceback: usage errors exit 2 with argparse's message, bad values
exit 2 with the command's message, other failures exit 1 with one line (``--debug`` shows the
traceback), and sizes that cannot fit memory are refused before anything is allocated."""

import sys

import pytest
import torch

from deepspeed_knap.cli import main


def _no_timing(*args, **kwargs):
    raise AssertionError("the command timed models before refusing its arguments")


def failing_step(seq_len: int) -> float:
    """A ``--callable`` that fails the way a broken user function does."""
    raise RuntimeError(f"the model broke at {seq_len} tokens")


CASES = [
    (["calibrate", "--out", "/no/such/folder/c.json"], "argument --out: /no/such/folder/c.json: the folder"),
    (["plan", "--plot", "/no/such/folder/p.png"], "argument --plot"),
    (["bench", "step", "--json", "/no/such/folder/s.json"], "argument --json"),
    (["bench", "train", "--plot", "/no/such/folder/t.png"], "argument --plot"),
    (["calibrate", "--out", "c.json", "--seq-lens", "abc"], "argument --seq-lens: 'abc': give comma-separated"),
    (["doctor", "--compare-lens", "1,,2"], "argument --compare-lens"),
    (["plan", "--repeat", "0"], "argument --repeat: 0 is not >= 1"),
    (["bench", "planner", "--steps", "-3"], "argument --steps: -3 is not >= 1"),
    (["plan", "--tflops", "inf"], "argument --tflops: inf is not a finite number > 0"),
    (["bench", "train", "--token-scale", "nan"], "argument --token-scale: nan is not a finite number > 0"),
    (["calibrate", "--out", "c.json", "--seq-lens", "64,128,256,1000000000000000"], "every length must be in [1,"),
    (["calibrate", "--out", "c.json", "--seq-lens", "64,128,256,1000000"], "needs about"),  # 44,000 GiB on CPU
    (["bench", "train", "--ranks", "2", "--topology", "g4n1"], "topology 'g4n1' needs a world size"),
    # Every mode's block and the calibration file, before the ranks start (before: an error in every rank).
    (
        ["bench", "train", "--ranks", "2", "--topology", "auto"],
        "--modes knapformer (the default --modes; give --modes to choose others) on --topology auto",
    ),
    (["bench", "train", "--ranks", "2", "--calibration", "nope.json"], "calibration file 'nope.json' is unreadable"),
    # Bounds checked before any work (before, each grew to many GB or ran for minutes).
    (["plan", "--gpus", "1000000000"], "argument --gpus: 1000000000 is over 16,384, the most GPUs a balance group"),
    (["plan", "--topology", "g99999999999999999999n1"], "its bag size G 99999999999999999999 is over 16,384"),
    (["plan", "--topology", "g8n4096"], "topology 'g8n4096' has over 16,384 GPUs"),
    # One bag of 16,384 GPUs grew past 24 GB (every sequence a chunk per GPU of its bag).
    (["plan", "--topology", "g2048n1"], "its bag size G 2,048 is over 1,024, the largest bag"),
    (["plan", "--topology", "auto", "--gpus", "4096", "--max-degree", "4096"], "max_degree=4,096 is over 1,024"),
    (["plan", "--lengths", "/dev/zero"], "--lengths /dev/zero is not a regular file"),
    (
        ["plan", "--gpus", "16384", "--topology", "auto", "--mix", "kf_lowres"],
        "--mix kf_lowres over 16,384 GPUs gives 524,288 sequences, over 65,536, the most `plan` solves",
    ),
    (["plan", "--repeat", "1000"], "argument --repeat: 1,000 is over 100"),
    # calibrate's arguments, all checked before any timing (before: after 6-15 s of it, or an internal error).
    (["calibrate", "--out", "c.json", "--heads", "3", "--head-dim", "7"], "--head-dim 7: FLUX blocks rotate a head's"),
    (["calibrate", "--out", "c.json", "--degrees", "2,x"], "argument --degrees: '2,x': give comma-separated bag sizes"),
    (
        ["calibrate", "--out", "c.json", "--degrees", "2,8"],
        "--degrees 2,8: bag sizes must be between 2 and the blocks' 4",
    ),
    (["calibrate", "--out", "c.json", "--degrees", "2", "--callable", "os:getcwd"], "it cannot time a --callable"),
    (
        ["calibrate", "--out", "c.json", "--callable", "no_such_module:f"],
        "--callable no_such_module:f: cannot import it",
    ),
    (["calibrate", "--out", "."], "argument --out: . is a folder; give a file name in it"),
    (
        ["calibrate", "--out", "/dev/null/c.json"],
        "argument --out: /dev/null/c.json: /dev/null is not a folder",
    ),
    (["calibrate", "--out", "c.json", "--repeats", "1000000"], "argument --repeats: 1000000 is over 100"),
    # Output names checked before any work (before: matplotlib refused the format once the work was done,
    # and "--out newdir/" wrote a file named newdir).
    (["plan", "--plot", "p.xyz"], "argument --plot: p.xyz: a plot's file name ends in .png, .pdf, .svg, ...; got .xyz"),
    (["calibrate", "--out", "c.json", "--plot", "p"], "argument --plot: p: a plot's file name ends in"),
    (["calibrate", "--out", "newdir/"], "argument --out: newdir/ ends in a path separator; give a file name"),
    (["plan", "--alltoall-gbps", "0"], "argument --alltoall-gbps: 0 is not a finite number > 0"),
    (["bench", "step", "--head-dim", "3"], "argument --head-dim: 3: FLUX blocks rotate a head's channels in pairs"),
    (["doctor", "--head-dim", "3"], "argument --head-dim: 3: FLUX blocks rotate a head's channels in pairs"),
    (["bench", "flux", "--family", "flux2", "--head-dim", "18"], "--head-dim 18: FLUX.2 splits a head's channels"),
    # Checked in every rank once they had started (the tiny FLUX.1 has 4 heads).
    (["bench", "train", "--ranks", "8", "--modes", "off,knapformer"], "--topology g8n1: bags of 8 GPUs, but the model"),
    (
        ["bench", "planner", "--plot-dir", "/dev/null/plots"],
        "argument --plot-dir: /dev/null/plots: /dev/null is a file",
    ),
    (["bench", "planner", "--solvers", "none", "--plot-dir", "plots"], "--plot-dir plots refine's speedup: add refine"),
    (
        ["plan", "--topology", "g8n1", "--solver", "knapformer", "--max-tokens-per-gpu", "100"],
        "--max-tokens-per-gpu 100 applies to solver refine, which --solver knapformer does not run",
    ),
]
if not torch.cuda.is_available():
    CASES.append((["calibrate", "--out", "c.json", "--device", "cuda"], "argument --device: cuda: this torch"))
    # Before: refused when the packed model was built, after diffusers' model was timed.
    CASES.append((["bench", "flux", "--backend", "flash"], "attention backend 'flash' is unavailable"))


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(argv[:3]) for argv, _ in CASES])
def test_a_mistake_exits_2_with_one_message_and_no_traceback(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("deepspeed_knap.cost.calibrate.calibrate", _no_timing)  # refused before any timing
    monkeypatch.setattr("deepspeed_knap.bench.flux.bench_flux", _no_timing)
    with pytest.raises(SystemExit) as exit_info:  # argparse exits; a command's ValueError returns 2
        sys.exit(main(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert message in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # refused before any work


def test_a_failure_exits_1_with_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    argv = ["calibrate", "--out", str(tmp_path / "c.json"), "--seq-lens", "8,16,32,64",
            "--callable", "tests.unit.test_cli_errors:failing_step"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "deepspeed-knap calibrate: error: RuntimeError: the model broke at 64 tokens (deepspeed-knap --debug "
        "calibrate ... shows where)"
    )
    with pytest.raises(RuntimeError, match="the model broke"):  # the traceback reaches the console
        main(["--debug", *argv])


def test_a_lengths_file_is_read_only_if_regular_and_small_with_few_enough_ranks_and_sequences(tmp_path, capsys):
    """Before, --lengths /dev/zero was read until the kernel killed the process at 24 GB, a FIFO
    waited for a writer forever, and 2**20 sequences were still solving at 280 s."""
    import json
    import os
    import time

    fifo, big, ranks, sequences = (tmp_path / name for name in ("fifo", "big.json", "ranks.json", "sequences.json"))
    os.mkfifo(fifo)
    with open(big, "wb") as file:  # sparse: 17 MiB that take no disk
        file.truncate(17 * 2**20)
    ranks.write_text(json.dumps([[] for _ in range(16_385)]))
    sequences.write_text(json.dumps([[64] * 40_000, [256] * 25_537]))
    expected = {
        fifo: f"--lengths {fifo} is not a regular file; give a JSON file",
        big: f"--lengths {big} is over 16 MiB, more than 65,536 sequences take; give one step's lengths",
        ranks: f"--lengths {ranks} holds 16,385 ranks' lists, over 16,384, the most GPUs a balance group may have",
        sequences: f"--lengths {sequences} gives 65,537 sequences, over 65,536, the most `plan` solves",
    }
    for path, message in expected.items():
        start = time.perf_counter()
        assert main(["plan", "--topology", "auto", "--lengths", str(path)]) == 2
        assert time.perf_counter() - start < 5
        err = capsys.readouterr().err
        assert err.startswith(f"deepspeed-knap plan: error: {message}") and len(err.splitlines()) == 1, err


def test_bench_step_refuses_a_calibration_file_without_its_coefficients(tmp_path, capsys):
    """Before any timing, naming the file (it was a KeyError)."""
    (tmp_path / "cal.json").write_text('{"a": 1}')
    code = main(["bench", "step", "--calibration", str(tmp_path / "cal.json"), "--steps", "1", "--repeats", "1"])
    err = capsys.readouterr().err
    assert code == 2 and str(tmp_path / "cal.json") in err and "quadratic_coef" in err and "Traceback" not in err
