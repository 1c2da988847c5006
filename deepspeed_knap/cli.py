"""``deepspeed-knap``: the command line, a table of commands.

Each command is a module with ``HELP`` (its one-line summary), ``add_arguments(parser)`` and
``run(args) -> int``. Only the module of the command given is imported, so ``deepspeed-knap plan``
never imports torch; ``build_parser()`` with no ``argv`` imports them all (for the docs' tests).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

DEBUG_VARIABLE = "DEEPSPEED_KNAP_DEBUG"
# name -> module; "bench" holds the benchmarks, one level down.
COMMANDS = {
    "plan": "deepspeed_knap.commands.plan",
    "calibrate": "deepspeed_knap.commands.calibrate",
    "doctor": "deepspeed_knap.commands.doctor",
    "generate": "deepspeed_knap.commands.generate",
}
BENCHES = {
    "planner": "deepspeed_knap.bench.planner",
    "step": "deepspeed_knap.bench.step",
    "routing": "deepspeed_knap.bench.routing",
    "ahead": "deepspeed_knap.bench.ahead",
    "train": "deepspeed_knap.bench.train",
    "flux": "deepspeed_knap.bench.flux",
    "generate": "deepspeed_knap.bench.generate",
}
# One-line summaries, here so that `deepspeed-knap --help` imports no command module.
SUMMARIES = {
    "plan": "solve one step and compare solvers",
    "calibrate": "fit the cost model to timed blocks on this device",
    "doctor": "versions, attention kernels, a kernel check and a calibration here",
    "generate": "images for a JSONL file of requests, balanced across the ranks",
    "bench": "benchmarks: the planner suite, measured step emulation, training steps",
    "bench planner": "plan quality and solve time over data mixes, topologies, GPU counts",
    "bench step": "measured step time of emulated ranks, balanced against not",
    "bench routing": "bytes moved by routing and Ulysses, before and after routing less",
    "bench ahead": "how long a step waits for its plan: solved in the step or ahead",
    "bench train": "measured training steps on local ranks: off, knapformer, refine, auto",
    "bench flux": "packed FLUX against diffusers sample by sample: time and memory",
    "bench generate": "measured generation on local ranks: balanced, unbalanced, one pipeline call per request",
}


def _chosen(argv: list[str]) -> str | None:
    """The command ``argv`` names (``"plan"``, ``"bench step"``), or None before one is given."""
    words = [word for word in argv if not word.startswith("-")]
    if not words:
        return None
    return " ".join(words[:2]) if words[0] == "bench" and len(words) > 1 else words[0]


def _add_command(commands, name: str, module_name: str, wanted: str | None) -> None:
    full = name if module_name in COMMANDS.values() else f"bench {name}"
    if wanted is not None and wanted != full:
        commands.add_parser(name, help=SUMMARIES[full], add_help=False)  # listed in the help, not imported
        return
    module = importlib.import_module(module_name)
    from deepspeed_knap.options import DefaultsHelp  # (a command's imports: not for the list of commands)

    parser = commands.add_parser(name, help=SUMMARIES[full], description=module.__doc__, formatter_class=DefaultsHelp)
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv``, only the options of the command it names are added (none for
    ``deepspeed-knap --help``, which lists the commands: no command's imports, torch's among them)."""
    wanted = None if argv is None else (_chosen(argv) or "")
    parser = argparse.ArgumentParser(prog="deepspeed-knap", description="KnapFormer-style balancing for DeepSpeed.")
    parser.add_argument("--debug", action="store_true",
                        help=f"show the traceback of a failure (also {DEBUG_VARIABLE}=1)")  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        _add_command(commands, name, module_name, wanted)
    bench = commands.add_parser("bench", help=SUMMARIES["bench"])
    benches = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        _add_command(benches, name, module_name, wanted)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command. A usage error exits 2 with argparse's message, a bad value the command finds
    (``ValueError``) exits 2 with its message, and any other failure exits 1 with one line; ``--debug``
    (or ``DEEPSPEED_KNAP_DEBUG=1``) shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    name = " ".join(filter(None, [args.command, getattr(args, "bench", None)]))
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, Exception) as error:
        if args.debug or os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
            raise
        if isinstance(error, ValueError):
            print(f"deepspeed-knap {name}: error: {error}", file=sys.stderr)
            return 2
        print(f"deepspeed-knap {name}: error: {type(error).__name__}: {error} (deepspeed-knap --debug {name} ... "
              "shows where)", file=sys.stderr)  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(main())
