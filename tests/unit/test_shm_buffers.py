"""DeepSpeed's CPU all-reduce buffers in /dev/shm: what a killed job leaves is found and removed, and
nothing that a running job maps is touched. A full /dev/shm makes DeepSpeed's CPU start-up die with
SIGSEGV, which failed every multi-rank test of a CI run."""

import mmap
import os
import time
from pathlib import Path

import pytest

from deepspeed_knap.runtime.shm_buffers import SHM_DIR, job_buffers, remove_job_buffers, remove_orphaned_buffers
from tests.support.distributed import DistributedTestError, deepspeed_cpu_comm_builder, run_distributed


def _buffer(port: int, rank: int, age_s: float = 3600.0) -> Path:
    path = SHM_DIR / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    written = time.time() - age_s
    os.utime(path, (written, written))
    return path


def test_orphaned_buffers_go_and_those_in_use_or_new_stay():
    orphan, mapped, held_open, new = _buffer(1, 0), _buffer(2, 0), _buffer(2, 1), _buffer(4, 0, age_s=60)
    other_job = None
    try:
        with open(mapped, "r+b") as file, mmap.mmap(file.fileno(), mmap.PAGESIZE), open(held_open, "rb"):
            removed = remove_orphaned_buffers()
            assert orphan.name in removed and not orphan.exists()  # (a killed run's too, if any)
            # A live job's mapped file; one being created (open, not mapped yet); one written a
            # minute ago (a job starting in another PID namespace is not seen here).
            assert mapped.exists() and held_open.exists() and new.exists()
            assert {mapped.name, held_open.name, new.name}.isdisjoint(removed)
        other_job = _buffer(3, 1)
        assert remove_job_buffers(3) == [other_job.name] and not other_job.exists()
        assert mapped.exists()  # another port's
    finally:
        for path in (orphan, mapped, held_open, new, other_job):
            if path is not None:
                path.unlink(missing_ok=True)


def _init_then_crash(rank: int, world: int, port_file: str) -> None:
    import deepspeed.comm as dist

    from deepspeed_knap.runtime.shm_buffers import own_shm_buffer

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    if rank == 0:  # this job's buffers, by port: a parallel test's jobs make their own meanwhile
        Path(f"{port_file}.part").write_text(f"{os.environ['MASTER_PORT']} {own_shm_buffer(0).exists()}")
        Path(f"{port_file}.part").rename(port_file)
    if rank == 1:
        while not Path(port_file).exists():  # rank 0 has looked: its run ends when this rank dies
            time.sleep(0.01)
        os._exit(3)  # killed before it could unlink its buffer
    dist.barrier()


@pytest.mark.multirank
def test_a_run_whose_rank_dies_leaves_no_buffer(tmp_path):
    if deepspeed_cpu_comm_builder() is None:
        pytest.skip("DeepSpeed makes no /dev/shm buffers on this accelerator")
    port_file = tmp_path / "port"
    with pytest.raises(DistributedTestError) as error:  # rank 1 died, or rank 0 saw its peer go
        run_distributed(_init_then_crash, world_size=2, args=(str(port_file),), timeout=60)
    assert port_file.exists(), f"rank 0 failed before it could look: {error.value}"
    port, made = port_file.read_text().split()
    assert made == "True"  # DeepSpeed made the job's buffers: there was something to leave
    assert job_buffers(port) == []
