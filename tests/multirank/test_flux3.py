"""Packed FLUX.3 balanced on 4 gloo ranks against the same model unbalanced.

Topology ``auto`` with a priced all-to-all plans each sequence on a group of its own size; on these
lengths one step mixes groups of 1, 2 and 4, and samples with reference images are split over
groups of 2 and 4, so the per-mode blocks attend by segment across the Ulysses all-to-all (a mode's
tokens on several GPUs, chunk boundaries inside a mode). A rank holds no sample. All cases run in one
spawn (spawning ranks costs most of the time): 6 heads (groups of 4 split them 2, 2, 1, 1) with the
text routed raw, a flow map, and references narrower than the latents with the text routed embedded.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed

# Per rank: (height, width, text tokens, references). Sequences (text + image + references)
# 5 + 64 + 27 = 96 and 2 + 4 = 6 | none | 4 + 16 + 12 = 32, 2 + 6 + 4 = 12, 2 + 2 = 4 | 4 + 12 + 4 = 20:
# the 96-token sample goes on 4 GPUs (chunks of 24: cuts inside its image and its references), the
# 32-token one on 2 (a cut inside its image), the rest alone.
RANK_SHAPES = [
    [(8, 8, 5, ((3, 9),)), (2, 2, 2, ())],
    [],
    [(4, 4, 4, ((3, 4),)), (2, 3, 2, ((2, 2),)), (1, 2, 2, ())],
    [(3, 4, 4, ((1, 2), (1, 2)))],
]  # fmt: skip
# A plan no solver makes: sample 0 (1 text, 1 image, 1 reference token) on all 4 GPUs, so GPU 3 holds an
# empty chunk of it yet runs its attention by segment; the others alone at home.
EDGE_SHAPES = [[(1, 1, 1, ((1, 1),))], [], [(2, 2, 2, ())], [(2, 2, 3, ((1, 2),))]]
COST_MODEL = dict(linear_coef=1.0, quadratic_coef=0.05, alltoall_coef=0.5)
CASES = ("flux3", "flux3_flow_map", "flux3_narrow_refs")
INPUTS = ("hidden_states", "encoder_hidden_states", "image_cond_hidden_states")


def _worker(rank: int, world: int) -> dict:
    import dataclasses
    import warnings

    import deepspeed.comm as dist
    import numpy as np

    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.models.flux3 import PackedFlux3Transformer
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from deepspeed_knap.runtime.groups import create_process_groups
    from tests.support.flux3_cases import diffusers_output, random_samples, reference_model, relative_error

    warnings.filterwarnings("ignore", category=UserWarning)  # diffusers' fp32 q/k norm on an fp64 model

    from tests.support.balancing import RecordingBalancer, join_gloo

    join_gloo(rank)
    topology = build_topology("auto", world, max_degree=world)
    groups = create_process_groups(topology)

    class EdgePlan(KnapBalancer):
        def plan(self, batch):
            from deepspeed_knap.planner.problem import Problem

            lens = [[sum(h * w for h, w in refs) + h * w + t for h, w, t, refs in shapes] for shapes in EDGE_SHAPES]
            problem = Problem.build(lens, topology, self.cost_model, None)
            self.plans = [problem.make_plan("edge", np.array([0, 2, 3]), np.array([4, 1, 1]))]
            return self.plans[0]

    results = {}
    for case in (*CASES, "edge"):
        config, shapes = (case, RANK_SHAPES) if case != "edge" else ("flux3", EDGE_SHAPES)
        ref = reference_model(config, torch.float64)
        runs = []
        chosen = (EdgePlan if case == "edge" else RecordingBalancer)(groups, CostModel(**COST_MODEL), solver="refine")
        for balancer in (None, chosen):
            model = PackedFlux3Transformer.from_diffusers(ref, attention_backend="sdpa", topology=topology)
            samples = random_samples(config, shapes[rank], 10 + rank, torch.float64, requires_grad=True)
            inputs = model.pack(samples)
            if not samples:  # ranks must agree on which routed inputs need a gradient, even one with none
                inputs = dataclasses.replace(
                    inputs, **{k: getattr(inputs, k).detach().requires_grad_() for k in INPUTS}
                )
            out = model(inputs, balancer)  # [Ti, C]; the empty rank still backpropagates its [0, C]
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(20 + rank), dtype=out.dtype)
            (out * weights).sum().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            for grad in grads.values():
                dist.all_reduce(grad)
            input_grads = [s[k].grad for s in samples for k in INPUTS if k in s]
            runs.append((inputs.split(out.detach()), grads, input_grads, samples, balancer))
        (plain, plain_grads, plain_inputs, samples, _), (balanced, grads, input_grads, _, balancer) = runs

        def worst(pairs) -> float:
            return max((relative_error(a, b) for a, b in pairs), default=0.0)

        plan = balancer.plans[0]
        has_refs = [bool(shape[3]) for per_rank in shapes for shape in per_rank]  # by sequence id
        ref_groups = [int(size) for size, refs in zip(plan.seq_group_size, has_refs, strict=True) if refs]
        results[case] = {
            "out_err": worst(zip(balanced, plain, strict=True)),
            "grad_err": worst((grads[name], plain_grads[name]) for name in grads),
            "input_grad_err": worst(zip(input_grads, plain_inputs, strict=True)),
            "diffusers_err": worst(zip(balanced, [diffusers_output(ref, s) for s in samples], strict=True)),
            "group_sizes": sorted(set(plan.seq_group_size.tolist())),
            "reference_group_sizes": ref_groups,
            "chunks": plan.chunk_len.tolist(),
        }
    return results


@pytest.mark.multirank
def test_balanced_auto_plans_splitting_samples_with_references_equal_the_unbalanced_model():
    """Outputs per rank, input gradients per sample and rank-summed parameter gradients of the balanced
    model equal the unbalanced one at fp64 (1e-10), on a plan that mixes groups of 1, 2 and 4 GPUs and
    splits samples with references over 2 and 4 GPUs; the balanced outputs also equal diffusers'. Also
    on a hand-made plan where a GPU runs attention by segment over a sample it holds no token of."""
    results = run_distributed(_worker, 4, timeout=300)
    for case in CASES:
        assert results[0][case]["group_sizes"] == [1, 2, 4], "the plan must mix degrees 1, 2 and 4 in one step"
        assert {2, 4} <= set(results[0][case]["reference_group_sizes"]), results[0][case]
    assert results[0]["edge"]["chunks"][:4] == [1, 1, 1, 0], "GPU 3 must hold an empty chunk of sample 0"
    for rank, result in enumerate(results):
        for case, measured in result.items():
            for key in ("out_err", "grad_err", "input_grad_err", "diffusers_err"):
                assert measured[key] <= 1e-10, (rank, case, key, measured)
