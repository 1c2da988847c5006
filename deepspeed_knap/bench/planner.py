"""Planner benchmark: plan quality and solve time per workload, topology and solver.

    python -m deepspeed_knap.bench.planner [--steps 20] [--markdown]

Part 1, the 32-GPU table: every bundled workload on g1n32, g2n16, g4n8, g8n4 and the mixed
g1n8+g2n4+g4n2+g8n1, over ``--steps`` sampled steps (seeds 0..steps-1). Reported per solver: median
imbalance (max/mean modeled GPU load), median ratio of the step time to the lower bound, median
speedup of the modeled step over ``none``, median solve time.

Part 2, scale: 1,024 GPUs with 16 sequences each, drawn from the pooled lengths of
``kf_image_video`` (the paper's joint image + video mix), on g1n1024, g8n128 and the four-size mix
g1n512+g2n128+g4n32+g8n16; median and p95 solve time.

Solve times are wall-clock medians of single solves on this machine; quality figures are modeled (the
FLUX.1-dev FLOP model with default throughput and bandwidth).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm import tqdm

from deepspeed_knap.planner import SOLVERS, plan_routing
from deepspeed_knap.topology import build_topology
from deepspeed_knap.workload import default_workload
from deepspeed_knap.workloads import WORKLOADS, sample_workload

TOPOLOGIES_32 = ["g1n32", "g2n16", "g4n8", "g8n4", "g1n8+g2n4+g4n2+g8n1"]


def scale_topologies(num_gpus: int) -> list[str]:
    """Flat, 8-GPU bags, and a four-size mix (half the GPUs alone, the rest in bags of 2, 4, 8)."""
    if num_gpus % 64:
        raise ValueError(f"the scale benchmark needs a multiple of 64 GPUs; got {num_gpus}")
    mixed = f"g1n{num_gpus // 2}+g2n{num_gpus // 8}+g4n{num_gpus // 32}+g8n{num_gpus // 64}"
    return [f"g1n{num_gpus}", f"g8n{num_gpus // 8}", mixed]


def _solve(lengths, topology, workload, solver):
    start = time.perf_counter()
    plan = plan_routing(lengths, topology, workload, solver)
    return plan, (time.perf_counter() - start) * 1e3


def bench_32(steps: int, workload_names: list[str]) -> list[dict]:
    """One row per (workload, topology, solver), medians over ``steps`` sampled steps."""
    model = default_workload()
    rows = []
    cases = [(w, t) for w in workload_names for t in TOPOLOGIES_32]
    for name, spec in tqdm(cases, desc="32-GPU table", unit="case"):
        topology = build_topology(spec, gpus_per_node=8)
        samples = {solver: [] for solver in SOLVERS}
        for seed in range(steps):
            lengths = sample_workload(name, topology.group_size, seed)
            baseline = None
            for solver in SOLVERS:
                plan, ms = _solve(lengths, topology, model, solver)
                baseline = baseline or plan
                samples[solver].append(
                    (plan.imbalance, plan.max_load / plan.lower_bound, baseline.max_load / plan.max_load, ms)
                )
        for solver, values in samples.items():
            imbalance, ratio, speedup, ms = np.median(np.asarray(values), axis=0)
            rows.append({"workload": name, "topology": spec, "solver": solver, "imbalance": imbalance,
                         "ratio_to_bound": ratio, "speedup": speedup, "solve_ms": ms})  # fmt: skip
    return rows


def bench_scale(steps: int, num_gpus: int = 1024, per_rank: int = 16) -> list[dict]:
    """Solve time at ``num_gpus`` GPUs with ``per_rank`` sequences each."""
    model = default_workload()
    pool = np.concatenate([np.asarray(r) for r in sample_workload("kf_image_video", 32, 0) if r])
    rows = []
    for spec in tqdm(scale_topologies(num_gpus), desc=f"{num_gpus}-GPU scale", unit="topology"):
        topology = build_topology(spec, gpus_per_node=8)
        samples = {solver: [] for solver in SOLVERS}
        for seed in range(steps):
            rng = np.random.default_rng(seed)
            lengths = rng.choice(pool, size=(num_gpus, per_rank)).tolist()
            for solver in SOLVERS:
                plan, ms = _solve(lengths, topology, model, solver)
                samples[solver].append((plan.imbalance, plan.max_load / plan.lower_bound, ms))
        for solver, values in samples.items():
            values = np.asarray(values)
            rows.append({"topology": spec, "solver": solver, "imbalance": np.median(values[:, 0]),
                         "ratio_to_bound": np.median(values[:, 1]), "solve_ms": np.median(values[:, 2]),
                         "solve_ms_p95": np.percentile(values[:, 2], 95)})  # fmt: skip
    return rows


def format_32(rows: list[dict]) -> str:
    """Markdown table: a row per workload and topology, the solvers side by side."""
    lines = [
        "| workload | topology | imbalance none / kf / refine | step / bound kf / refine | speedup kf / refine | solve ms kf / refine |",
        "|---|---|---|---|---|---|",
    ]
    by_case: dict[tuple[str, str], dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault((row["workload"], row["topology"]), {})[row["solver"]] = row
    for (name, spec), solvers in by_case.items():
        none, kf, ours = solvers["none"], solvers["knapformer"], solvers["refine"]
        lines.append(
            f"| {name} | {spec} | {none['imbalance']:.3f} / {kf['imbalance']:.3f} / {ours['imbalance']:.3f} "
            f"| {kf['ratio_to_bound']:.4f} / {ours['ratio_to_bound']:.4f} "
            f"| {kf['speedup']:.2f}x / {ours['speedup']:.2f}x | {kf['solve_ms']:.2f} / {ours['solve_ms']:.2f} |"
        )
    return "\n".join(lines)


def format_scale(rows: list[dict]) -> str:
    lines = [
        "| topology | solver | imbalance | step / bound | solve ms median | solve ms p95 |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['topology']} | {row['solver']} | {row['imbalance']:.4f} | {row['ratio_to_bound']:.4f} "
            f"| {row['solve_ms']:.1f} | {row['solve_ms_p95']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="sampled steps per case")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--skip-scale", action="store_true", help="skip the 1,024-GPU solve-time part")
    args = parser.parse_args(argv)
    print(format_32(bench_32(args.steps, args.workloads)))
    if not args.skip_scale:
        print()
        print(format_scale(bench_scale(args.steps)))


if __name__ == "__main__":
    main()
