"""Launchers: the deepspeed launcher and mpirun run the same script to the same losses, and a rank that
raises mid-step ends the job with its error instead of a hang. Two ranks planned by topology ``auto``
(half the time of four on 2 cores); the README's 4-rank jobs run in test_train_flux and test_examples."""

import json
import re
import time
from pathlib import Path

import pytest

from tests.support.launch import CONFIG, ROOT, deepspeed_launch, mpirun_launch, needs_mpirun, run


def two_rank_config(directory: Path) -> Path:
    """The CPU demo config with topology ``auto``, which plans any world size."""
    config = json.loads(CONFIG.read_text())
    config["knapformer"]["topology"] = "auto"
    (directory / "config.json").write_text(json.dumps(config))
    return directory / "config.json"


@needs_mpirun
def test_deepspeed_launcher_and_mpirun_give_the_same_losses(tmp_path):
    script, args = ROOT / "examples" / "train_tiny.py", ("--deepspeed_config", str(two_rank_config(tmp_path)))
    losses = {}
    for name, command in (("deepspeed", deepspeed_launch(script, *args, ranks=2)),
                          ("mpirun", mpirun_launch(script, *args, ranks=2))):  # fmt: skip
        result = run(command)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert result.leftover_shm == []  # every rank unlinked its /dev/shm all-reduce buffer
        losses[name] = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", result.stdout, re.MULTILINE)]
    assert len(losses["deepspeed"]) == 3
    assert losses["mpirun"] == pytest.approx(losses["deepspeed"], rel=1e-6)


@pytest.mark.parametrize("launcher", ["deepspeed", pytest.param("mpirun", marks=needs_mpirun)])
def test_a_rank_that_raises_mid_step_ends_the_job_with_its_error(launcher, tmp_path):
    script, args = (
        ROOT / "tests" / "support" / "scripts" / "failing_rank.py",
        ("--deepspeed_config", str(two_rank_config(tmp_path))),
    )
    launch = deepspeed_launch if launcher == "deepspeed" else mpirun_launch
    command = launch(script, *args, ranks=2)
    start = time.monotonic()
    result = run(command)
    assert result.returncode != 0
    assert "injected failure on rank 1 at step 1" in result.stdout + result.stderr
    assert time.monotonic() - start < 120


@needs_mpirun
def test_generate_under_mpirun_shares_the_requests_out_among_the_ranks(tmp_path):
    """mpirun sets no RANK: generate ran every process alone as rank 0, each generating every
    request into the same files. It joins the job as training does (DeepSpeed finds the ranks
    through mpi4py), and the two ranks generate the four requests together."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": f"a boat {i}", "height": 16, "width": 16, "steps": 2}) + "\n"
                                for i in range(4)))  # fmt: skip
    result = run(mpirun_launch(ROOT / "deepspeed_knap" / "cli.py", "generate", "--tiny", "--requests", str(requests),
                               "--out", str(tmp_path / "out"), "--no-progress", ranks=2))  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("generated 4 of 4 requests") == 1, result.stdout[-3000:]
    assert re.search(r"rank 0: \d images", result.stdout) and re.search(r"rank 1: \d images", result.stdout)
    assert sorted(path.name for path in (tmp_path / "out").glob("*.png")) == [f"line{i}.png" for i in range(1, 5)]


def test_multi_node_script_leaves_the_master_to_deepspeed_unless_given(tmp_path):
    """It took the hostfile's first word as the master: '#' for a hostfile that starts with a comment,
    or a host --exclude leaves out. DeepSpeed's runner picks the first active host itself."""
    import os
    import subprocess

    (tmp_path / "deepspeed").write_text('#!/bin/sh\necho "$@"\n')
    (tmp_path / "deepspeed").chmod(0o755)
    (tmp_path / "hostfile").write_text("# two nodes\nnode1 slots=8\nnode2 slots=8\n")
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "HOSTFILE": str(tmp_path / "hostfile")}
    env.pop("MASTER_ADDR", None)
    script = [str(ROOT / "launch" / "multi_node.sh"), "train.py"]
    plain = subprocess.run(script, capture_output=True, text=True, env=env, timeout=30, check=True).stdout
    assert "--master_addr" not in plain and plain.split() == ["--hostfile", str(tmp_path / "hostfile"),
                                                              "--master_port", "29500", "train.py"]  # fmt: skip
    given = subprocess.run(script, capture_output=True, text=True, env={**env, "MASTER_ADDR": "10.0.0.2"}, timeout=30,
                           check=True).stdout  # fmt: skip
    assert "--master_addr 10.0.0.2" in given
