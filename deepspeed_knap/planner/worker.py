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
:meth:`~deepspeed_knap.runtime.balancer.KnapBalancer.prefetch` agrees on it across ranks before acting on it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.solve import plan_routing

# A reply (a plan: 66 KB at 32 GPUs, 2 MB at 1,024) that fits the pipe is written whole while the
# step runs; one that does not leaves the worker blocked mid-write until the rank reads, which then
# waits for the worker to wake and write the rest (~3 ms at 32 GPUs).
_REPLY_PIPE_BYTES = 2**20
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
        deadline = _deadline(timeout_s)
        # Read finished replies before sending more: a reply larger than the pipe's buffer blocks the
        # worker's write, and it would never read this job while our write waits on it.
        while self._unread:
            self._read_reply(deadline, timeout_s)
        try:
            process = self._start()
            _write_frame(process.stdin.fileno(), (seq_lens_per_rank, *args), deadline)
            self._unread.append(ticket)
        except TimeoutError:
            self._give_up(timeout_s)
            self._reply(ticket, (None, 0.0, _gave_up(timeout_s)))
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
        deadline = _deadline(timeout_s)
        while ticket not in self._replies and ticket in self._unread:
            self._read_reply(deadline, timeout_s)
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
        package = str(Path(sys.modules["deepspeed_knap"].__file__).resolve().parent)
        code = ("import importlib.util, os, sys; sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]; "
                f"spec = importlib.util.spec_from_file_location('deepspeed_knap', {package + '/__init__.py'!r}, "
                f"submodule_search_locations=[{package!r}]); "
                "sys.modules['deepspeed_knap'] = module = importlib.util.module_from_spec(spec); "
                "spec.loader.exec_module(module); import deepspeed_knap.planner.worker as w; w.main()")  # fmt: skip
        # Its pipes are read and written through their descriptors (no buffer to read ahead into,
        # so a poll sees every byte not read yet).
        self._process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         bufsize=0)  # fmt: skip
        with contextlib.suppress(OSError, AttributeError):  # Linux only, up to /proc/sys/fs/pipe-max-size
            fcntl.fcntl(self._process.stdout.fileno(), fcntl.F_SETPIPE_SZ, _REPLY_PIPE_BYTES)
        return self._process

    def _read_reply(self, deadline: float | None, timeout_s: float | None) -> None:
        """Read the oldest unread reply by ``deadline``; a worker that has not given it by then is
        killed (``timeout_s`` for the message), failing its jobs."""
        ticket = self._unread[0]
        try:
            reply = _read_frame(self._process.stdout.fileno(), deadline)
        except TimeoutError:
            self._give_up(timeout_s)  # fails every unread job, this one too
            return
        except Exception as error:  # an unreadable reply fails this rank's job, to be agreed on, never raised
            self._unread.pop(0)
            self._fail(ticket, f"the plan worker's reply could not be read ({type(error).__name__}: {error})")
            return
        self._unread.pop(0)
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

    def _give_up(self, timeout_s: float | None) -> None:
        """Kill a worker that did not answer in time (stuck, or stopped: closing its pipes would not
        end it); every job it had fails."""
        self._process.kill()
        self._stop(_gave_up(timeout_s))

    def _fail(self, ticket: int, what: str) -> None:
        """Fail job ``ticket`` with ``what`` (and the worker's exit code), and stop the worker."""
        process = self._process
        self.close()
        code = "" if process is None else f" (exit code {process.returncode})"
        self._reply(ticket, (None, 0.0, what + code))


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _gave_up(timeout_s: float | None) -> str:
    return f"the plan worker did not answer within {timeout_s:g} s and was killed"


def _write_frame(fd: int, value: Any, deadline: float | None = None) -> None:
    """Write ``value``'s frame to pipe ``fd`` whole, by ``deadline`` (of ``time.monotonic()``;
    ``None``: no limit).

    Raises:
        TimeoutError: at the deadline, the frame part written.
    """
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        _wait(fd, select.POLLOUT, deadline)
        # Once the pipe has room, a write of PIPE_BUF bytes at most does not block.
        data = data[os.write(fd, data if deadline is None else data[: select.PIPE_BUF]) :]


def _read_frame(fd: int, deadline: float | None = None) -> Any | None:
    """The next value on pipe ``fd``, or ``None`` at end of input; by ``deadline`` as in
    :func:`_write_frame`."""
    header = _read_exactly(fd, _HEADER.size, deadline)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = _read_exactly(fd, size, deadline)
    return pickle.loads(data) if len(data) == size else None


def _read_exactly(fd: int, size: int, deadline: float | None) -> bytes:
    """``size`` bytes, fewer only at end of input (a pipe gives what has come)."""
    chunks, missing = [], size
    while missing:
        _wait(fd, select.POLLIN, deadline)
        if not (chunk := os.read(fd, missing)):
            break
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def _wait(fd: int, event: int, deadline: float | None) -> None:
    """Return once ``fd`` is ready for ``event`` (or closed at the other end); without a deadline,
    at once (the read or write blocks by itself). ``poll``, not ``select``: a training process
    may have more than 1,024 descriptors open.

    Raises:
        TimeoutError: at the deadline.
    """
    if deadline is None:
        return
    poller = select.poll()
    poller.register(fd, event)
    if not poller.poll(max(0.0, deadline - time.monotonic()) * 1e3):
        raise TimeoutError


def main() -> None:
    """The worker's loop: read a job, solve it, reply ``(plan, solve_s, None)`` or
    ``(None, 0.0, "Error: message")``, until the input ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the rank's group; the rank ends us
    replies = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the replies
    while (job := _read_frame(sys.stdin.fileno())) is not None:
        start = time.perf_counter()
        try:
            reply = (plan_routing(*job), time.perf_counter() - start, None)
        except Exception as error:  # sent back: the ranks agree on it, then solve it themselves
            reply = (None, 0.0, f"{type(error).__name__}: {error}")
        try:
            _write_frame(replies, reply)
        except BrokenPipeError:  # the parent closed its end: stopped, not an error
            os._exit(0)


if __name__ == "__main__":
    main()
