"""The online refit's speed test on synthetic steps (issue 46): false calls where one rank always
holds the short sequences, and calls of a 2x slower rank, open and closed loop. Run from the
repository root, at any commit (the output of two commits compared in speed_test.txt):

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python docs/bench/refit46/free_overhead/speed_test.py
"""

import dataclasses

import numpy as np

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.cost.online import OnlineCostModel, OnlineSettings
from deepspeed_knap.planner import plan_routing
from deepspeed_knap.planner.topology import build_topology
from tests.unit.test_online import measure, noisy, scaled_mix

TRUTH = CostModel(2e-5, 3e-9)


def split_refits(prior, speeds, seeds=20, steps=30, overhead_s=0.02):
    """Every sequence home, GPU 1 holding one 3-5k sequence, GPU 0 three of 0.3-0.8k, 5% noise:
    each refit's speeds."""
    found = []
    for seed in range(seeds):
        rng, spoil = np.random.default_rng(seed), noisy(seed)
        online = OnlineCostModel(prior, 2, OnlineSettings())
        for step in range(steps):
            lengths = [rng.integers(300, 800, size=3).tolist(), [int(rng.integers(3000, 5000))]]
            plan = plan_routing(lengths, build_topology("g1n2"), online.model(), "none")
            online.observe(plan, spoil(step, measure(plan, TRUTH, speeds, overhead_s=overhead_s)), [0, 0])
            found += [online.model().gpu_speed] if online.compute_fitted else []
    return found


def balanced_speeds(steps, speeds, spread, seed, mix="kf_mixed_res", overhead_s=0.01, prior=None):
    """auto's plans on 2 GPUs, the model refit every step: the speeds after each step."""
    online = OnlineCostModel(prior or CostModel(1e-5, 1e-8), 2, OnlineSettings())
    topology, spoil, found = build_topology("auto", 2), noisy(seed, spread), []
    for step in range(steps):
        plan = plan_routing(scaled_mix(mix, 2, step + 100 * seed), topology, online.model())
        online.observe(plan, spoil(step, measure(plan, TRUTH, speeds, overhead_s=overhead_s)), [0] * 2)
        found.append(online.model().gpu_speed)
    return found


print("Every sequence home, GPU 1 the long ones, true overhead 20 ms, 5% noise, 20 seeds x 30 steps:")
for name, prior in (("prior without an overhead", TRUTH), ("prior with half of it", dataclasses.replace(TRUTH, overhead_s=0.01)),
                    ("prior with all of it", dataclasses.replace(TRUTH, overhead_s=0.02))):  # fmt: skip
    equal = split_refits(prior, (1.0, 1.0))
    slow = split_refits(prior, (1.0, 0.5))
    print(f"  {name:26s} equal GPUs called unequal in {sum(s != (1.0, 1.0) for s in equal)} of {len(equal)} refits; "
          f"GPU 1 at 0.5 called in {sum(s[1] < 0.75 and s[0] == 1.0 for s in slow)}, "
          f"GPU 0 at 0.5 (short ones) in {sum(s[0] < 0.75 for s in split_refits(prior, (0.5, 1.0)))}")  # fmt: skip
print("auto's plans on 2 GPUs, kf_mixed_res x1/4, a prior off by 2x and 3x, 10 ms overhead:")
for spread in (0.05, 0.1, 0.2):
    after2 = sum(balanced_speeds(2, (1.0, 0.5), spread, s)[-1][1] < 0.75 for s in range(40))
    after3 = sum(balanced_speeds(3, (1.0, 0.5), spread, s)[-1][1] < 0.75 for s in range(40))
    equal = [v for s in range(100) for speeds in balanced_speeds(20, (1.0, 1.0), spread, s) for v in speeds]
    print(f"  {spread:.0%} noise: a 2x slower GPU called after 2 measured steps in {after2} of 40 seeds, after 3 in "
          f"{after3}; equal GPUs called unequal in {sum(v != 1.0 for v in equal)} of {len(equal)} decisions")  # fmt: skip
print("auto's plans, 5% noise, true overhead 20 ms, 20 seeds x 16 steps: the step a 2x slower GPU is called (median)")
for mix in ("kf_mixed_res", "kf_image_video", "kf_lowres"):
    for prior in (CostModel(1e-5, 1e-8), CostModel(1e-5, 1.5e-9), CostModel(1e-5, 1.5e-9, overhead_s=0.005)):
        cells = []
        for speeds in ((0.5, 1.0), (1.0, 0.5)):
            slow = speeds.index(0.5)
            steps = [next((i + 1 for i, s in enumerate(balanced_speeds(16, speeds, 0.05, seed, mix, 0.02, prior))
                           if s[slow] < 0.75 and s[1 - slow] == 1.0), 99) for seed in range(20)]  # fmt: skip
            cells.append(f"GPU {slow} at step {sorted(steps)[10]}")
        equal = [s for seed in range(20) for s in balanced_speeds(16, (1.0, 1.0), 0.05, seed, mix, 0.02, prior)[1:]]
        print(
            f"  {mix:15s} prior a={prior.linear_coef:g} b={prior.quadratic_coef:g} o={prior.overhead_s:g}: "
            f"{', '.join(cells)}; equal GPUs called unequal in {sum(s != (1.0, 1.0) for s in equal)} of {len(equal)}"
        )
