"""DeepSpeed's CPU all-reduce (``deepspeed.ops.comm.shm``) creates one ~69 MB file per rank in
``/dev/shm``, named ``deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``, and never
unlinks it: every CPU run leaves its world size times 69 MB of memory behind until reboot.

Each rank maps every rank's file once, while the process group starts. After a barrier that follows
start-up, no rank opens those files again, so each rank can unlink its own at once: the mappings
stay valid until the processes exit, and nothing is left behind even if the run fails later.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def own_shm_buffer(rank: int) -> Path:
    """The ``/dev/shm`` file DeepSpeed's CPU all-reduce created for global ``rank`` of this job."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def unlink_own_shm_buffer(rank: int) -> None:
    """Remove this rank's all-reduce buffer file, if DeepSpeed made one. Call on every rank after a
    barrier that follows ``deepspeed.initialize`` (every rank must have opened every file first)."""
    own_shm_buffer(rank).unlink(missing_ok=True)


def remove_job_buffers(port: int | str) -> list[str]:
    """Remove every rank's buffer of the job on master ``port`` (of this machine), as the process that
    launched the ranks, once they have exited; returns the names removed. A rank killed or crashed
    before :func:`unlink_own_shm_buffer` leaves its file otherwise, and a tmpfs filled by such files
    makes DeepSpeed's next CPU start-up die in ``shm_initialize`` (SIGSEGV, no Python error)."""
    removed = []
    for buffer in job_buffers(port):
        buffer.unlink(missing_ok=True)
        removed.append(buffer.name)
    return removed


def job_buffers(port: int | str) -> list[Path]:
    """Every rank's buffer of the job on master ``port`` (of this machine) now in ``/dev/shm``."""
    return list(SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def remove_orphaned_buffers(min_age_s: float = 600.0) -> list[str]:
    """Remove this user's buffers that no process of this machine maps or holds open, last written
    over ``min_age_s`` ago (left by jobs that were killed); returns the names removed.

    DeepSpeed creates a buffer by writing it whole through one descriptor, which it keeps, and only
    then maps it: a starting job holds it open first. Processes of other PID namespaces (containers
    sharing ``/dev/shm``) are not seen here: the age keeps their starting jobs' files, and a running
    job no longer needs its file (its mappings stay valid)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(word for word in maps.read_text().split() if word.startswith(f"{SHM_DIR}/"))
        except OSError:  # the process exited, or is not ours to read
            continue
    held = open_file_ids()
    removed = []
    for buffer in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        try:
            stat = buffer.stat()
        except FileNotFoundError:
            continue
        if time.time() - stat.st_mtime > min_age_s and str(buffer) not in mapped and _file_id(stat) not in held:
            buffer.unlink(missing_ok=True)
            removed.append(buffer.name)
    return removed


def open_file_ids() -> set[tuple[int, int]]:
    """``(device, inode)`` of every file a process of this machine (that we may look at) holds open:
    by inode, because a path may be spelled otherwise (through a link, or relatively)."""
    held = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            held.add(_file_id(fd.stat()))
        except OSError:  # the process or the descriptor is gone, or not ours to read
            continue
    return held


def _file_id(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino
