"""Whether two versions of the online refit give bit-identical models: 40 randomized scenarios
(balance groups of 1-64 GPUs, fixed and ``auto`` topologies, priors with and without an overhead,
speeds, heads, degree efficiencies, segments, route and sequence terms; forgetting 0.005-1,
warm-up and refit intervals of 1-2; slow and fast ranks, untimed GPUs, idle steps), 5-80 steps
each, 1,325 in all. Every step's plan terms, prediction, model, speeds and flags are recorded with
``save`` at one version and compared, by ``repr``, with ``check`` at the other::

    git worktree add /tmp/old 989084f
    PYTHONPATH=/tmp/old .venv/bin/python docs/bench/refit46/scale/same_models.py save /tmp/refit.pkl
    PYTHONPATH=. .venv/bin/python docs/bench/refit46/scale/same_models.py check /tmp/refit.pkl
"""

from __future__ import annotations

import dataclasses
import pickle
import random
import sys

from deepspeed_knap.cost.model import CostModel, segment_square_sums
from deepspeed_knap.cost.online import OnlineCostModel, OnlineSettings, plan_terms
from deepspeed_knap.planner import build_topology, plan_loads, plan_routing
from deepspeed_knap.planner.route import moved_tokens


def scenarios() -> list[tuple]:
    """``(seed, GPUs, topology, prior, settings, true speeds)`` of each scenario."""
    out = []
    for seed in range(40):
        rng = random.Random(seed)
        gpus = rng.choice([1, 2, 2, 3, 4, 8, 8, 16, 64])
        halves = [f"g{gpus // 2}n2"] if gpus % 2 == 0 else []
        topology = rng.choice(["auto", f"g1n{gpus}", *halves])
        prior = CostModel(
            linear_coef=rng.choice([1e-6, 0.0, 3e-6]), quadratic_coef=rng.choice([1e-9, 2e-10]),
            alltoall_coef=rng.choice([0.0, 1e-7]), overhead_s=rng.choice([0.0, 0.02]),
            num_heads=rng.choice([None, 24, 5, 7]), degree_efficiency=rng.choice([None, ((2, 0.9), (4, 0.8))]),
            sequence_coef=rng.choice([0.0, 1e-4]), segment_attention_share=rng.choice([0.0, 0.3]),
            route_coef=rng.choice([0.0, 1e-8]),
            gpu_speed=rng.choice([None, tuple(rng.choice([1.0, 0.5]) for _ in range(gpus))]),
        )  # fmt: skip
        settings = OnlineSettings(forgetting=rng.choice([0.9, 1.0, 0.5, 0.005]), warmup_steps=rng.choice([1, 2]),
                                  refit_interval=rng.choice([1, 2]), fit_route=rng.choice([True, False]))  # fmt: skip
        out.append((seed, gpus, topology, prior, settings, [rng.choice([1.0, 1.0, 0.5, 2.0]) for _ in range(gpus)]))
    return out


def run() -> list[tuple]:
    """Every step's record, scenario by scenario."""
    results = []
    for seed, gpus, topology, prior, settings, truth_speed in scenarios():
        rng = random.Random(1000 + seed)
        bags, online = build_topology(topology, gpus), OnlineCostModel(prior, gpus, settings)
        use_segments = rng.random() < 0.4
        for step in range(rng.choice([5, 30, 80])):
            lens = [[rng.choice([64, 256, 1024, 3000, 5]) for _ in range(rng.randint(0 if step % 7 == 3 else 1, 4))]
                    for _ in range(gpus)]  # fmt: skip
            segments = None
            if use_segments:
                segments = [[[k, n - k] for n in rank for k in [rng.randint(0, n)]] for rank in lens]
            model = online.model()
            plan = plan_routing(lens, bags, model, "refine", seq_segments_per_rank=segments)
            loads = plan_loads(plan, dataclasses.replace(model, gpu_speed=None, alltoall_coef=0.0), segments)
            compute = [round(1e6 * load / speed * (1 + 0.05 * rng.gauss(0, 1))) if rng.random() > 0.05 else -1
                       for load, speed in zip(loads.tolist(), truth_speed, strict=True)]  # fmt: skip
            exchange = [rng.randint(-1, 5000) for _ in range(gpus)]
            route = [rng.randint(-1, 3000) for _ in range(gpus)] if rng.random() < 0.8 else None
            squares = None
            if segments is not None:
                squares = segment_square_sums([row for rows in segments for row in rows]).tolist()
            terms = tuple([float(v) for v in values] for values in plan_terms(plan, online.current, squares))
            predicted = online.observe(plan, compute, exchange, squares, route, moved_tokens(plan) if route else None)
            results.append((seed, step, terms, predicted, online.current, list(online.speeds), online.compute_fitted,
                            online.route_fitted, online.predicted_s(plan, squares)))  # fmt: skip
    return results


def main() -> None:
    action, path = sys.argv[1], sys.argv[2]
    results = run()
    if action == "save":
        with open(path, "wb") as file:
            pickle.dump(results, file)
        print(f"saved {len(results)} steps")
        return
    with open(path, "rb") as file:
        reference = pickle.load(file)
    differences = sum(repr(a) != repr(b) for a, b in zip(reference, results, strict=True))
    print(f"compared {len(results)} steps: {differences} differ")


if __name__ == "__main__":
    main()
