"""A user's mistake never shows a traceback: usage errors exit 2 with argparse's message, bad values
exit 2 with the command's message, other failures exit 1 with one line (``--debug`` shows the
traceback), and sizes that cannot fit memory are refused before anything is allocated."""

import sys

import pytest
import torch

from deepspeed_knap.cli import main


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
]
if not torch.cuda.is_available():
    CASES.append((["calibrate", "--out", "c.json", "--device", "cuda"], "argument --device: cuda: this torch"))


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(argv[:3]) for argv, _ in CASES])
def test_a_mistake_exits_2_with_one_message_and_no_traceback(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
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
        "deepspeed-knap calibrate: error: RuntimeError: the model broke at 64 tokens (--debug shows where)"
    )
    with pytest.raises(RuntimeError, match="the model broke"):  # the traceback reaches the console
        main(["--debug", *argv])
