"""Planner benchmark suite: plan quality, modeled speedup and solve time over balance-group sizes,
mixes, topologies and solvers.

    deepspeed-knap bench planner [--gpus 32 256 1024] [--steps 20] [--csv OUT.csv] [--plot-dir DIR]
                                 [--sensitivity 0.2]

For every GPU count ``N`` (a multiple of 32), bundled mix and topology (``g1nN``, ``g2n{N/2}``,
``g4n{N/4}``, ``g8n{N/8}``, the mix ``g1n{N/4}+g2n{N/8}+g4n{N/16}+g8n{N/32}`` with a quarter of the
GPUs in bags of each size, and ``auto`` with groups of 1 to 8 inside nodes of 8), the steps of seeds
``0 .. steps-1`` are solved by every solver (``knapformer`` needs fixed bags: not on ``auto``). Per
(``N``, mix, topology, solver), over the steps:

* imbalance: max / mean modeled GPU load, median and p95;
* step / bound: modeled step time over the lower bound, median;
* speedup: modeled step time of ``none`` over the solver's on the same step, median;
* moved: fraction of tokens leaving their home GPU, median;
* solve ms: wall-clock of one solve on this machine, median and p95.
* refit ms (``refine`` on ``auto``): wall-clock of the online refit's update by that step
  (:meth:`~deepspeed_knap.cost.online.OnlineCostModel.observe`), fed the plan's modeled seconds
  with 5% seeded noise: the host work a rank does in every step with ``"online"`` on.

A second table per GPU count puts ``auto`` against ``knapformer`` on bags of 8 and against the best
fixed topology of the suite on each step (the smallest ``refine`` step time over the five), and
against the flexible lower bound: what no plan giving every sequence its own group can beat.

Sensitivity (``--sensitivity F``): every step is solved again with the cost model's quadratic
coefficient scaled by ``1 - F`` and ``1 + F``; those plans are priced under the true model
(:func:`~deepspeed_knap.planner.plan_loads`) and the loss is their step time over the true-model
plan's, minus one (median and max over steps). Modeled figures use the FLUX.1-dev FLOP model.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.cost.online import OnlineCostModel
from deepspeed_knap.models.registry import MIXES, default_cost_model, sample_mix
from deepspeed_knap.options import add_mix_argument, output_file, output_folder, positive_int
from deepspeed_knap.planner.route import moved_tokens
from deepspeed_knap.planner.solve import DEFAULT_SOLVER, SOLVERS, plan_loads, plan_routing, timed_plan
from deepspeed_knap.planner.topology import AUTO, build_topology

GPUS_PER_NODE = 8
SHORT = {"none": "none", "knapformer": "kf", "refine": "refine"}

HELP = "plan quality and solve time over mixes, topologies, GPU counts"


def suite_topologies(num_gpus: int) -> list[str]:
    """Flat, bags of 2, 4 and 8, a mix with a quarter of the GPUs in bags of each size, and auto."""
    if num_gpus <= 0 or num_gpus % 32:
        raise ValueError(
            f"the planner suite needs a positive multiple of 32 GPUs (for its mixed topology); got {num_gpus}"
        )
    mixed = f"g1n{num_gpus // 4}+g2n{num_gpus // 8}+g4n{num_gpus // 16}+g8n{num_gpus // 32}"
    return [f"g1n{num_gpus}", f"g2n{num_gpus // 2}", f"g4n{num_gpus // 4}", f"g8n{num_gpus // 8}", mixed, AUTO]


def run_case(
    num_gpus: int,
    mix_name: str,
    topology_spec: str,
    steps: int,
    solvers: Sequence[str],
    model: CostModel,
    sensitivity: float | None = None,
) -> list[dict]:
    """One row per solver for one (GPU count, mix, topology): statistics over ``steps`` steps, and
    the step time and lower bound of every step (``step_max_load``, ``step_lower_bound``)."""
    auto = topology_spec == AUTO
    topology = build_topology(topology_spec, num_gpus if auto else None, gpus_per_node=GPUS_PER_NODE)
    solvers = [s for s in solvers if not (auto and s == "knapformer")]  # knapformer needs fixed bags
    wrong_models = {}
    if sensitivity:
        for sign, label in ((-1, "minus"), (1, "plus")):
            wrong_models[label] = dataclasses.replace(
                model, quadratic_coef=model.quadratic_coef * (1 + sign * sensitivity)
            )
    samples: dict[str, dict[str, list[float]]] = {solver: {} for solver in solvers}
    refit, noise = OnlineCostModel(model, num_gpus), random.Random(0)
    for seed in range(steps):
        seq_lens = sample_mix(mix_name, num_gpus, seed)
        timed = {solver: timed_plan(seq_lens, topology, model, solver) for solver in solvers}
        baseline = timed["none"][0]
        for solver, (plan, ms) in timed.items():
            values = {
                "step_max_load": plan.max_load,
                "step_lower_bound": plan.lower_bound,
                "imbalance": plan.imbalance,
                "bound_ratio": plan.max_load / plan.lower_bound if plan.lower_bound > 0 else 1.0,
                "speedup": baseline.max_load / plan.max_load if plan.max_load > 0 else 1.0,
                "moved": plan.tokens_moved_fraction,
                "solve_ms": ms,
            }
            if auto and solver == DEFAULT_SOLVER:
                values["refit_ms"] = _refit_ms(refit, plan, model, noise)
            if solver != "none":
                for label, wrong in wrong_models.items():
                    misled = plan_routing(seq_lens, topology, wrong, solver)
                    values[f"loss_{label}"] = plan_loads(misled, model).max() / plan.max_load - 1
            for key, value in values.items():
                samples[solver].setdefault(key, []).append(value)
    rows = []
    for solver, values in samples.items():
        row = {"gpus": num_gpus, "mix": mix_name, "topology": topology_spec, "solver": solver, "steps": steps,
               "imbalance_median": np.median(values["imbalance"]),
               "imbalance_p95": np.percentile(values["imbalance"], 95),
               "bound_ratio_median": np.median(values["bound_ratio"]),
               "speedup_median": np.median(values["speedup"]),
               "moved_median": np.median(values["moved"]),
               "solve_ms_median": np.median(values["solve_ms"]),
               "solve_ms_p95": np.percentile(values["solve_ms"], 95),
               "refit_ms_median": np.median(values["refit_ms"]) if "refit_ms" in values else None,
               "step_max_load": values["step_max_load"], "step_lower_bound": values["step_lower_bound"]}  # fmt: skip
        for label in wrong_models:
            losses = values.get(f"loss_{label}")
            row[f"loss_{label}_median"] = np.median(losses) if losses else None
            row[f"loss_{label}_max"] = np.max(losses) if losses else None
        rows.append({key: float(v) if isinstance(v, np.floating) else v for key, v in row.items()})
    return rows


def _refit_ms(refit: OnlineCostModel, plan, model: CostModel, noise: random.Random) -> float:
    """Milliseconds of ``refit``'s update by ``plan``'s step (with the tokens each GPU moved, as the
    balancer counts them), its GPUs measured at the modeled seconds times ``1 + 0.05 N(0, 1)`` and
    their route phases at 1 ms."""
    compute_us = [round(1e6 * s * (1 + 0.05 * noise.gauss(0, 1))) for s in plan_loads(plan, model)]
    no_exchange, route_us = [0] * plan.num_gpus, [1000] * plan.num_gpus
    start = time.perf_counter()
    refit.observe(plan, compute_us, no_exchange, None, route_us, moved_tokens(plan))
    return (time.perf_counter() - start) * 1e3


def run_suite(
    gpu_counts: Sequence[int],
    mix_names: Sequence[str],
    steps: int,
    solvers: Sequence[str] = SOLVERS,
    model: CostModel | None = None,
    sensitivity: float | None = None,
) -> list[dict]:
    """:func:`run_case` over every GPU count, mix and topology of :func:`suite_topologies`."""
    if steps < 1:
        raise ValueError(f"--steps must be at least 1; got {steps}")
    if "none" not in solvers:
        raise ValueError(f"the suite needs the 'none' solver as the speedup baseline; got solvers {list(solvers)}")
    if sensitivity is not None and not 0 < sensitivity < 1:
        raise ValueError(f"--sensitivity is a fraction in (0, 1), e.g. 0.2 for +-20%; got {sensitivity}")
    model = model or default_cost_model()
    solvers = sorted(set(solvers), key=SOLVERS.index)
    cases = [(n, w, t) for n in gpu_counts for w in mix_names for t in suite_topologies(n)]
    rows = []
    for num_gpus, name, spec in tqdm(cases, desc="planner suite", unit="case"):
        rows += run_case(num_gpus, name, spec, steps, solvers, model, sensitivity)
    return rows


def write_csv(rows: list[dict], path: str | Path) -> None:
    """The scalar columns of ``rows`` (the per-step lists stay out)."""
    columns = list(dict.fromkeys(key for row in rows for key, value in row.items() if not isinstance(value, list)))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})


def _by_case(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    cases: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        cases.setdefault((row["gpus"], row["mix"], row["topology"]), {})[row["solver"]] = row
    return cases


def format_table(rows: list[dict], num_gpus: int) -> str:
    """Markdown table for one GPU count: a row per mix and topology, the solvers side by side."""
    cases = {k: v for k, v in _by_case(rows).items() if k[0] == num_gpus}
    solvers = list(next(iter(cases.values())))
    balancing = [s for s in solvers if s != "none"]
    names = lambda group: " / ".join(SHORT.get(s, s) for s in group)  # noqa: E731
    lines = [
        f"| mix | topology | imbalance {names(solvers)} | p95 imbalance {names(balancing)} "
        f"| step / bound {names(balancing)} | speedup {names(balancing)} | moved {names(balancing)} "
        f"| solve ms {names(balancing)} | p95 solve ms {names(balancing)} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cells(per_solver: dict, key: str, group: list[str], fmt: str) -> str:
        return " / ".join(format(per_solver[s][key], fmt) if s in per_solver else "-" for s in group)

    for (_, name, spec), per_solver in cases.items():
        lines.append(
            f"| {name} | {spec} | {cells(per_solver, 'imbalance_median', solvers, '.3f')} "
            f"| {cells(per_solver, 'imbalance_p95', balancing, '.3f')} "
            f"| {cells(per_solver, 'bound_ratio_median', balancing, '.4f')} "
            f"| {cells(per_solver, 'speedup_median', balancing, '.2f')} "
            f"| {cells(per_solver, 'moved_median', balancing, '.0%')} "
            f"| {cells(per_solver, 'solve_ms_median', balancing, '.2f')} "
            f"| {cells(per_solver, 'solve_ms_p95', balancing, '.2f')} |"
        )
    return "\n".join(lines)


def auto_comparison(rows: list[dict], num_gpus: int) -> list[dict]:
    """Per mix with an ``auto`` row: medians over steps of auto's step time over the flexible
    lower bound, knapformer's on bags of 8 over auto's, and auto's over the best fixed topology's
    (with the max), plus auto's tokens moved and solve time."""
    cases = _by_case(rows)
    found = []
    for (gpus, name, spec), per_solver in cases.items():
        if gpus != num_gpus or spec != AUTO:
            continue
        auto = per_solver[DEFAULT_SOLVER]
        fixed = [cases[(gpus, name, s)]["refine"]["step_max_load"] for s in suite_topologies(gpus) if s != AUTO]
        best_fixed = np.min(np.array(fixed), axis=0)  # [steps]
        ours, bound = np.array(auto["step_max_load"]), np.array(auto["step_lower_bound"])
        knapformer = np.array(cases[(gpus, name, f"g8n{gpus // 8}")]["knapformer"]["step_max_load"])
        found.append({
            "mix": name, "vs_bound": float(np.median(ours / bound)), "vs_bound_max": float(np.max(ours / bound)),
            "speedup_vs_knapformer_g8": float(np.median(knapformer / ours)),
            "vs_best_fixed": float(np.median(ours / best_fixed)), "vs_best_fixed_max": float(np.max(ours / best_fixed)),
            "moved": auto["moved_median"], "solve_ms": auto["solve_ms_median"], "solve_ms_p95": auto["solve_ms_p95"],
            "refit_ms": auto["refit_ms_median"],
        })  # fmt: skip
    return found


