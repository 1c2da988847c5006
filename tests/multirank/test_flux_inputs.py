"""FLUX.1 and FLUX.2 on 2 gloo ranks: a sample one rank cannot pack is one error on every rank,
naming that rank and the sample, raised by the step's first collective (raised on that rank alone,
the other would wait in that collective), and the next step runs."""

from __future__ import annotations

import pytest

from tests.support.distributed import run_distributed

RANK_SHAPES = [[(1, 3, 4, 5), (1, 2, 2, 0)], [(1, 5, 5, 3)]]


def _worker(rank: int, world: int) -> dict:
    import torch

    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from deepspeed_knap.runtime.groups import create_process_groups
    from tests.support.balancing import join_gloo
    from tests.support.flux_cases import CONFIGS, packed_class, random_samples

    join_gloo(rank)
    topology = build_topology("g1n2", world)
    groups = create_process_groups(topology)
    results = {}
    for family in ("flux", "flux2"):
        model = packed_class(family)(**CONFIGS[family])
        balancer = KnapBalancer(groups, CostModel(1.0, 0.01, 0.0))
        samples = random_samples(family, RANK_SHAPES[rank], 10 + rank, torch.float32)
        if rank == 1:
            samples[0] = {**samples[0], "hidden_states": samples[0]["hidden_states"][:, :5]}
        try:
            model.forward_samples(samples, balancer)
            results[family] = "no error"
        except ValueError as error:
            results[family] = str(error)
        good = random_samples(family, RANK_SHAPES[rank], 10 + rank, torch.float32)
        results[f"{family} after"] = [tuple(out.shape) for out in model.forward_samples(good, balancer)]
    return results


@pytest.mark.multirank
def test_a_sample_one_rank_cannot_pack_is_one_error_on_every_rank():
    results = run_distributed(_worker, 2, timeout=120)
    for family in ("flux", "flux2"):
        message = results[0][family]
        assert "rank(s) [1]" in message and "sample 0: 'hidden_states' has shape [" in message, message
        assert results[1][family] == message, "every rank must raise the same message"
        for rank, result in enumerate(results):
            assert len(result[f"{family} after"]) == len(RANK_SHAPES[rank]), (family, rank)
