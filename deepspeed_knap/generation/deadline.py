"""Generation's deadline: a collective that a rank does not reach in time fails on the ranks that
waited, naming where (the intake, a denoising step, the final report) and which ranks were missing.

    deadline = Deadline(timeout_s=300)  # collective: every rank, once the process group exists
    deadline.set_timeout()  # every process group of this rank waits at most 300 s in a collective
    with deadline.watching("the intake"):
        ...  # collectives; one that times out raises MissingRanksError

Every process group of the rank gets the timeout (:func:`~deepspeed_knap.runtime.groups.set_collective_timeout`,
as training's ``timeout_s`` does), so a collective that a stopped, stuck or dead rank never joins
fails on the others after ``timeout_s``. The backend's error names neither the rank nor where the
run was (gloo: ``Timed out waiting 300000ms for recv operation to complete``); so each rank whose
collective failed takes a **roll call** on a gloo group of its own (made here, used for nothing
else): it sends a ping to every other rank and waits up to ``grace_s`` for theirs. The ranks that
waited in the same collective fail at about the same moment and answer each other; a rank that
never arrived does not answer (stopped, stuck), and one that has left the run (died, or failed and
exited) has closed its connection. The error names the phase, the missing ranks, and those that
left.

Local failures (a bug, a rank's own error) are not collective failures: they raise as they are,
and the other ranks, waiting for this one, name it when their own collective times out.

On NCCL, torch's watchdog ends the waiting processes at the timeout with its own message before
Python sees an error: the timeout holds, the roll call does not run.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator

# Seconds a roll call waits for the other ranks' pings at most: the ranks that waited in one
# collective time out within about as long as they arrived apart.
GRACE_S = 10.0
_TAG = 7_340_033  # the roll call's messages, on its own group


class MissingRanksError(RuntimeError):
    """A collective that some rank did not reach within the timeout, or that failed because a rank
    left the run; raised on the ranks that were there, each with its own view."""


class Deadline:
    """The collective timeout of a generation run and the roll call that names missing ranks.
    Collective to make (a gloo group for the roll call): every rank, once the process group exists.

    Args:
        timeout_s: seconds a rank waits in a collective for the others.
        grace_s: seconds a roll call waits for the other ranks' pings; default ``min(timeout_s,
            GRACE_S)``.

    Attributes:
        phase: where the run is (``"the intake"``, ``"step 3"``), for the error.
        waits_s: the collective timeout last given to the groups (:meth:`set_timeout`).
    """

    def __init__(self, timeout_s: float, grace_s: float | None = None) -> None:
        import torch.distributed

        self.timeout_s = float(timeout_s)
        self.grace_s = min(self.timeout_s, GRACE_S) if grace_s is None else float(grace_s)
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.phase = "the start"
        self.waits_s = self.timeout_s
        self._group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.grace_s))

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def set_timeout(self, timeout_s: float | None = None) -> None:
        """Give every process group of this rank (the world's, DeepSpeed's, groups made so far) the
        collective timeout ``timeout_s`` (default: the deadline's). Local."""
        from deepspeed_knap.runtime.groups import set_collective_timeout

        self.waits_s = self.timeout_s if timeout_s is None else float(timeout_s)
        set_collective_timeout(datetime.timedelta(seconds=self.waits_s))

    @contextlib.contextmanager
    def watching(self, phase: str | None = None) -> Iterator[None]:
        """Within the block, a collective failure raises :class:`MissingRanksError` naming
        :attr:`phase` (set to ``phase`` when given; the block may move it on with :meth:`at`)."""
        if phase is not None:
            self.at(phase)
        try:
            yield
        except Exception as error:
            if isinstance(error, MissingRanksError) or not collective_failure(error):
                raise
            raise MissingRanksError(self.roll_call(error)) from error

    def at(self, phase: str) -> None:
        """The run has reached ``phase``."""
        self.phase = phase

    def roll_call(self, error: BaseException) -> str:
        """Ping every other rank on the roll call's group and wait up to ``grace_s`` for theirs;
        the message names the ranks that did not answer and those that had left."""
        import torch
        import torch.distributed

        silent, left = [], []
        deadline = time.monotonic() + self.grace_s
        replies = {}  # peer -> (its buffer, kept alive while the receive may write it; the receive)
        # The pings are never waited on (a stopped peer's socket buffer takes the few bytes), but kept
        # past the call: gloo may never send a ping whose work is dropped, and a present peer that
        # posts its receive a moment later would read as missing.
        self._pings = sends = []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            try:
                sends.append(torch.distributed.isend(torch.tensor([self.rank]), peer, group=self._group, tag=_TAG))
                buffer = torch.zeros(1, dtype=torch.int64)
                replies[peer] = (buffer, torch.distributed.irecv(buffer, peer, group=self._group, tag=_TAG))
            except RuntimeError:  # its connection is closed
                left.append(peer)
        for peer, (_, work) in replies.items():
            try:
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError as failure:
                # Once one receive times out, gloo closes the group's other pairs ("Application
                # timeout caused pair closure"): those peers did not answer in time either.
                message = str(failure).lower()
                (silent if "timed out" in message or "timeout" in message else left).append(peer)
        timed_out = any("timed out" in str(cause).lower() for cause in _chain(error))
        parts = []
        if silent:
            parts.append(f"rank(s) {sorted(silent)} did not arrive within the {self.waits_s:g} s timeout (--timeout): "
                         "stopped, stuck or slower than that")  # fmt: skip
        if left:
            parts.append(f"rank(s) {sorted(left)} had left the run (failed or killed: see their output)")
        if not parts:  # every rank answered: none was missing when the roll was called
            how = "timed out" if timed_out else "failed"
            parts.append(f"a collective {how} although every rank answered the roll call ({_first_line(error)})")
        return f"{self.phase}: {'; '.join(parts)}; rank {self.rank} was there"


def collective_failure(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective's failure: torch's ``DistError``, or
    the plain ``RuntimeError`` a backend raises (gloo's names its source file, NCCL's itself). A
    subclass is someone's own error (``GenerationError``: agreed by every rank, so none is missing)."""
    import torch.distributed

    for cause in _chain(error):
        if isinstance(cause, torch.distributed.DistError):
            return True
        if type(cause) is RuntimeError and any(word in str(cause) for word in ("gloo", "NCCL", "Timed out")):
            return True
    return False


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
