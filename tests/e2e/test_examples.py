"""Examples run as documented."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_step_example_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "plan_step.py")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "imbalance" in result.stdout and "-> GPUs" in result.stdout


def test_balanced_blocks_example_under_the_deepspeed_launcher():
    from tests.support.launch import deepspeed_launch, run

    result = run(deepspeed_launch(ROOT / "examples" / "balanced_blocks.py", "--steps", "2"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    errors = re.findall(r"max \|balanced - unbalanced\| = (\S+)", result.stdout)
    assert len(errors) == 2 and all(float(e) < 1e-10 for e in errors), result.stdout
    assert re.search(r"modeled imbalance \d\.\d\d -> 1\.\d\d", result.stdout)
    assert result.leftover_shm == []  # every rank unlinked its /dev/shm all-reduce buffer
