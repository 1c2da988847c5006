"""Plots shared by the CLI and the benchmarks (matplotlib, imported on use)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.topology import Topology


def write_report(report: dict, json_path: str | None, figures: str, plot_path: str | None,
                 plot: Callable[[dict, str | Path], None]) -> None:  # fmt: skip
    """A benchmark's optional outputs: ``report`` as JSON at ``json_path`` (``figures`` says what it
    holds) and ``plot(report, plot_path)``, each only when its path is given, saying where it went."""
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
        print(f"{figures} written to {json_path}")
    if plot_path:
        plot(report, plot_path)
        print(f"plot written to {plot_path}")


def plot_loads(plans: dict[str, RoutingPlan], path: str | Path, title: str, topology: Topology | None = None) -> None:
    """Write :func:`loads_figure` to ``path``."""
    import matplotlib.pyplot as plt

    fig = loads_figure(plans, title, topology)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def loads_figure(plans: dict[str, RoutingPlan], title: str, topology: Topology | None = None):
    """Bar chart of modeled per-GPU load, one panel per solver, lower bound dashed. With ``topology``,
    bags are shaded in alternation and their boundaries drawn, so a reader sees which GPUs share
    sequences (for ``auto``, which has no bags, its largest groups: no sequence spans two). The
    legend sits beside the panels, never over a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(plans), 1, figsize=(11, 2.2 * len(plans) + 0.6), sharex=True, sharey=True)
    axes = np.atleast_1d(axes)
    bags = list(zip(topology.bag_first_rank, topology.bag_sizes, strict=True)) if topology else []
    for ax, (name, plan) in zip(axes, plans.items(), strict=True):
        for index, (first, size) in enumerate(bags):
            if index % 2:
                ax.axvspan(first - 0.5, first + size - 0.5, color="0.92", zorder=0)
            if first:
                ax.axvline(first - 0.5, color="0.55", linewidth=0.8, zorder=1)
        ax.bar(np.arange(plan.num_gpus), plan.gpu_loads, width=0.85, zorder=2,
               color="tab:gray" if name == "none" else "tab:blue")  # fmt: skip
        ax.axhline(plan.lower_bound, color="tab:red", linestyle="--", linewidth=1, zorder=3)
        ax.set_ylabel("modeled s")
        ax.set_xlim(-0.5, plan.num_gpus - 0.5)
        ax.set_title(f"{name}: step {plan.max_load:.3g} s, imbalance {plan.imbalance:.3f}", fontsize=10, loc="left")
    handles = [
        Patch(color="tab:gray", label="GPU load, no balancing"),
        Patch(color="tab:blue", label="GPU load, balanced"),
        plt.Line2D([], [], color="tab:red", linestyle="--", label="lower bound"),
    ]
    if len(bags) > 1:  # (one bag: nothing shaded, no boundary)
        groups = "auto's largest groups" if topology.elastic else "bags"  # (auto on 6 GPUs: of 4 and 2)
        handles.append(Patch(facecolor="0.92", edgecolor="0.55", label=f"{groups} (alternate shading)"))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 0.95), fontsize=8, frameon=False)
    axes[-1].set_xlabel("GPU (rank in balance group)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
