"""The README's two commands are what CI and new users run, and docs/cli.md names every option of
every command: keep them honest."""

import re
from pathlib import Path

import pytest

from deepspeed_knap.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_opens_with_the_main_job_then_the_test_command():
    main_job, test_command = COMMANDS[0], COMMANDS[1]
    assert "pip install torch==2.13.0" in main_job and "examples/train_dit.py" in main_job
    assert "pip install torch==2.13.0" in test_command and "pytest" in test_command


def test_ci_runs_the_readme_test_command_verbatim():
    assert COMMANDS[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def _subcommands(parser, prefix=()):
    """(command path, parser) for every leaf subcommand, e.g. (("bench", "step"), parser)."""
    actions = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    if not actions:
        yield prefix, parser
        return
    for name, sub in actions[0].choices.items():
        yield from _subcommands(sub, (*prefix, name))


def _deprecated(action) -> bool:
    """An old spelling kept as an alias (``--workload`` for ``--mix``): cli.md names it once, not per command."""
    return (action.help or "").startswith("deprecated spelling")


def _cli_options(deprecated: bool = False) -> list[tuple[str, str]]:
    return [
        (" ".join(path), option)
        for path, parser in _subcommands(build_parser())
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help" and _deprecated(action) == deprecated
    ]


def test_every_subcommand_is_found():
    assert {path for path, _ in _cli_options()} == {
        "plan",
        "calibrate",
        "bench planner",
        "bench step",
        "bench routing",
        "bench ahead",
        "bench train",
        "bench flux",
        "bench generate",
        "generate",
        "doctor",
    }


@pytest.mark.parametrize(("command", "option"), _cli_options())
def test_every_cli_option_is_documented(command, option):
    """Each command's options are named in the section of docs/cli.md whose heading names it."""
    page = (ROOT / "docs" / "cli.md").read_text()
    heading = re.search(rf"^#+ .*`deepspeed-knap {command}`.*$", page, re.MULTILINE)
    assert heading, f"no heading of docs/cli.md names `deepspeed-knap {command}`"
    section = page[heading.end() :]
    section = section[: section.find("\n#")]
    assert f"`{option}" in section, f"docs/cli.md's section on deepspeed-knap {command} does not document {option}"


def test_every_deprecated_spelling_is_named_in_the_cli_page():
    old = {option for _, option in _cli_options(deprecated=True)}
    assert {"--workload", "--workloads"} <= old, old  # the detection works
    page = (ROOT / "docs" / "cli.md").read_text()
    assert all(f"`{option}`" in page for option in old), old
