"""Launcher commands for the end-to-end tests: the deepspeed launcher and mpirun, run with a timeout,
their /dev/shm buffers removed after."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed_knap.runtime.shm_buffers import remove_job_buffers

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONFIG = ROOT / "ds_configs" / "tiny_cpu_zero3.json"
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun", path=str(BIN)) is None, reason="needs the mpi extra")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_launch(script: Path, *args: str, ranks: int = 4) -> list[str]:
    return [str(BIN / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port()), str(script), *args]


def local_launch(
    script: Path, *args: str, ranks: int = 2, module: bool = False, rank_logs: Path | None = None
) -> list[str]:
    """What ``deepspeed --num_gpus ranks script`` runs on one node: DeepSpeed's per-node launcher
    (``deepspeed.launcher.launch``), with the environment it is given, so the ranks start as under
    the runner. Without the runner's own start and exit, a launch takes ~2 s less on 2 cores
    (noop script: 5.8 s against 7.8). For tests of what a script does; tests of the launcher and
    of documented commands use :func:`deepspeed_launch`.

    ``module``: ``script`` is a module name (``python -m``); ``rank_logs``: a directory where the
    launcher writes each rank's output to a file of its own (``*_rank{r}.log``)."""
    from deepspeed.launcher.runner import encode_world_info

    world_info = encode_world_info({"localhost": list(range(ranks))})
    flags = [*(["--module"] if module else []), *([f"--enable_each_rank_log={rank_logs}"] if rank_logs else [])]
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *flags, str(script), *args]  # fmt: skip


def mpirun_launch(script: Path, *args: str, ranks: int = 4) -> list[str]:
    # `-m mpi4py`: an uncaught exception on one rank aborts every rank (MPI_Abort) instead of a hang.
    return [str(BIN / "mpirun"), "-n", str(ranks), "-env", "MASTER_PORT", str(free_port()),
            sys.executable, "-m", "mpi4py", str(script), *args]  # fmt: skip


def run(command: list[str]) -> subprocess.CompletedProcess:
    """Run a launcher command. DeepSpeed's CPU shared-memory all-reduce leaves a 69 MB /dev/shm buffer
    per rank, named by master port, behind even on a clean exit; the examples unlink their own, and
    whatever a run left (a script that does not, a rank killed early) is removed here, because dozens
    of runs fill the machine's memory. ``result.leftover_shm`` names what was left. MPICH's segments
    (``mpich_shm_*``, ~3 MB each, left when a rank aborts) carry no port: those that appeared during
    the run are removed too (a parallel MPICH job's would go with them; the suite runs serially)."""
    flag = "--master_port" if "--master_port" in command else "MASTER_PORT"
    port = command[command.index(flag) + 1]
    mpich_before = set(Path("/dev/shm").glob("mpich_shm_*"))
    # One thread per rank unless told otherwise: four ranks of two threads each oversubscribe a
    # 2-core machine.
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    finally:
        leftover = remove_job_buffers(port)
        for segment in set(Path("/dev/shm").glob("mpich_shm_*")) - mpich_before:
            segment.unlink(missing_ok=True)
    result.leftover_shm = leftover
    return result
