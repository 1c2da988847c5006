"""Packed Qwen-Image balanced on 4 gloo ranks against the same model unbalanced.

Topology ``auto`` with a priced all-to-all plans each sequence on a group of its own size; on these
lengths one step mixes groups of 1, 2 and 4, and samples with reference images are split over
groups of 2 and 4 (chunk boundaries inside the target and inside the references, so a GPU holds
target and reference tokens of one sample, modulated by different rows under ``zero_cond_t``). A
rank holds no sample. All cases run in one spawn (spawning ranks costs most of the time): 6 heads
(groups of 4 split them 2, 2, 1, 1) with the text routed raw, the same with ``zero_cond_t``
(Edit-2511), and 4 heads with the text routed embedded.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed

# Per rank: (img_shapes, text rows). Sequences (text + target + references) 5 + 64 + 27 = 96 and
# 2 + 4 = 6 | none | 4 + 16 + 12 = 32, 2 + 6 + 4 = 12, 2 + 2 = 4 | 4 + 12 + 2 + 2 = 20: the 96-token
# sample goes on 4 GPUs (chunks of 24: cuts inside its target, and between target and reference),
# the 32-token one on 2 (a cut inside its target), the rest alone.
RANK_SHAPES = [
    [(((1, 8, 8), (1, 3, 9)), 5), (((1, 2, 2),), 2)],
    [],
    [(((1, 4, 4), (1, 3, 4)), 4), (((1, 2, 3), (1, 2, 2)), 2), (((1, 1, 2),), 2)],
    [(((1, 3, 4), (1, 1, 2), (1, 1, 2)), 4)],
]  # fmt: skip
COST_MODEL = dict(linear_coef=1.0, quadratic_coef=0.05, alltoall_coef=0.5)
CASES = ("qwen_image", "qwen_image_zero_cond", "qwen_image_wide_text")


def _worker(rank: int, world: int) -> dict:
    import dataclasses
    import warnings

    import deepspeed.comm as dist

    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.groups import create_process_groups
    from tests.support.balancing import RecordingBalancer, join_gloo
    from tests.support.qwenimage_cases import INPUTS, diffusers_output, random_samples, reference_model, relative_error

    warnings.filterwarnings("ignore", category=UserWarning)
    join_gloo(rank)
    topology = build_topology("auto", world, max_degree=world)
    groups = create_process_groups(topology)
    results = {}
    for case in CASES:
        ref = reference_model(case, torch.float64)
        runs = []
        for balancer in (None, RecordingBalancer(groups, CostModel(**COST_MODEL), solver="refine")):
            model = PackedQwenImageTransformer.from_diffusers(ref, attention_backend="sdpa", topology=topology)
            samples = random_samples(case, RANK_SHAPES[rank], 10 + rank, torch.float64, requires_grad=True)
            inputs = model.pack(samples)
            if not samples:  # ranks must agree on which routed inputs need a gradient, even one with none
                inputs = dataclasses.replace(
                    inputs, **{k: getattr(inputs, k).detach().requires_grad_() for k in INPUTS}
                )
            out = model(inputs, balancer)  # [Tg, C]; the empty rank still backpropagates its [0, C]
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(20 + rank), dtype=out.dtype)
            (out * weights).sum().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            for grad in grads.values():
                dist.all_reduce(grad)
            input_grads = [s[k].grad for s in samples for k in INPUTS]
            runs.append((inputs.split(out.detach()), grads, input_grads, samples, balancer))
        (plain, plain_grads, plain_inputs, samples, _), (balanced, grads, input_grads, _, balancer) = runs

        def worst(pairs) -> float:
            return max((relative_error(a, b) for a, b in pairs), default=0.0)

        plan = balancer.plans[0]
        has_refs = [len(shapes) > 1 for per_rank in RANK_SHAPES for shapes, _ in per_rank]  # by sequence id
        ref_groups = [int(size) for size, refs in zip(plan.seq_group_size, has_refs, strict=True) if refs]
        results[case] = {
            "grad_names": sorted(grads) == sorted(plain_grads),
            "out_err": worst(zip(balanced, plain, strict=True)),
            "grad_err": worst((grads[name], plain_grads[name]) for name in grads),
            "input_grad_err": worst(zip(input_grads, plain_inputs, strict=True)),
            "diffusers_err": worst(zip(balanced, [diffusers_output(ref, s) for s in samples], strict=True)),
            "group_sizes": sorted(set(plan.seq_group_size.tolist())),
            "reference_group_sizes": ref_groups,
        }
    return results


@pytest.mark.multirank
def test_balanced_auto_plans_splitting_samples_with_references_equal_the_unbalanced_model():
    """Outputs per rank, input gradients per sample and rank-summed parameter gradients of the
    balanced model equal the unbalanced one at fp64 (1e-10), on a plan that mixes groups of 1, 2 and
    4 GPUs and splits samples with references over 2 and 4 GPUs; the balanced outputs also equal
    diffusers' on each sample alone."""
    results = run_distributed(_worker, 4, timeout=300)
    for case in CASES:
        assert results[0][case]["group_sizes"] == [1, 2, 4], "the plan must mix degrees 1, 2 and 4 in one step"
        assert {2, 4} <= set(results[0][case]["reference_group_sizes"]), results[0][case]
    for rank, result in enumerate(results):
        for case, measured in result.items():
            assert measured["grad_names"], (rank, case)
            for key in ("out_err", "grad_err", "input_grad_err", "diffusers_err"):
                assert measured[key] <= 1e-10, (rank, case, key, measured)
