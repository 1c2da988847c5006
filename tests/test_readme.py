"""The README's two commands are what CI and new users run; keep them honest."""

import re
from pathlib import Path

import pytest

from deepspeed_knap.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_opens_with_the_main_job_then_the_test_command():
    main_job, test_command = COMMANDS[0], COMMANDS[1]
    assert "pip install torch==2.13.0" in main_job and "examples/train_flux.py" in main_job
    assert "pip install torch==2.13.0" in test_command and "pytest" in test_command


def test_ci_runs_the_readme_test_command_verbatim():
    assert COMMANDS[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def _plan_options() -> list[str]:
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    return [o for action in plan._actions for o in action.option_strings if o.startswith("--") and o != "--help"]


@pytest.mark.parametrize("option", _plan_options())
def test_every_cli_option_is_documented(option):
    assert f"`{option}" in (ROOT / "README.md").read_text()
