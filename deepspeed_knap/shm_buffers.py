"""DeepSpeed's CPU all-reduce (``deepspeed.ops.comm.shm``) creates one ~69 MB file per rank in
``/dev/shm``, named ``deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``, and never
unlinks it: every CPU run leaves its world size times 69 MB of memory behind until reboot.

Each rank maps every rank's file once, while the process group starts. After a barrier that follows
start-up, no rank opens those files again, so each rank can unlink its own at once: the mappings
stay valid until the processes exit, and nothing is left behind even if the run fails later.
"""

from __future__ import annotations

import os
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
    for buffer in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        buffer.unlink(missing_ok=True)
        removed.append(buffer.name)
    return removed


def remove_orphaned_buffers() -> list[str]:
    """Remove this user's buffers that no running process maps (left by jobs that were killed, on
    this machine); returns the names removed. A job maps every rank's file from its start-up on,
    so only a file being created this very moment could be mapped by nobody yet and still wanted."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours to read
            continue
        mapped.update(word for word in text.split() if word.startswith(f"{SHM_DIR}/deepspeed_allreduce_buffer_"))
    removed = []
    for buffer in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        if str(buffer) not in mapped:
            buffer.unlink(missing_ok=True)
            removed.append(buffer.name)
    return removed
