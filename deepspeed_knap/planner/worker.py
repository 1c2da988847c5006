"""Plans solved in a worker process, so the next step's solve overlaps this step's compute.

    worker = PlanWorker()
    ticket = worker.submit(seq_lens_per_rank, topology, model, solver, max_tokens_per_gpu)  # at once
    ...                                    # this step runs
    plan, solve_s, shared = worker.result(ticket)  # plan_routing's plan for those arguments, bit-identical

The worker is a child Python running :func:`main`, fed pickles over its stdin and stdout.
Started this way it imports only the planner (NumPy, ~0.2 s), never torch, CUDA or the training
script, which multiprocessing's spawn and forkserver re-import as ``__main__``. A process rather than
a thread: the solve is Python, and a thread holding the GIL for tens of milliseconds would stall the
training loop's kernel launches for as long. It exits at a frame of ``None`` (:meth:`PlanWorker.close`)
or when its stdin closes (its parent is gone).

The ranks of a balance group submit the same job (the gathered lengths, the topology, the cost model
refit alike on every rank), so the workers of one host share its solve (:class:`_SharedPlans`): the
first to take the job's lock solves it and leaves the plan in a file, and the others read it. On
2 CPU ranks each ``auto`` solve took 2-11 ms of CPU per rank in ``bench train``, taken from the ranks'
cores; on a node of 8 GPUs, 8 workers would solve every plan 8 times.

Pure: no ``torch.distributed``. A worker failure raises :class:`PlanWorkerError` on this rank only;
:meth:`~deepspeed_knap.runtime.balancer.KnapBalancer.prefetch` agrees on it across ranks before acting on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.solve import plan_routing

# A reply (a plan: 66 KB at 32 GPUs, 2-8 MB at 1,024: 7.6 MB for kf_lowres's 32,768 sequences) that
# fits the pipe is written whole while the step runs; one that does not leaves the worker blocked
# mid-write until the rank reads, which then waits for the worker to wake and write the rest (~3 ms at
# 32 GPUs). A job (~100 KB at 1,024 GPUs) that fits its pipe is sent while the worker solves the one
# before. Both pipes hold this much.
_PIPE_BYTES = 2**20
# A worker that has not answered its first job this long after its start is waited for like any other
# (and given up on at the rank's timeout): one that hangs as it starts must not go unnoticed. Starting
# takes 0.14-0.42 s, the first solve at most ~1 s (1,024 GPUs).
_START_GRACE_S = 10.0
_HEADER = struct.Struct("<Q")  # the byte length of the pickle that follows
# Shared solves: a worker waits at least this long (or three times the longest solve it has seen)
# for a sibling that holds a job's lock (solving it), then solves the job itself; it keeps the files
# of its last _SHARED_KEPT jobs (siblings are at most a step apart: prefetch keeps two plans ahead),
# and a starting worker removes files older than _SHARED_STALE_S (left by a killed worker).
_SHARED_WAIT_S = 2.0
_SHARED_KEPT = 4
_SHARED_STALE_S = 3600.0
# Names the folder the plan workers of a host share their solves in (default: under /dev/shm).
PLAN_FOLDER_VARIABLE = "DEEPSPEED_KNAP_PLAN_FOLDER"


class WorkerPlan(NamedTuple):
    """A plan from the worker: the plan, the seconds its solve took, and whether another worker of
    this host solved it (the same job: the plan is the one this worker would have solved)."""

    plan: RoutingPlan
    solve_s: float
    shared: bool


class PlanWorkerError(RuntimeError):
    """The worker could not return a plan: it failed to start, died, or its solve raised."""


class PlanWorker:
    """One child process solving :func:`~deepspeed_knap.planner.plan_routing` jobs in order. Started
    by :meth:`start` or the first :meth:`submit`, and again on the next one after it died. ``share``: its solves are
    shared with the other workers of this host (:class:`_SharedPlans`); ``False`` solves every job
    itself (``bench ahead --no-share`` measures what sharing saves)."""

    def __init__(self, share: bool = True) -> None:
        self.share = share
        self._process: subprocess.Popen | None = None
        self._submitted = 0  # jobs ever submitted; a job's ticket is its number
        self._unread: list[int] = []  # tickets sent to the running worker, reply not read yet
        self._replies: dict[int, tuple[RoutingPlan | None, float, str | None, bool]] = {}
        self._discarded: set[int] = set()  # unread tickets whose replies are dropped when read
        self._answered = False  # the running worker has replied to a job
        self._started = 0.0  # time.monotonic() at the running worker's start
        self._torn: subprocess.Popen | None = None  # a worker left with a frame half written to it

    def submit(self, seq_lens_per_rank: list[list[int]], *args: Any, timeout_s: float | None = None) -> int:
        """Queue ``plan_routing(seq_lens_per_rank, *args)``, with the job's ticket for :meth:`result`.
        Returns once the job is sent: without waiting for earlier solves (a worker's first also waits
        for its start-up) while the job fits the worker's pipe (1 MiB); replies the worker has written
        meanwhile are read first. A worker whose pipe stays full for ``timeout_s`` (``None``: no
        limit) is killed (stuck, or stopped), failing its jobs. A worker found dead with jobs
        unanswered fails them, and another takes this job; one that cannot start, or dies as the job
        is written, fails the job (at :meth:`result`)."""
        ticket, self._submitted = self._submitted, self._submitted + 1
        deadline = _deadline(timeout_s)
        try:
            self._send(((seq_lens_per_rank, *args), timeout_s), deadline, timeout_s)
            self._unread.append(ticket)
        except TimeoutError:
            if self._process is not None:
                self._give_up(timeout_s)
            self._reply(ticket, (None, 0.0, _gave_up(timeout_s), False))
        except Exception as error:  # cannot start, a broken pipe, a pickle: fails this rank's job, to be agreed on
            self._fail(ticket, f"could not be sent to the plan worker ({type(error).__name__}: {error})")
        return ticket

    def result(self, ticket: int, timeout_s: float | None = None) -> WorkerPlan:
        """Job ``ticket``'s plan, waiting for it if need be, at most
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
        plan, solve_s, error, shared = self._replies.pop(ticket)
        if error is not None:
            raise PlanWorkerError(error)
        return WorkerPlan(plan, solve_s, shared)

    def start(self) -> None:
        """Start the worker process now, not at the first job: one started during set-up has
        imported NumPy and the planner (0.2-0.7 s on CPU hosts, beside busy ranks) before the first
        prefetch, so the first steps take their plans ahead too. Never raises: the first
        :meth:`submit` tries again, and fails its job if the worker cannot start then either (the
        ranks agree on failed jobs). A worker that died since is replaced only after a job fails
        on it, as always."""
        with contextlib.suppress(Exception):
            self._start()

    @property
    def pid(self) -> int | None:
        """The running worker's process id (``None``: none running)."""
        return None if self._process is None else self._process.pid

    def waits_for_start(self, ticket: int) -> bool:
        """Whether job ``ticket``'s reply would wait for the running worker's start: the job is that
        worker's, unanswered, and the worker has not replied to a job yet, has no reply in its pipe,
        and started less than ``_START_GRACE_S`` (10 s) ago (it is importing the planner, or solving
        its first job). The start-up took 0.14 s alone on a 2-core CPU and 0.23-0.42 s beside two
        CPU ranks of ``bench train`` on a 16-core host, whose steps took 0.1 s."""
        if self._process is None or self._answered or ticket not in self._unread:
            return False
        if time.monotonic() - self._started > _START_GRACE_S:
            return False
        return not _poll({self._process.stdout.fileno(): select.POLLIN}, time.monotonic())

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
            self._reply(ticket, (None, 0.0, why, False))
        self._unread = []
        if process is not None:
            # A stop frame first: a process forked from this one (a DataLoader's workers) holds the
            # write end too, so closing ours alone would not end the worker's input (it was killed
            # 5 s later, leaving its shared files). Written whole (it is under PIPE_BUF) where the
            # pipe has room and no error, and never after half a job's frame, which it would end.
            # (Such a process holds our read end too: a worker with jobs queued solves them first.)
            with contextlib.suppress(OSError, ValueError):
                fd = process.stdin.fileno()
                if (
                    process is not self._torn
                    and _poll({fd: select.POLLOUT}, time.monotonic()).get(fd) == select.POLLOUT
                ):
                    os.write(fd, _frame(None))
            for pipe in (process.stdin, process.stdout):  # a worker writing an unread reply gets EPIPE
                with contextlib.suppress(OSError):  # a dead worker's pipe is broken
                    pipe.close()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _send(self, value: Any, deadline: float | None, timeout_s: float | None) -> None:
        """Write ``value``'s frame to the worker (started if need be) by ``deadline``, reading the
        replies it writes meanwhile first: a reply larger than its pipe blocks the worker's write,
        and it would never read this job while our write waited on it. A worker stopped meanwhile
        (dead, or given up on: its jobs failed) is replaced, and the new one gets the whole frame.

        Raises:
            TimeoutError: at the deadline (the worker, if still running, is to be given up on).
            OSError: the worker closed its end (it died).
        """
        frame = _frame(value)
        process, data = self._start(), memoryview(frame)
        self._torn = process  # until the frame is whole (an error or a stop on the way leaves it so)
        while data:
            events = {process.stdin.fileno(): select.POLLOUT}
            if self._unread:
                events[process.stdout.fileno()] = select.POLLIN
            ready = _poll(events, deadline)
            if not ready:
                raise TimeoutError
            if process.stdout.fileno() in ready:  # a reply, or a dead worker's end of input
                self._read_reply(deadline, timeout_s)
                if self._process is not process:  # stopped: given up on (past the deadline) or dead
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError  # no new worker only to give it up
                    process, data = self._start(), memoryview(frame)
                    self._torn = process
            else:  # room for PIPE_BUF bytes (a write of at most that does not block), or a closed end
                data = data[os.write(process.stdin.fileno(), data[: select.PIPE_BUF]) :]
        self._torn = None

    def _start(self) -> subprocess.Popen:
        if self._process is not None:
            return self._process
        self._answered, self._started = False, time.monotonic()
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
                f"spec.loader.exec_module(module); import deepspeed_knap.planner.worker as w; w.main({self.share})")  # fmt: skip
        # Its pipes are read and written through their descriptors (no buffer to read ahead into,
        # so a poll sees every byte not read yet).
        self._process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         bufsize=0)  # fmt: skip
        for pipe in (self._process.stdin, self._process.stdout):
            with contextlib.suppress(OSError, AttributeError):  # Linux only, up to /proc/sys/fs/pipe-max-size
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
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
        self._answered = reply is not None
        if reply is None:
            self._fail(ticket, "the plan worker died before replying")
        elif not (isinstance(reply, tuple) and len(reply) == 4):
            self._fail(ticket, f"the plan worker's reply is not (plan, seconds, error, shared): {reply!r:.200}")
        else:
            plan, solve_s, error, shared = reply
            error = None if error is None else f"the plan worker's solve raised {error}"
            self._reply(ticket, (plan, solve_s, error, shared))

    def _reply(self, ticket: int, reply: tuple[RoutingPlan | None, float, str | None, bool]) -> None:
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
        self._reply(ticket, (None, 0.0, what + code, False))


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _gave_up(timeout_s: float | None) -> str:
    return f"the plan worker did not answer within {timeout_s:g} s and was killed"


