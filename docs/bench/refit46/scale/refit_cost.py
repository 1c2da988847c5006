"""What the online refit's update costs a rank per step, by balance-group size: ``observe`` (with
the tokens each GPU moved, as the balancer passes them) on ``auto``'s plans of bundled-mix steps,
fed the plans' modeled seconds with 5% seeded noise; the FLUX.1 FLOP model; medians.

Run it at two commits to compare them (a worktree of the older one on ``PYTHONPATH``)::

    git worktree add /tmp/old 989084f
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/old .venv/bin/python docs/bench/refit46/scale/refit_cost.py
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python docs/bench/refit46/scale/refit_cost.py
"""

from __future__ import annotations

import random
import statistics
import time

from deepspeed_knap.cost.online import OnlineCostModel
from deepspeed_knap.models.registry import default_cost_model, sample_mix
from deepspeed_knap.planner import build_topology, plan_loads, plan_routing
from deepspeed_knap.planner.route import moved_tokens

CASES = ((2, "kf_mixed_res"), (8, "kf_mixed_res"), (16, "kf_mixed_res"), (32, "kf_mixed_res"),
         (1024, "kf_lowres"), (1024, "kf_mixed_res"), (1024, "flux_buckets"))  # fmt: skip


def refit_ms(num_gpus: int, mix: str, steps: int, passes: int) -> float:
    """Median milliseconds of one ``observe`` over ``passes`` passes of ``steps`` steps."""
    model = default_cost_model()
    topology = build_topology("auto", num_gpus, min(num_gpus, 8))
    plans = [plan_routing(sample_mix(mix, num_gpus, seed), topology, model) for seed in range(steps)]
    noise = random.Random(0)
    measured = [[round(1e6 * s * (1 + 0.05 * noise.gauss(0, 1))) for s in plan_loads(plan, model)] for plan in plans]
    times = []
    for _ in range(passes):
        refit = OnlineCostModel(model, num_gpus)
        for plan, compute_us in zip(plans, measured, strict=True):
            start = time.perf_counter()
            refit.observe(plan, compute_us, [0] * num_gpus, None, [1000] * num_gpus, moved_tokens(plan))
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    for num_gpus, mix in CASES:
        steps, passes = (8, 2) if num_gpus > 100 else (20, 25)
        print(f"{num_gpus:5d} GPUs {mix:13s} refit {refit_ms(num_gpus, mix, steps, passes):7.3f} ms (median)")


if __name__ == "__main__":
    main()
