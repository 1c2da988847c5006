"""Options that several commands share: the data-mix flag and the help formatter."""

from __future__ import annotations

import argparse
import sys

from deepspeed_knap.data.mixes import MIXES


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


class _DeprecatedSpelling(argparse.Action):
    """Stores like the option it aliases, and says on stderr that the spelling is deprecated."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated (it named a data mix, which the cost model "
              f"was also called); use {self.new}", file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def add_mix_argument(parser: argparse.ArgumentParser, default: str | list[str], many: bool = False) -> None:
    """``--mix NAME`` (or ``--mixes A B ...`` with ``many``): a bundled data mix of
    :data:`~deepspeed_knap.data.mixes.MIXES`. The old spelling ``--workload(s)`` still works, with a warning."""
    new, old, dest = ("--mixes", "--workloads", "mixes") if many else ("--mix", "--workload", "mix")
    nargs = "+" if many else None
    parser.add_argument(new, dest=dest, default=default, nargs=nargs, choices=list(MIXES), metavar="MIX",
                        help="bundled data mix" + ("es" if many else "") + f": {', '.join(MIXES)}")  # fmt: skip
    parser.add_argument(old, dest=dest, nargs=nargs, choices=list(MIXES), metavar="MIX", action=_DeprecatedSpelling,
                        new=new, default=argparse.SUPPRESS, help=f"deprecated spelling of {new}")  # fmt: skip