def _write_frame(fd: int, value: Any) -> None:
    """Write ``value``'s frame to pipe ``fd`` whole, blocking while the pipe is full (the worker's
    replies: the rank reads them; the rank's jobs go through :meth:`PlanWorker._send`)."""
    data = memoryview(_frame(value))
    while data:
        data = data[os.write(fd, data) :]


def _frame(value: Any) -> bytes:
    """``value``'s frame: its pickle's byte length, then the pickle."""
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def _read_frame(fd: int, deadline: float | None = None) -> Any | None:
    """The next value on pipe ``fd``, or ``None`` at end of input, by ``deadline`` (of
    ``time.monotonic()``; ``None``: no limit).

    Raises:
        TimeoutError: at the deadline, the frame part read.
    """
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
    at once (the read or write blocks by itself).

    Raises:
        TimeoutError: at the deadline.
    """
    if deadline is not None and not _poll({fd: event}, deadline):
        raise TimeoutError


def _poll(events: dict[int, int], deadline: float | None) -> dict[int, int]:
    """The descriptors of ``events`` (``{fd: event}``) ready for their event, or closed at the other
    end, by ``deadline`` (``None``: however long it takes; passed: now), with what each got.
    ``poll``, not ``select``: a training process may have more than 1,024 descriptors open."""
    poller = select.poll()
    for fd, event in events.items():
        poller.register(fd, event)
    return dict(poller.poll(None if deadline is None else max(0.0, deadline - time.monotonic()) * 1e3))


def _solve(job: tuple) -> tuple[RoutingPlan | None, float, str | None, bool]:
    """``(plan, solve seconds, None, False)`` for the ``plan_routing`` arguments ``job``, or
    ``(None, 0.0, "Error: message", False)``."""
    start = time.perf_counter()
    try:
        return plan_routing(*job), time.perf_counter() - start, None, False
    except Exception as error:  # sent back: the ranks agree on it, then solve it themselves
        return None, 0.0, f"{type(error).__name__}: {error}", False


class _SharedPlans:
    """The plans of the jobs this worker took, shared with the other workers of this host through
    files in ``folder`` (``/dev/shm``: memory). A job's files are named by a digest of its
    arguments (:func:`_canonical`) and of the code that solves it (:func:`_code_digest`), so only an
    equal job solved by the same code and runtime finds a plan: the plan read is the one this worker
    would have solved. The first worker to take a job's lock solves it and publishes the plan
    (written aside, then renamed: a reader sees all of it or nothing); one that finds the plan, or
    gets the lock after a sibling published it, reads it. Sharing only saves work: whatever fails
    (no folder, a full disk, a file that is not a plan, a sibling holding the lock too long, a file
    removed under it) leaves this worker solving the job itself.

    The folder is opened once (``fd``: not through a link) and checked through that descriptor,
    and every file is reached relative to it (``dir_fd``), never through the path again: a plan file
    is a pickle, and a folder renamed and replaced by a link to another user's after the check (its
    parent writable by others and not sticky, as a group's scratch folder may be) would otherwise
    have this worker unpickle that user's files."""

    def __init__(self, folder: Path, fd: int, code: bytes) -> None:
        self.folder, self.fd, self.code = folder, fd, code
        self.kept: deque[str] = deque()  # the keys of this worker's last jobs, oldest first
        self.published: set[str] = set()  # those of them this worker solved and published
        self.longest_solve_s = 0.0  # of the solves this worker made or read: how long a sibling may take

    @classmethod
    def open(cls) -> _SharedPlans | None:
        """Sharing in the folder ``DEEPSPEED_KNAP_PLAN_FOLDER`` names, else in this user's folder
        under ``/dev/shm`` (else the temporary directory); ``None`` when it cannot be made, is a
        link, or is not this user's own with no access for others."""
        base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
        folder = Path(os.environ.get(PLAN_FOLDER_VARIABLE) or base / f"deepspeed-knap-plans-{os.getuid()}")
        fd = None
        try:
            with contextlib.suppress(FileExistsError):  # a link there is refused by the open below
                os.mkdir(folder, 0o700)
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            info = os.fstat(fd)  # the folder opened, whatever the path names by now
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                os.close(fd)
                return None  # another user's, or open to others: its files could be anyone's
            stale = time.time() - _SHARED_STALE_S
            for name in os.listdir(fd):
                with contextlib.suppress(OSError):
                    if os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime < stale:
                        os.unlink(name, dir_fd=fd)
            return cls(folder, fd, _code_digest())
        except Exception:  # a folder it cannot use (OSError), an odd file name in it: solve alone
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            return None

    def key(self, job: tuple) -> str:
        """The name of ``job``'s files."""
        canonical = io.BytesIO()
        pickler = pickle.Pickler(canonical, pickle.HIGHEST_PROTOCOL)
        # No memo: an object met twice is written twice, not as a reference (equal jobs, equal bytes).
        pickler.fast = True
        pickler.dump(_canonical(job))
        return hashlib.sha256(self.code + canonical.getvalue()).hexdigest()[:40]

    def reply(self, job: tuple, timeout_s: float | None) -> tuple[RoutingPlan | None, float, str | None, bool]:
        """:func:`_solve`'s reply for ``job``, from a sibling's solve if one has it (``shared`` True).
        ``timeout_s``: how long the rank waits for the reply (``None``: no limit); a sibling's lock
        is waited for at most half of it, and at most ``_SHARED_WAIT_S`` or three times the longest
        solve seen, whichever is longer."""
        key = self.key(job)
        self._keep(key)
        if (found := self._read(key)) is not None:
            return found
        try:
            lock = self._open(f"{key}.lock", os.O_RDWR | os.O_CREAT)
        except OSError:
            return _solve(job)
        try:
            wait_s = max(_SHARED_WAIT_S, 3 * self.longest_solve_s)
            locked = _lock(lock, wait_s if timeout_s is None else min(wait_s, timeout_s / 2))
            if (found := self._read(key)) is not None:  # published while this worker waited for the lock
                return found
            if locked and os.fstat(lock).st_size > 0:
                # A sibling held the lock to solve and published nothing (its solve raised, or the
                # folder is full): solve without the lock, or the siblings would solve one by one.
                os.close(lock)
                lock = None
            elif locked:
                with contextlib.suppress(OSError):
                    os.write(lock, b"1")  # this worker is solving it
            reply = _solve(job)
            self.longest_solve_s = max(self.longest_solve_s, reply[1])
            if reply[2] is None and self._publish(f"{key}.plan", pickle.dumps(reply[:2], pickle.HIGHEST_PROTOCOL)):
                self.published.add(key)
            return reply
        finally:
            if lock is not None:
                os.close(lock)  # releases the lock

    def close(self) -> None:
        """Remove this worker's files (a sibling that comes later solves the job itself), and close
        the folder."""
        while self.kept:
            self._remove(self.kept.popleft())
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1  # closed: a descriptor of that number may be another file's by now

    def _open(self, name: str, flags: int) -> int:
        """A descriptor of the file ``name`` in the folder opened (never a link: refused)."""
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)

    def _read(self, key: str) -> tuple[RoutingPlan, float, None, bool] | None:
        """The reply published for ``key``, or ``None`` if there is none (yet) or it is not a plan;
        ``shared`` unless this worker published it (a job it had before)."""
        try:
            with os.fdopen(self._open(f"{key}.plan", os.O_RDONLY), "rb") as file:
                plan, solve_s = pickle.loads(file.read())
        except Exception:  # none yet (OSError), or a file that is not a plan: solve instead
            return None
        if not isinstance(plan, RoutingPlan) or not isinstance(solve_s, float):
            return None
        self.longest_solve_s = max(self.longest_solve_s, solve_s)
        return plan, solve_s, None, key not in self.published

    def _publish(self, name: str, data: bytes) -> bool:
        """Write ``data`` to the file ``name`` whole, or not at all (a full disk: the siblings solve
        themselves): written aside, then renamed over it; whether it was written."""
        aside = f"{name}.{os.getpid()}.{os.urandom(6).hex()}"
        try:
            with os.fdopen(self._open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as file:
                file.write(data)
            os.replace(aside, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            return True
        except BaseException as error:  # (SystemExit too: a SIGTERM mid-write leaves no file aside)
            with contextlib.suppress(OSError):
                os.unlink(aside, dir_fd=self.fd)
            if not isinstance(error, OSError):
                raise
            return False

    def _keep(self, key: str) -> None:
        if key not in self.kept:
            self.kept.append(key)
        while len(self.kept) > _SHARED_KEPT:
            self._remove(self.kept.popleft())

    def _remove(self, key: str) -> None:
        self.published.discard(key)
        for suffix in (".plan", ".lock"):
            with contextlib.suppress(OSError):
                os.unlink(f"{key}{suffix}", dir_fd=self.fd)


def _canonical(value: Any) -> Any:
    """``value`` for naming a job: every list, tuple and dataclass as its type and its items (a
    dataclass: its fields, so that a cached property stored on it, a topology's groups computed on
    some ranks and not on others, does not tell equal jobs apart), anything else as it is."""
    kind = (type(value).__module__, type(value).__qualname__)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return kind, tuple(_canonical(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, list | tuple):
        return kind, tuple(_canonical(item) for item in value)
    return value


def _code_digest() -> bytes:
    """A digest of what solves a job: the package's Python files (paths and contents), the Python
    and NumPy that run them. Workers running other code (another copy, an edited file, another
    environment) never share a plan."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(repr((sys.version, sys.executable, np.__version__)).encode())
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def _lock(fd: int, timeout_s: float) -> bool:
    """Take ``fd``'s exclusive lock, waiting at most ``timeout_s``; whether it was taken. Polled, at
    most 5 ms apart: the plan is read a step later, and no signal interrupts the solve."""
    deadline, pause = time.monotonic() + timeout_s, 1e-4
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)


def main(share: bool = True) -> None:
    """The worker's loop: read a job, solve it (or, with ``share``, read a sibling's solve of it),
    reply ``(plan, solve_s, None, shared)`` or ``(None, 0.0, "Error: message", False)``, until the
    input ends or a frame of ``None`` stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the rank's group; the rank ends us
    # DeepSpeed's launcher, srun and scancel end every process of a failed job with SIGTERM: leave by
    # SystemExit, so that the shared plans' files go with us (by default they stayed, 2-8 MB each).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    replies = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the replies
    shared = _SharedPlans.open() if share else None
    try:
        while (frame := _read_frame(sys.stdin.fileno())) is not None:
            if not (isinstance(frame, tuple) and len(frame) == 2 and isinstance(frame[0], tuple)):
                reply = (None, 0.0, f"FrameError: not a (job, timeout) frame: {frame!r:.200} (the package changed "
                                    "under the running job?)", False)  # fmt: skip
            elif shared is None:
                reply = _solve(frame[0])
            else:
                try:
                    reply = shared.reply(*frame)
                except Exception:  # sharing failed in a way not foreseen: it only ever saves work
                    reply = _solve(frame[0])
            try:
                _write_frame(replies, reply)
            except BrokenPipeError:  # the parent closed its end: stopped, not an error
                if shared is not None:
                    shared.close()
                os._exit(0)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        if shared is not None:
            shared.close()


if __name__ == "__main__":
    main()
