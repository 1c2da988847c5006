"""Training runs in process for the multirank tests: ``Trainer(TrainingArguments(...))`` on N gloo
ranks forked by :func:`tests.support.distributed.run_distributed`, instead of launching
``examples/train_dit.py`` (a launch costs each rank a fresh interpreter and the imports of torch,
DeepSpeed and diffusers; the example is a thin command line over the trainer, tested by a launch of
its own in tests/e2e/test_train_flux.py).

    run = train(demo_config("flux", balanced=False), tiny_arguments, steps=3, export_dir=...)
    run.losses        # {step: the global mean loss}, rank 0's (every rank's are checked equal)
    run.stdout        # what rank 0 printed: the step lines, --resume's choice, validation renders
    run.errors        # each rank's TrainingError (or ValueError) message, or None
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]
# Rank 0's line per step (Trainer._log): loss, and with balancing the modeled imbalance before -> after.
STEP_LINE = re.compile(
    r"^step (\d+) loss (\S+) time \S+ tokens/s \S+(?: modeled imbalance (\S+) -> (\S+)( \(planned ahead\))?)?$", re.M
)
# A run of a few steps of a tiny model takes 5-30 s a rank on 2 shared cores; validation renders more.
TIMEOUT_S = 300.0


def run_example(script: str, *argv: str) -> str:
    """Run ``examples/{script}`` in this process as ``python examples/{script} argv...`` runs it, and
    return what it printed (stdout and stderr). The tests' process has torch, diffusers and
    transformers imported already: a fresh interpreter spent 6.6 s of 2 cores importing them, more
    than a tiny pipeline's preparation. An exit code other than 0 fails the test with the output."""
    path = ROOT / "examples" / script
    printed, argv_before, code = io.StringIO(), sys.argv, 0
    sys.argv = [str(path), *argv]
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException as error:  # what it printed before, as a subprocess's output would show it
        error.add_note(f"examples/{script} printed:\n{printed.getvalue()[-3000:]}")
        raise
    finally:
        sys.argv = argv_before
    assert code in (0, None), f"examples/{script} {' '.join(argv)} exited with {code}:\n{printed.getvalue()[-3000:]}"
    return printed.getvalue()


def demo_config(family: str = "flux", *, balanced: bool = True, stage: int = 3, **knapformer: Any) -> dict:
    """``ds_configs/{family}_cpu_demo.json`` with balancing on or off, a ZeRO stage, and ``knapformer``
    fields replaced (``topology``, ``cost_model``, ...)."""
    config = json.loads((ROOT / "ds_configs" / f"{family}_cpu_demo.json").read_text())
    return {**config, "zero_optimization": {**config["zero_optimization"], "stage": stage},
            "knapformer": {**config["knapformer"], "enabled": balanced, **knapformer}}  # fmt: skip


def train_rank(rank: int, world_size: int, arguments: dict, host_tensors: bool,
               setup: Callable[[], None] | None = None) -> dict:  # fmt: skip
    """One rank of a run: ``setup()`` where given, then build the trainer, train, export;
    ``host_tensors``: under the host-tensor check (every collective refuses a tensor that would stay
    on the host on a GPU machine). Returns
    ``{"losses", "start_step", "stdout", "error"}``: ``error`` is the message of the
    :class:`~deepspeed_knap.training.trainer.TrainingError` (or ``ValueError``) the run stopped with,
    which every rank must raise together."""
    from deepspeed_knap.training.arguments import TrainingArguments
    from deepspeed_knap.training.trainer import Trainer, TrainingError
    from tests.support.host_tensors import HostTensorTracker, check_collectives

    if setup is not None:
        setup()
    if host_tensors:
        check_collectives()
    stdout, losses, start_step, error = io.StringIO(), [], None, None
    # tqdm writes to sys.stdout as it is when the bar is made: inside the redirect.
    with contextlib.redirect_stdout(stdout), HostTensorTracker() if host_tensors else contextlib.nullcontext():
        try:
            trainer = Trainer(TrainingArguments(**arguments))
            start_step = trainer.start_step
            losses = trainer.train()
            trainer.export()
        except (TrainingError, ValueError) as problem:
            error = str(problem)
    # The progress bar redraws after a carriage return: as a line of its own, each step line starts one.
    printed = stdout.getvalue().replace("\r", "\n")
    return {"losses": losses, "start_step": start_step, "stdout": printed, "error": error}


@dataclass
class Run:
    """Every rank's outcome of :func:`train`."""

    ranks: list[dict]

    @property
    def losses(self) -> dict[int, float]:
        """``{step: global mean loss}`` of the steps this run trained (rank 0's)."""
        first = self.ranks[0]["start_step"] or 0
        return {first + index: loss for index, loss in enumerate(self.ranks[0]["losses"])}

    @property
    def stdout(self) -> str:
        """What rank 0 printed."""
        return self.ranks[0]["stdout"]

    @property
    def errors(self) -> list[str | None]:
        return [outcome["error"] for outcome in self.ranks]

    def step_lines(self) -> list[tuple[str, ...]]:
        """Rank 0's step lines: ``(step, loss, imbalance before, after, " (planned ahead)")``."""
        return STEP_LINE.findall(self.stdout)

    def planned_ahead(self) -> list[bool]:
        """Whether each step's plan was solved during the step before (``balancer.prefetch``)."""
        return [bool(ahead) for *_, ahead in self.step_lines()]

    def imbalances(self) -> list[tuple[float, float]]:
        """``(before, after)`` of each step's modeled imbalance."""
        return [(float(before), float(after)) for _, _, before, after, _ in self.step_lines()]


def train(config: dict | str, *, ranks: int = 2, host_tensors: bool = False, fails: bool = False,
          timeout: float = TIMEOUT_S, setup: Callable[[], None] | None = None, **arguments: Any) -> Run:  # fmt: skip
    """Train on ``ranks`` gloo ranks with the DeepSpeed ``config`` (a dict, or a JSON path) and the
    :class:`~deepspeed_knap.training.arguments.TrainingArguments` fields ``arguments``; each rank
    calls ``setup`` first (a module-level function: it is pickled to the ranks).

    Checks what every run must show: no rank failed (unless ``fails``: then every rank failed, with
    the same message); every rank got the same losses; rank 0 printed a line per step with the loss
    returned; with balancing on, each line has the modeled imbalance; off, none has. (Whether a
    step's plan was solved ahead, :meth:`Run.planned_ahead`, is the tests' to check: a plan worker
    still starting when the run's second step comes, on a loaded host, has that plan solved in the
    step, by design.)"""
    run = Run(run_distributed(train_rank, ranks, ({"deepspeed_config": config, **arguments}, host_tensors, setup),
                              timeout=timeout))  # fmt: skip
    if fails:
        assert run.errors[0] is not None and run.errors == [run.errors[0]] * ranks, run.errors
        return run
    assert run.errors == [None] * ranks, run.errors[0]
    assert all(outcome["losses"] == run.ranks[0]["losses"] for outcome in run.ranks)
    steps = run.step_lines()
    assert [int(step) for step, *_ in steps] == list(run.losses), run.stdout[-2000:]
    # printed with 6 decimals
    assert [float(loss) for _, loss, *_ in steps] == pytest.approx(list(run.losses.values()), abs=5e-7)
    knapformer = (json.loads(Path(config).read_text()) if isinstance(config, str) else config).get("knapformer", {})
    if knapformer.get("enabled", False):
        assert all(before for _, _, before, _, _ in steps), run.stdout[-2000:]
    else:
        assert not any(before for _, _, before, _, _ in steps), run.stdout[-2000:]
    return run
