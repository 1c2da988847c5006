"""Set-up shared by the model tests that run balanced on gloo ranks (FLUX, FLUX.3, Wan)."""

import select

import deepspeed.comm as dist

from deepspeed_knap.planner.worker import PlanWorker
from deepspeed_knap.runtime.balancer import KnapBalancer
from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer


class RecordingBalancer(KnapBalancer):
    """A balancer that keeps every plan it makes (``plans``), so a test can check the groups it ran."""

    def plan(self, batch):
        self.plans = [*getattr(self, "plans", []), super().plan(batch)]
        return self.plans[-1]


def join_gloo(rank: int) -> None:
    """Join the gloo group :func:`~tests.support.distributed.run_distributed` set up, then drop this
    rank's DeepSpeed CPU all-reduce buffer once every rank has mapped theirs (DeepSpeed leaves it in
    /dev/shm)."""
    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    dist.barrier()
    unlink_own_shm_buffer(rank)


def wait_for_plan_worker(worker: PlanWorker) -> None:
    """Wait until a plan worker (``balancer._worker``) has a reply for its oldest job in its pipe: a
    worker's first plan is not waited for while it starts (the step is planned in the step then), so
    a test that means to use a plan made ahead waits here instead of racing the worker's start-up."""
    if worker._process is not None and worker._unread:
        assert select.select([worker._process.stdout], [], [], 60)[0], "the plan worker did not reply within 60 s"
