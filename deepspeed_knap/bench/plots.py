"""Plots shared by the CLI and the benchmarks (matplotlib, imported on use)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deepspeed_knap.planner import RoutingPlan


def plot_loads(plans: dict[str, RoutingPlan], path: str | Path, title: str) -> None:
    """Bar chart of modeled per-GPU load, one panel per solver, lower bound dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(plans), 1, figsize=(10, 2.2 * len(plans) + 0.6), sharex=True, sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (name, plan) in zip(axes, plans.items(), strict=True):
        ax.bar(np.arange(plan.num_gpus), plan.gpu_loads, width=0.85, color="tab:gray" if name == "none" else "tab:blue")
        ax.axhline(plan.lower_bound, color="tab:red", linestyle="--", linewidth=1, label="lower bound")
        ax.set_ylabel("modeled s")
        ax.set_title(f"{name}: step {plan.max_load:.3g} s, imbalance {plan.imbalance:.3f}", fontsize=10, loc="left")
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("GPU (rank in balance group)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
