"""Examples run as documented."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_plan_step_example_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "plan_step.py")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "imbalance" in result.stdout and "-> GPUs" in result.stdout
