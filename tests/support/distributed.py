"""Run a test function on N gloo ranks in processes of their own.

    results = run_distributed(fn, world_size=4, args=(...), timeout=120)

``fn(rank, world_size, *args)`` must be importable (a module-level function) and its return value
picklable; ``results[r]`` is rank ``r``'s return value. Ranks rendezvous through a file store in a
fresh temporary directory (no port to collide with a parallel run) and get ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` in their environment, so ``deepspeed.init_distributed()`` adopts the process group.

Failures are reported, never hung on: the first rank to raise stops the run and its traceback is the
error; a rank still running at ``timeout`` dumps its stack (``faulthandler``), the run is killed, and
the error shows which ranks hung and where.

Without CUDA, ranks are forked from a server process that imported torch, DeepSpeed and diffusers
once (``forkserver``): a spawned rank imported them afresh, 2-4 s of CPU each, about a third of the
unit and multirank tiers' time on 2 cores. Each rank still gets the caller's environment of the
moment, as a spawned one does, but what the server's modules read when it imported them stays the
server's, and the ranks share its string-hash seed (the e2e tests' launcher ranks each have their
own). The server starts once the session's tests are collected (:func:`start_rank_server`), from the
session's working directory and environment. Where CUDA is present, and for a test that needs an
environment read at process start (``fresh=True``: glibc's ``MALLOC_*``), ranks are spawned: a
process forked after CUDA was initialized cannot use it.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepspeed_knap.runtime.shm_buffers import remove_job_buffers

# Spawning a rank and importing torch takes seconds on 2 cores; rendezvous must finish within this.
_STARTUP_LIMIT_S = 120.0
# What the fork server imports once, for every rank it forks: what most test functions import.
_PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.comm", "diffusers", "deepspeed_knap.runtime.balancer"]


class DistributedTestError(AssertionError):
    """A rank raised, or did not finish in time. The message names the rank and shows its stack."""


def _worker(fn, rank: int, world_size: int, args: tuple, store_path: str, stack_path: str, timeout: float, results,
            port: int, environment: dict[str, str]):  # fmt: skip
    # The caller's environment now, not the fork server's from when it started.
    os.environ.clear()
    os.environ.update(environment)
    # A port of its own names DeepSpeed's CPU all-reduce buffers in /dev/shm apart from a parallel run's.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    # One CPU thread per rank: N ranks on 2 cores would otherwise thrash.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with open(stack_path, "w") as stack_file:
        try:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
            faulthandler.dump_traceback_later(timeout, exit=False, file=stack_file)
            results.put((rank, "started", time.monotonic()))
            try:
                value = fn(rank, world_size, *args)
            finally:
                # Cancel before tearing down: a slow teardown is not a hang of fn.
                faulthandler.cancel_dump_traceback_later()
                # Every rank mapped every buffer while the group started: this rank's file can go.
                from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

                unlink_own_shm_buffer(rank)
            results.put((rank, "ok", value))
            dist.destroy_process_group()
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 120.0, fresh: bool = False
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.
    ``fresh``: spawn the ranks as new processes, for an environment read at process start.

    Raises:
        DistributedTestError: a rank raised (its traceback), or ranks did not finish within
            ``timeout`` seconds (their stacks at that moment).
    """
    context = _context(fresh)
    results = context.Queue()
    with socket.socket() as probe:  # a free port, only to name this run's /dev/shm buffers
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="knap-dist-") as tmp:
        store_path = str(Path(tmp) / "store")
        stack_paths = [str(Path(tmp) / f"stack-{rank}.txt") for rank in range(world_size)]
        processes = [
            context.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    args,
                    store_path,
                    stack_paths[rank],
                    timeout,
                    results,
                    port,
                    dict(os.environ),
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        spawned_at = time.monotonic()
        for process in processes:
            process.start()
        outcome: dict[int, Any] = {}
        started: dict[int, float] = {}
        try:
            while len(outcome) < world_size:
                try:
                    rank, status, value = results.get(timeout=0.2)
                except queue.Empty:
                    _check_progress(processes, outcome, started, spawned_at, timeout, stack_paths)
                    continue
                if status == "started":
                    started[rank] = value
                elif status == "error":
                    raise DistributedTestError(f"rank {rank} of {world_size} raised:\n{value}")
                else:
                    outcome[rank] = value
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
            for process in processes:
                process.join(timeout=10)
            # A rank killed here, or crashed, before unlinking its buffer would leave it behind.
            remove_job_buffers(port)
    return [outcome[rank] for rank in range(world_size)]


def deepspeed_cpu_comm_builder():
    """DeepSpeed's builder of its CPU shared-memory all-reduce op (the one that leaves
    ``/dev/shm`` buffers), or ``None`` where DeepSpeed builds no such op (another accelerator, or
    not compatible here)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def start_rank_server() -> None:
    """Start the server ranks are forked from (without CUDA), from this process's working directory
    and environment now: Python 3.11's server imports its modules through the path it starts with
    (it ignores the ``sys_path`` it is given), and keeps what they read at import for every rank. So
    a session starts it before any test can change either. Returns while the server imports."""
    if _context(fresh=False).get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _context(fresh: bool):
    import torch

    if fresh or torch.cuda.is_available():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first call's
    return context


def _check_progress(
    processes, outcome: dict, started: dict, spawned_at: float, timeout: float, stack_paths: list[str]
) -> None:
    """Raise if a rank died silently, or ran ``fn`` (or failed to start it) for too long."""
    now = time.monotonic()
    for rank, process in enumerate(processes):
        if rank not in outcome and process.exitcode not in (None, 0):
            raise DistributedTestError(f"rank {rank} died with exit code {process.exitcode} and no Python error")
    # faulthandler dumps at `timeout` after start; give it a moment to finish writing.
    hung = [r for r, t in started.items() if r not in outcome and now > t + timeout + 1.0]
    if hung:
        stacks = "\n".join(f"--- rank {r} ---\n{Path(stack_paths[r]).read_text()}" for r in hung)
        raise DistributedTestError(
            f"ranks {hung} did not finish within {timeout:.0f}s (hang?); their stacks:\n{stacks}"
        )
    late = [r for r in range(len(processes)) if r not in started]
    if late and now > spawned_at + _STARTUP_LIMIT_S:
        raise DistributedTestError(
            f"ranks {late} did not start within {_STARTUP_LIMIT_S:.0f}s (spawn or rendezvous hung)"
        )
