"""Packed FLUX.3 on 2 gloo ranks: what the balancer gathers of its samples.

* The step is planned with the samples' attention segments (gathered with the lengths): the plan
  equals the planner's on every rank's segments, which differs from the plan on lengths alone on
  these shapes; with :meth:`KnapBalancer.prefetch` too.
* A bad sample on one rank (a reference without its ids; a text of zero tokens on one rank and
  ids of the wrong width on the other) raises on every rank, the same message naming each rank and
  its sample, in the step's first collective; the next step then runs (no rank was left waiting).

All cases run in one spawn.
"""

from __future__ import annotations

import pytest

from tests.support.distributed import run_distributed

# Per rank: (height, width, text tokens, references). Segments [2, 8, 5] | [2, 8, 0], [1, 16, 0]: with
# the per-mode blocks priced by mode the 15-token edit costs less than its length says, and the plan
# keeps every sample home; priced as one segment, the 10-token sample goes on both GPUs.
RANK_SHAPES = [[(4, 2, 2, ((3, 1), (1, 2)))], [(2, 4, 2, ()), (4, 4, 1, ())]]
COST_MODEL = dict(linear_coef=1.0, quadratic_coef=0.05, alltoall_coef=0.5, segment_attention_share=0.5)


def _worker(rank: int, world: int) -> dict:
    import warnings

    import torch

    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.models.flux3 import PackedFlux3Transformer
    from deepspeed_knap.planner.solve import plan_routing
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.groups import create_process_groups
    from tests.support.balancing import RecordingBalancer, join_gloo, wait_for_plan_worker
    from tests.support.flux3_cases import random_samples, reference_model

    warnings.filterwarnings("ignore", category=UserWarning)
    join_gloo(rank)
    topology = build_topology("auto", world, max_degree=world)
    groups = create_process_groups(topology)
    cost_model = CostModel(**COST_MODEL)
    model = PackedFlux3Transformer.from_diffusers(reference_model("flux3", torch.float64), attention_backend="sdpa",
                                                  topology=topology)  # fmt: skip
    samples = random_samples("flux3", RANK_SHAPES[rank], 10 + rank, torch.float64)
    segments = [[[t, h * w, sum(a * b for a, b in refs)] for h, w, t, refs in shapes] for shapes in RANK_SHAPES]
    lengths = [[sum(row) for row in rows] for rows in segments]
    results = {
        "by_segment": plan_routing(lengths, topology, cost_model, seq_segments_per_rank=segments),
        "by_length": plan_routing(lengths, topology, cost_model),
    }

    balancer = RecordingBalancer(groups, cost_model)
    model.forward_samples(samples, balancer)
    results["planned"] = balancer.plans[-1]
    results["imbalance_after"] = balancer.metrics()["knapformer/imbalance_after"]

    inputs = model.pack(samples)
    balancer.prefetch(inputs.seq_lens, "cpu", next_segments=inputs.segments)
    wait_for_plan_worker(balancer._worker)
    model(inputs, balancer)
    results["prefetched"] = balancer.plans[-1]
    results["planned_ahead"] = balancer.metrics()["knapformer/planned_ahead"]

    def without(sample, key):
        return {k: v for k, v in sample.items() if k != key}

    # Rank 1 gives an edit whose reference comes without its ids, then ids of the wrong width; rank 0
    # its good samples, then a text of zero tokens.
    edit = random_samples("flux3", [(2, 4, 2, ((1, 1),))], 3, torch.float64)[0]
    if rank == 0:
        empty_text = {"encoder_hidden_states": torch.zeros(0, 12, dtype=torch.float64), "txt_ids": torch.zeros(0, 4)}
        bad_cases = {"reference without ids": samples, "empty text and narrow ids": [{**samples[0], **empty_text}]}
    else:
        bad_cases = {
            "reference without ids": [samples[0], without(edit, "image_cond_ids")],
            "empty text and narrow ids": [samples[0], {**samples[1], "img_ids": samples[1]["img_ids"][:, :3]}],
        }
    results["errors"] = {}
    for case, rank_samples in bad_cases.items():
        try:
            model.forward_samples(rank_samples, balancer)
            results["errors"][case] = None
        except ValueError as error:
            results["errors"][case] = str(error)
    out = model.forward_samples(samples, balancer)  # a good step after the errors: no rank was left behind
    results["after_errors"] = [tuple(o.shape) for o in out]
    return results


@pytest.mark.multirank
def test_flux3_steps_are_planned_by_segment_and_bad_samples_raise_on_every_rank():
    results = run_distributed(_worker, 2, timeout=240)
    for rank, result in enumerate(results):
        by_segment, by_length = result["by_segment"], result["by_length"]
        assert by_segment.seq_group_size.tolist() != by_length.seq_group_size.tolist()  # the shapes matter
        assert result["planned"] == by_segment, rank
        assert result["prefetched"] == by_segment and result["planned_ahead"] == 1.0, rank
        assert result["imbalance_after"] == by_segment.imbalance
        errors = result["errors"]
        assert errors == results[0]["errors"], "every rank must raise the same message"
        assert errors["reference without ids"] == (
            "invalid input, so no rank runs this step: balance-group rank(s) [1]: sample 1 has "
            "image_cond_hidden_states without image_cond_ids: reference latents and their position ids come "
            "together (diffusers' ids put reference image i at (0, h / 2, w / 2, -1 - i))"
        )
        message = errors["empty text and narrow ids"]
        assert "balance-group rank(s) [0]: sample 0 has a text of zero tokens" in message
        assert "balance-group rank(s) [1]: sample 1: 'img_ids' has shape [16, 3]; expected [16, 4]" in message
        assert result["after_errors"] == [(h * w, 8) for h, w, _, _ in RANK_SHAPES[rank]]
