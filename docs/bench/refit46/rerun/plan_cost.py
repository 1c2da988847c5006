"""What ``auto``'s plan costs a rank on the host against knapformer's on g1n2, at the kf_mixed_res
x1/4 steps of ``bench train --ranks 2 --family flux`` (steps 1-16): the solve (``plan_routing``, as
the plan worker runs it) and, for ``auto`` (``bench train --online`` refits ``refine`` and ``auto``
only), the online refit's ``observe`` (fed each plan with its modeled seconds, 5% noise and a 20 ms
overhead), medians over 5 passes.

    OMP_NUM_THREADS=1 .venv/bin/python docs/bench/refit46/rerun/plan_cost.py
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from deepspeed_knap.cost.online import OnlineCostModel
from deepspeed_knap.models.registry import default_cost_model, spec
from deepspeed_knap.planner import build_topology, plan_loads, plan_routing
from deepspeed_knap.planner.route import moved_tokens

RANKS, TOKEN_SCALE, STEPS, PASSES = 2, 0.25, range(1, 17), 5


def step_lengths() -> list[list[list[int]]]:
    """``[step][rank]`` the packed sequence lengths ``bench train`` gives each rank."""
    family = spec("flux")
    hooks, model = family.hooks(), family.model_class(**family.tiny_config)
    data = hooks.synthetic_data("kf_mixed_res", model.config, TOKEN_SCALE, 0)
    guidance = 1.0 if model.config.get("guidance_embeds") else None
    steps = []
    for step in STEPS:
        per_rank = []
        for rank in range(RANKS):
            generator = torch.Generator().manual_seed(step * 4099 + rank)
            objective = hooks.objective(data.step_samples(step, rank, RANKS), generator, model.config, guidance)
            inputs, _ = hooks.pack(model, objective.samples, balanced=True)
            per_rank.append([int(length) for length in inputs.seq_lens])
        steps.append(per_rank)
    return steps


def main() -> None:
    steps, prior = step_lengths(), default_cost_model("flux-tiny")
    for topology, solver in (("g1n2", "knapformer"), ("auto", "refine")):
        bags = build_topology(topology, RANKS)
        solves, observes = [], []
        for _ in range(PASSES):
            refit, noise = OnlineCostModel(prior, RANKS), random.Random(0)
            for seq_lens in steps:
                start = time.perf_counter()
                plan = plan_routing(seq_lens, bags, prior, solver)
                solves.append(time.perf_counter() - start)
                measured = [round(1e6 * (0.02 + s * (1 + 0.05 * noise.gauss(0, 1)))) for s in plan_loads(plan, prior)]
                start = time.perf_counter()
                refit.observe(plan, measured, [0] * RANKS, None, [1000] * RANKS, moved_tokens(plan))
                observes.append(time.perf_counter() - start)
        refit_ms = f", the refit's observe {statistics.median(observes) * 1e3:.3f} ms" if topology == "auto" else ""
        print(f"{solver} on {topology}: solve median {statistics.median(solves) * 1e3:.3f} ms{refit_ms}")


if __name__ == "__main__":
    main()