def format_auto_table(rows: list[dict], num_gpus: int) -> str:
    """Markdown table of :func:`auto_comparison`."""
    lines = [
        "| mix | auto / flexible bound: median (max) | speedup over knapformer on g8 | auto / best fixed: "
        "median (max) | moved | solve ms: median (p95) | refit ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in auto_comparison(rows, num_gpus):
        lines.append(
            f"| {r['mix']} | {r['vs_bound']:.4f} ({r['vs_bound_max']:.4f}) | {r['speedup_vs_knapformer_g8']:.3f}x "
            f"| {r['vs_best_fixed']:.4f} ({r['vs_best_fixed_max']:.4f}) | {r['moved']:.0%} "
            f"| {r['solve_ms']:.1f} ({r['solve_ms_p95']:.1f}) | {r['refit_ms']:.2f} |"
        )
    return "\n".join(lines)


def format_sensitivity(rows: list[dict], num_gpus: int) -> str:
    """Markdown table of the sensitivity losses for one GPU count (only rows that have them)."""
    rows = [r for r in rows if r["gpus"] == num_gpus and r.get("loss_minus_median") is not None]
    lines = [
        "| mix | topology | solver | loss, b -F: median / max | loss, b +F: median / max |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mix']} | {r['topology']} | {SHORT.get(r['solver'], r['solver'])} "
            f"| {r['loss_minus_median']:+.2%} / {r['loss_minus_max']:+.2%} "
            f"| {r['loss_plus_median']:+.2%} / {r['loss_plus_max']:+.2%} |"
        )
    return "\n".join(lines)


def plot_speedup(rows: list[dict], path: str | Path, solver: str = DEFAULT_SOLVER) -> None:
    """Median modeled speedup over ``none``: a panel per GPU count, bars by topology and mix
    for ``solver``, black ticks for ``knapformer`` when it ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _by_case(rows)
    gpu_counts = list(dict.fromkeys(k[0] for k in cases))
    mixes = list(dict.fromkeys(k[1] for k in cases))
    fig, axes = plt.subplots(len(gpu_counts), 1, figsize=(11, 3.2 * len(gpu_counts)), squeeze=False)
    width = 0.8 / len(mixes)
    for ax, num_gpus in zip(axes[:, 0], gpu_counts, strict=True):
        topologies = list(dict.fromkeys(k[2] for k in cases if k[0] == num_gpus))
        for i, name in enumerate(mixes):
            x = np.arange(len(topologies)) + (i - (len(mixes) - 1) / 2) * width
            ours = [cases[(num_gpus, name, t)][solver]["speedup_median"] for t in topologies]
            ax.bar(x, ours, width, label=name)
            with_kf = [k for k, t in enumerate(topologies) if "knapformer" in cases[(num_gpus, name, t)]]
            if with_kf and solver != "knapformer":
                kf = [cases[(num_gpus, name, topologies[k])]["knapformer"]["speedup_median"] for k in with_kf]
                ax.plot(x[with_kf], kf, "k_", markersize=8, label="knapformer" if i == 0 else None)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(np.arange(len(topologies)), topologies, fontsize=8)
        ax.set_ylabel("speedup over none")
        ax.set_title(f"{num_gpus} GPUs: median modeled speedup of {solver}", fontsize=10, loc="left")
    axes[0, 0].legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_loads(num_gpus: int, mix_name: str, topology_spec: str, path: str | Path,
                    solvers: Sequence[str] = SOLVERS, seed: int = 0) -> None:  # fmt: skip
    """Per-GPU modeled load of one step (seed ``seed``), one panel per solver."""
    from deepspeed_knap.plots import plot_loads

    auto = topology_spec == AUTO
    topology = build_topology(topology_spec, num_gpus if auto else None, gpus_per_node=GPUS_PER_NODE)
    seq_lens = sample_mix(mix_name, num_gpus, seed)
    model = default_cost_model()
    solvers = [s for s in solvers if not (auto and s == "knapformer")]
    plans = {solver: plan_routing(seq_lens, topology, model, solver) for solver in solvers}
    plot_loads(plans, path, f"{topology_spec}, {mix_name} (seed {seed})", topology)


def run(args: argparse.Namespace) -> int:
    if args.plot_dir and DEFAULT_SOLVER not in args.solvers:
        raise ValueError(f"--plot-dir plots {DEFAULT_SOLVER}'s speedup: add {DEFAULT_SOLVER} to --solvers, or drop "
                         "--plot-dir")  # fmt: skip
    rows = run_suite(args.gpus, args.mixes, args.steps, args.solvers, sensitivity=args.sensitivity)
    for num_gpus in args.gpus:
        print(f"\n{num_gpus} GPUs, median over {args.steps} steps (p95 where marked):\n")
        print(format_table(rows, num_gpus))
        compared = {r["solver"] for r in rows} >= {"knapformer", DEFAULT_SOLVER}  # the table needs both
        if compared and any(r["topology"] == AUTO and r["gpus"] == num_gpus for r in rows):
            print(f"\n{num_gpus} GPUs, topology auto per step, median over {args.steps} steps:\n")
            print(format_auto_table(rows, num_gpus))
        if args.sensitivity:
            print(
                f"\n{num_gpus} GPUs, quadratic term off by -+{args.sensitivity:.0%}: step-time loss under the true model:\n"
            )
            print(format_sensitivity(rows, num_gpus))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"\nrows written to {args.csv}")
    if args.plot_dir:
        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        plot_speedup(rows, out / "speedup.png")
        mix = "kf_image_video" if "kf_image_video" in args.mixes else args.mixes[0]
        mixed, auto = suite_topologies(args.gpus[0])[-2:]
        plot_step_loads(args.gpus[0], mix, mixed, out / "loads.png", args.solvers)
        plot_step_loads(args.gpus[0], mix, auto, out / "loads_auto.png", args.solvers)
        print(f"plots written to {out / 'speedup.png'}, {out / 'loads.png'} and {out / 'loads_auto.png'}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=positive_int, nargs="+", default=[32, 256, 1024], help="balance-group sizes")
    add_mix_argument(parser, list(MIXES), many=True)
    parser.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=list(SOLVERS))
    parser.add_argument("--steps", type=positive_int, default=20, help="sampled steps per case (seeds 0..steps-1)")
    parser.add_argument("--sensitivity", type=float, default=None, metavar="F",
                       help="also solve with the quadratic term scaled by 1-F and 1+F (e.g. 0.2)")  # fmt: skip
    parser.add_argument("--csv", type=output_file, metavar="OUT.csv", help="write every row")
    parser.add_argument("--plot-dir", type=output_folder, metavar="DIR",
                        help="write speedup.png, loads.png and loads_auto.png here")  # fmt: skip
