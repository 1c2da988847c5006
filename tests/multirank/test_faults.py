"""A rank stuck inside a Ulysses bag: its partners fail within timeout_s, naming the step."""

import time

import pytest

from tests.support.distributed import DistributedTestError, run_distributed

TIMEOUT_S = 4


def _stuck_rank_worker(rank: int, world: int) -> None:
    import datetime

    import deepspeed.comm as dist

    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.models.tiny_dit import random_batch
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.attention import KnapDistributedAttention
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from deepspeed_knap.runtime.groups import create_process_groups

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    groups = create_process_groups(build_topology("g2n1", world), datetime.timedelta(seconds=TIMEOUT_S))
    balancer = KnapBalancer(groups, CostModel(1.0, 0.05))  # free all-to-all: both ranks share the bag
    attention = KnapDistributedAttention(2, backend="sdpa")

    def blocks(routed):
        assert routed.plan.seq_group_size.max() == 2, "the step must use the bag"
        if rank == 1:
            time.sleep(120)  # stuck inside the bag, before its Ulysses all-to-all
        q = routed.batch.tokens.view(-1, 2, 4)
        return attention(q, q, q, routed).reshape(-1, 8)

    batch = random_batch([[200], [10]][rank], rank, 8, 5)  # one long sequence: it goes to the pair
    balancer.forward(batch, blocks)


def test_a_rank_stuck_inside_a_bag_fails_its_partner_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as error:
        run_distributed(_stuck_rank_worker, 2, timeout=100)
    elapsed = time.monotonic() - start
    message = str(error.value)
    assert "rank 0 of 2 raised" in message and "knapformer step 1 failed on rank 0" in message
    assert elapsed < 90  # start-up of two ranks on 2 busy cores (up to a minute), then the 4 s timeout; not 100 s


def _unreadable_config_worker(rank: int, world: int) -> str:
    """A checkpoint's family read on every rank, where rank 1 cannot read the file (a node whose copy
    has other permissions): the ranks' agreement raises it on both."""
    from deepspeed_knap.models.loading import checked
    from tests.support.balancing import join_gloo

    join_gloo(rank)

    def read() -> str:
        if rank == 1:
            raise PermissionError(13, "Permission denied", "/ckpt/config.json")
        return "flux"

    try:
        checked({}, "reading a checkpoint's model family", read)
    except ValueError as error:
        return str(error)
    return "no error"


def test_an_unreadable_checkpoint_file_on_one_rank_is_one_error_on_every_rank():
    """Only FileNotFoundError of the OSErrors was agreed on: a PermissionError left rank 1 raising
    alone while rank 0 waited in the agreement."""
    first, second = run_distributed(_unreadable_config_worker, 2, timeout=60)
    assert first == second and "rank(s) [1]: PermissionError: [Errno 13] Permission denied" in first, first
