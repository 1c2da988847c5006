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
