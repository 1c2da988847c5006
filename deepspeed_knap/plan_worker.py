"""Plans solved in a worker process, so the next step's solve overlaps this step's compute.

    worker = PlanWorker()
    ticket = worker.submit(seq_lens_per_rank, topology, model, solver, max_tokens_per_gpu)  # at once
    ...                                    # this step runs
    plan, solve_s = worker.result(ticket)  # plan_routing's plan for those arguments, bit-identical

The worker is a child Python running :func:`main`, fed pickles over its stdin and stdout.
Started this way it imports only the planner (NumPy, ~0.2 s), never torch, CUDA or the training
script, which multiprocessing's spawn and forkserver re-import as ``__main__``. A process rather than
a thread: the solve is Python, and a thread holding the GIL for tens of milliseconds would stall the
training loop's kernel launches for as long. It exits when its stdin closes (its parent is gone).

Pure: no ``torch.distributed``. A worker failure raises :class:`PlanWorkerError` on this rank only;
:meth:`~deepspeed_knap.balancer.KnapBalancer.prefetch` agrees on it across ranks before acting on it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from deepspeed_knap.planner import RoutingPlan, plan_routing

_HEADER = struct.Struct("<Q")  # the byte length of the pickle that follows


class PlanWorkerError(RuntimeError):
    """The worker could not return a plan: it failed to start, died, or its solve raised."""


class PlanWorker:
    """One child process solving :func:`~deepspeed_knap.planner.plan_routing` jobs in order. Started
    on the first :meth:`submit`, and again on the next one after it died."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._submitted = 0  # jobs ever submitted; a job's ticket is its number
        self._unread: list[int] = []  # tickets sent to the running worker, reply not read yet
        self._replies: dict[int, tuple[RoutingPlan | None, float, str | None]] = {}
        self._discarded: set[int] = set()  # unread tickets whose replies are dropped when read

    def submit(self, seq_lens_per_rank: list[list[int]], *args: Any, timeout_s: float | None = None) -> int:
        """Queue ``plan_routing(seq_lens_per_rank, *args)``, with the job's ticket for :meth:`result`.
        Returns once the replies to earlier jobs are read: at once when their solves are done; a
        worker that gives them in ``timeout_s`` (``None``: no limit) is killed (stuck, or stopped),
        failing them, and another takes this job. A worker that cannot start or has died fails the
        job (at :meth:`result`)."""
        ticket, self._submitted = self._submitted, self._submitted + 1
        # Read finished replies before sending more: a reply larger than the pipe's buffer blocks the
        # worker's write, and it would never read this job while our write waits on it.
        self._read_replies(lambda: bool(self._unread), timeout_s)
        try:
            process = self._start()
            _write_frame(process.stdin, (seq_lens_per_rank, *args))
            self._unread.append(ticket)
        except Exception as error:  # cannot start, a broken pipe, a pickle: fails this rank's job, to be agreed on
            self._fail(ticket, f"could not be sent to the plan worker ({type(error).__name__}: {error})")
        return ticket

    def result(self, ticket: int, timeout_s: float | None = None) -> tuple[RoutingPlan, float]:
        """Job ``ticket``'s ``(plan, solve seconds)``, waiting for it if need be, at most
        ``timeout_s`` (``None``: as long as it takes). A worker that gives no reply in time is
        killed (it is stuck, or stopped), failing every job it had.

        Raises:
            PlanWorkerError: the worker died, could not start or gave no reply in time, or the solve
                raised (the message names the error; solving it here raises it again).
        """
        self._read_replies(lambda: ticket not in self._replies and ticket in self._unread, timeout_s)
        if ticket not in self._replies:
            raise PlanWorkerError(f"no job {ticket} is waiting (submitted: {self._submitted})")
        plan, solve_s, error = self._replies.pop(ticket)
        if error is not None:
            raise PlanWorkerError(error)
        return plan, solve_s

    def discard(self, ticket: int) -> None:
        """Forget job ``ticket``: its reply is dropped, now or when it comes (replies come in order,
        so it is still read). Does not wait."""
        if self._replies.pop(ticket, None) is None and ticket in self._unread:
            self._discarded.add(ticket)

    def close(self) -> None:
        """Stop the worker; the jobs it still had fail. A later :meth:`submit` starts another."""
        self._stop("the plan worker was stopped before replying")

    def _stop(self, why: str) -> None:
        """Stop the worker; the jobs it still had fail with ``why``."""
        process, self._process = self._process, None
        for ticket in self._unread:
            self._reply(ticket, (None, 0.0, why))
        self._unread = []
        if process is not None:
            for pipe in (process.stdin, process.stdout):  # a worker writing an unread reply gets EPIPE
                with contextlib.suppress(OSError):  # a dead worker's pipe is broken
                    pipe.close()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _start(self) -> subprocess.Popen:
        if self._process is not None:
            return self._process
        # The package this process imported, loaded from its own folder: another copy (installed, on
        # PYTHONPATH, or in the working directory, which `-c` and `-m` put first on the path) would
        # plan with other code. Putting the package's parent first on the path would not do: for an
        # installed package that is site-packages, whose modules would then shadow the standard
        # library's. The working directory is taken off the path all the same.
        package = str(Path(__file__).resolve().parent)
        code = ("import importlib.util, os, sys; sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]; "
                f"spec = importlib.util.spec_from_file_location('deepspeed_knap', {package + '/__init__.py'!r}, "
                f"submodule_search_locations=[{package!r}]); "
                "sys.modules['deepspeed_knap'] = module = importlib.util.module_from_spec(spec); "
                "spec.loader.exec_module(module); import deepspeed_knap.plan_worker as w; w.main()")  # fmt: skip
        # Unbuffered: select() on the replies' pipe must not miss a reply read ahead into a buffer.
        self._process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         bufsize=0)  # fmt: skip
        return self._process

    def _read_replies(self, more: Callable[[], bool], timeout_s: float | None) -> None:
        """Read replies while ``more()``, for ``timeout_s`` at most in all; a worker that gives none
        in time is killed (closing its pipes would not end a stuck one), failing its jobs."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while more():
            if deadline is not None:
                ready, _, _ = select.select([self._process.stdout], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    self._process.kill()
                    self._stop(f"the plan worker gave no plan within {timeout_s:g} s and was killed")
                    return
            self._read_reply()

    def _read_reply(self) -> None:
        ticket = self._unread.pop(0)
        try:
            reply = _read_frame(self._process.stdout)
        except Exception as error:  # an unreadable reply fails this rank's job, to be agreed on, never raised
            self._fail(ticket, f"the plan worker's reply could not be read ({type(error).__name__}: {error})")
            return
        if reply is None:
            self._fail(ticket, "the plan worker died before replying")
        else:
            plan, solve_s, error = reply
            error = None if error is None else f"the plan worker's solve raised {error}"
            self._reply(ticket, (plan, solve_s, error))

    def _reply(self, ticket: int, reply: tuple[RoutingPlan | None, float, str | None]) -> None:
        if ticket in self._discarded:
            self._discarded.remove(ticket)
        else:
            self._replies[ticket] = reply

    def _fail(self, ticket: int, what: str) -> None:
        """Fail job ``ticket`` with ``what`` (and the worker's exit code), and stop the worker."""
        process = self._process
        self.close()
        code = "" if process is None else f" (exit code {process.returncode})"
        self._reply(ticket, (None, 0.0, what + code))


def _write_frame(stream: IO[bytes], value: Any) -> None:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:  # an unbuffered stream may take part of it
        data = data[stream.write(data) :]
    stream.flush()


def _read_frame(stream: IO[bytes]) -> Any | None:
    """The next value, or ``None`` at end of input."""
    header = _read_exactly(stream, _HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = _read_exactly(stream, size)
    return pickle.loads(data) if len(data) == size else None


def _read_exactly(stream: IO[bytes], size: int) -> bytes:
    """``size`` bytes, fewer only at end of input (an unbuffered pipe returns what has come)."""
    chunks, missing = [], size
    while missing and (chunk := stream.read(missing)):
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def main() -> None:
    """The worker's loop: read a job, solve it, reply ``(plan, solve_s, None)`` or
    ``(None, 0.0, "Error: message")``, until the input ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the rank's group; the rank ends us
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the replies
    jobs = sys.stdin.buffer
    while (job := _read_frame(jobs)) is not None:
        start = time.perf_counter()
        try:
            reply = (plan_routing(*job), time.perf_counter() - start, None)
        except Exception as error:  # sent back: the ranks agree on it, then solve it themselves
            reply = (None, 0.0, f"{type(error).__name__}: {error}")
        try:
            _write_frame(replies, reply)
        except BrokenPipeError:  # the parent closed its end: stopped, not an error
            os._exit(0)  # skips flushing the broken pipe again at exit


if __name__ == "__main__":
    main()
