"""Options that several commands share: the data-mix flag, the help formatter, and argparse types that
refuse a bad value as a usage error (exit 2) before any work starts."""

from __future__ import annotations

import argparse
import os
import sys

from deepspeed_knap.models.registry import MIXES, SPECS, family_names
from deepspeed_knap.planner.topology import MAX_GPUS


class DefaultsHelp(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every command's help: its description as written (examples, lists), and each option's default
    unless it has none or is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        plain = action.default is None or action.nargs == 0
        return action.help if plain else super()._get_help_string(action)


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


def add_family_argument(parser: argparse.ArgumentParser, what: str, default: str | None = "flux",
                        having: str | None = None) -> None:  # fmt: skip
    """``--family NAME``: a registered model family (:mod:`deepspeed_knap.models.registry`), those whose
    spec has ``having`` set (``"generator"``, ``"block_timer"``) where the command needs it; ``what``
    says what the option picks ("the --tiny model")."""
    names = family_names(having)
    listed = ", ".join(f"{name} ({SPECS[name].title})" for name in names)
    parser.add_argument("--family", choices=names, default=default, help=f"{what}: {listed}")


def int_at_least(minimum: int, maximum: int | None = None, why: str = ""):
    """An argparse type: a whole number >= ``minimum`` (``--repeat 0`` is a usage error, not a failure
    later), and at most ``maximum`` when given (``why``: what the bound is)."""

    def parse(text: str) -> int:
        digits = text.strip().lstrip("+")
        if maximum is not None and digits.isdigit() and len(digits) > len(str(maximum)) + 1:  # before int() reads it
            shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text):,} characters)"
            raise argparse.ArgumentTypeError(f"{shown} is over {maximum:,}{why}")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not >= {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value:,} is over {maximum:,}{why}")
        return value

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
# A GPU count: at most MAX_GPUS, the most one balance group (one plan) may have.
gpu_count = int_at_least(1, MAX_GPUS, ", the most GPUs a balance group may have")


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (``inf`` and ``nan`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number > 0")
    return value


# The longest sequence a timing command takes: 2**20 tokens (a 16-minute 720p clip is ~1.2M tokens,
# past what one block's attention holds on any GPU; longer is a typo).
MAX_TIMED_SEQ_LEN = 2**20


def flux_head_dim(text: str) -> int:
    """An argparse type: channels per head of FLUX blocks, a positive even number (they rotate a
    head's channels in pairs, over three axes)."""
    value = int_at_least(1)(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"{value}: FLUX blocks rotate a head's channels in pairs; give an even "
                                          "number")  # fmt: skip
    return value


def seq_lens(text: str) -> list[int]:
    """An argparse type: comma-separated lengths, each in [1, MAX_TIMED_SEQ_LEN]."""
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated whole numbers, e.g. 256,512,1024")
    lengths = [int(part) for part in parts]
    if not all(1 <= length <= MAX_TIMED_SEQ_LEN for length in lengths):
        raise argparse.ArgumentTypeError(f"{text!r}: every length must be in [1, {MAX_TIMED_SEQ_LEN:,}] tokens")
    return lengths


def calibration_lengths(text: str) -> list[int]:
    """An argparse type: :func:`seq_lens` with at least 4 different lengths (a calibration fits
    overhead, ``a`` and ``b``: three would fit any times exactly and say nothing)."""
    lengths = seq_lens(text)
    if len(set(lengths)) < 4:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least 4 different lengths to fit overhead, a and b with "
                                         "one to spare")  # fmt: skip
    return lengths


def output_file(text: str) -> str:
    """An argparse type: a file path whose folder exists and can be written, and that is not a
    folder itself (checked before any work, not after it)."""
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"{text} ends in a path separator; give a file name")
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: {folder} is not a folder")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist; create it first")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name in it")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: this user cannot write there (the folder {folder} or the file)")
    return text


def output_folder(text: str) -> str:
    """An argparse type: a folder to write files in, or one to make (with its parents) where this user
    can write (checked before any work, not after it)."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder; give a folder to write in")
    existing = os.path.abspath(text)
    while not os.path.exists(existing):  # the folders made are made in the nearest one that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise argparse.ArgumentTypeError(f"{text}: {existing} is a file, so no folder can be made there")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: this user cannot write in {existing}")
    return text


# What matplotlib's savefig writes, by the file name's extension.
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".gif", ".avif", ".eps",
                 ".ps", ".pgf", ".raw", ".rgba")  # fmt: skip


def plot_file(text: str) -> str:
    """An argparse type: :func:`output_file` whose extension names a format matplotlib writes
    (checked before any work: savefig refuses others only once the work is done)."""
    path = output_file(text)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in PLOT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text}: a plot's file name ends in {', '.join(PLOT_SUFFIXES[:3])}, ...; "
                                         f"got {suffix or 'no extension'}")  # fmt: skip
    return path


def device(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N``, refused when this torch sees no such device."""
    import torch  # here, not at the top: ``deepspeed-knap plan`` imports this module and never torch

    if text == "cpu":
        return text
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(text[5:]) if ":" in text else 0
        if index >= count:
            why = (
                "this torch is built without CUDA"
                if torch.version.cuda is None
                else f"{count} CUDA devices are visible"
            )
            raise argparse.ArgumentTypeError(f"{text}: {why}; leave --device out to use what is here")
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: give cpu, cuda or cuda:N")
