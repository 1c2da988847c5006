"""The distributed harness runs ranks, and reports a failing or hanging rank instead of hanging."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import DistributedTestError, run_distributed


def _sum_of_ranks(rank: int, world_size: int, scale: int) -> int:
    value = torch.tensor([rank * scale])
    dist.all_reduce(value)
    return int(value.item())


def _rank_two_raises(rank: int, world_size: int) -> None:
    if rank == 2:
        raise ValueError("boom on rank two")
    dist.barrier()  # the healthy ranks wait for rank 2 forever: the harness must not


def _rank_one_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        _sleep_forever()


def _sleep_forever() -> None:
    while True:
        time.sleep(0.1)


def test_all_ranks_run_and_return_results():
    assert run_distributed(_sum_of_ranks, world_size=3, args=(10,)) == [30, 30, 30]


def test_failing_rank_is_reported_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_rank_two_raises, world_size=4, timeout=60)
    message = str(error.value)
    assert "rank 2 of 4 raised" in message
    assert "ValueError: boom on rank two" in message
    assert "_rank_two_raises" in message
    assert time.monotonic() - start < 60, "the failure must be reported before the timeout"


def test_hanging_rank_is_reported_with_its_stack():
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_rank_one_hangs, world_size=2, timeout=3)
    message = str(error.value)
    assert "ranks [1] did not finish within 3s" in message
    assert "_sleep_forever" in message  # faulthandler's dump shows where it hung


@pytest.mark.gpu
def test_gpu_marker_runs_only_with_cuda():
    assert torch.cuda.is_available()
