r"""Planning ahead: how long a step waits for its plan, solved in the step or ahead in a worker.

    deepspeed-knap bench ahead --gpus 32 1024 --steps 10 --plot ahead.png

Per mix and GPU count (topology ``auto``, nodes of 8, FLUX.1-dev's cost model), every sampled
step is solved twice:

* in this process, as :meth:`KnapBalancer.plan <deepspeed_knap.runtime.balancer.KnapBalancer.plan>` does
  without prefetch: the step waits for the whole solve;
* by ``--workers`` :class:`~deepspeed_knap.planner.worker.PlanWorker`\ s at once (the ranks of one
  host), as after :meth:`~deepspeed_knap.runtime.balancer.KnapBalancer.prefetch`: the job is sent, the
  step before runs (emulated by an idle wait 1.5x as long as the solve, as a CPU waits on a GPU), and
  the plans are read. The step waits for the send and the read (pickles over a pipe), whenever the
  step before lasts longer than the worker's solve. The workers share each solve, as in training
  (``--no-share``: each solves it).

Both wait for the lengths all-gather as well; prefetch adds one small all-gather (the ranks agreeing
the plan is good), not timed here. Reported, medians over steps (p95 in brackets): the in-process
solve, the worker's solve, the wait with prefetch (for the last worker's plan), the CPU seconds the
workers used for the job, how many of them solved it, and whether every worker plan is
bit-identical to the in-process one.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from deepspeed_knap.models.registry import MIXES, default_cost_model, sample_mix
from deepspeed_knap.options import add_mix_argument, plot_file, positive_int
from deepspeed_knap.planner.solve import DEFAULT_SOLVER, plan_routing
from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.planner.worker import PlanWorker

GPUS_PER_NODE = 8

HELP = "how long a step waits for its plan: solved in the step or ahead"


def bench_ahead(mixes: Sequence[str], gpu_counts: Sequence[int], steps: int, workers: int = 1,
                share: bool = True) -> list[dict]:  # fmt: skip
    """One row per (GPU count, mix): per-step seconds of the in-process solve, the worker's solve
    and the wait with prefetch, the workers' CPU seconds and how many of them solved, and whether
    the plans were identical. ``workers``: plan workers sent every job at once, as the ranks of one
    host send theirs; ``share``: theirs share each solve."""
    model = default_cost_model("flux-dev")
    pool = [PlanWorker(share) for _ in range(workers)]
    rows = []
    try:
        # Start the workers (~0.2 s, once per training run) before timing.
        for worker in pool:
            worker.result(worker.submit([[1], [1]], build_topology("auto", 2), model, DEFAULT_SOLVER, None))
        cases = [(gpus, mix) for gpus in gpu_counts for mix in mixes]
        for gpus, mix in tqdm(cases, desc="bench ahead", unit="case"):
            topology = build_topology("auto", gpus, gpus_per_node=min(GPUS_PER_NODE, gpus))
            row = {"gpus": gpus, "mix": mix, "solve_s": [], "worker_solve_s": [], "wait_s": [], "cpu_s": [],
                   "solves": [], "identical": True}  # fmt: skip
            for seed in range(steps):
                seq_lens_per_rank = sample_mix(mix, gpus, seed)
                start = time.perf_counter()
                plan = plan_routing(seq_lens_per_rank, topology, model)
                solve_s = time.perf_counter() - start
                cpu_before = _cpu_s(pool)
                start = time.perf_counter()
                tickets = [worker.submit(seq_lens_per_rank, topology, model, DEFAULT_SOLVER, None) for worker in pool]
                sent_s = time.perf_counter() - start
                time.sleep(1.5 * solve_s)  # the step before: this process idles while "the GPU" computes
                start = time.perf_counter()
                replies = [worker.result(ticket) for worker, ticket in zip(pool, tickets, strict=True)]
                row["solve_s"].append(solve_s)
                row["worker_solve_s"].append(max(reply.solve_s for reply in replies))
                row["wait_s"].append(sent_s + time.perf_counter() - start)
                row["cpu_s"].append(_cpu_s(pool) - cpu_before)
                row["solves"].append(sum(not reply.shared for reply in replies))
                row["identical"] &= all(reply.plan == plan for reply in replies)  # every field, bit for bit
            rows.append(row)
    finally:
        for worker in pool:
            worker.close()
    return rows


def _cpu_s(pool: Sequence[PlanWorker]) -> float:
    """CPU seconds the workers' processes have used so far (Linux's ``/proc``; NaN elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for worker in pool:
        if worker.pid is None:
            return float("nan")
        try:
            fields = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def format_rows(rows: list[dict]) -> str:
    def ms(values: list[float]) -> str:
        return f"{1e3 * np.median(values):.2f} ({1e3 * np.percentile(values, 95):.2f})"

    lines = [
        "| GPUs | mix | solve in the step, ms | worker's solve, ms | wait with prefetch, ms | workers' CPU, ms | "
        "solves | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['gpus']} | {row['mix']} | {ms(row['solve_s'])} | {ms(row['worker_solve_s'])} | "
                     f"{ms(row['wait_s'])} | {ms(row['cpu_s'])} | {np.median(row['solves']):g} | "
                     f"{'yes' if row['identical'] else 'NO'} |")  # fmt: skip
    return "\n".join(lines)


def plot_rows(rows: list[dict], path: str | Path) -> None:
    """Median wait per step for its plan, solved in the step and with prefetch (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row['mix']}\n{row['gpus']} GPUs" for row in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    for offset, key, name in ((-0.2, "solve_s", "solved in the step"), (0.2, "wait_s", "with prefetch")):
        ax.bar(x + offset, [1e3 * np.median(row[key]) for row in rows], 0.4, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("ms a step waits for its plan (median)")
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    ax.legend()
    ax.set_title("topology auto, FLUX.1-dev cost model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1; got {args.steps}")
    rows = bench_ahead(args.mixes, args.gpus, args.steps, args.workers, args.share)
    print(f"topology auto (nodes of {GPUS_PER_NODE}), flux-dev cost model, {args.steps} steps, {args.workers} "
          f"worker(s){', sharing solves' if args.share else ', each solving'}: median (p95)")  # fmt: skip
    print(format_rows(rows))
    if args.plot:
        plot_rows(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(row["identical"] for row in rows) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=positive_int, nargs="+", default=[32, 1024], help="GPU counts of topology auto")
    add_mix_argument(parser, list(MIXES), many=True)
    parser.add_argument("--steps", type=positive_int, default=10, help="sampled steps per case (median)")
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="plan workers sent every job at once, as the ranks of one host send theirs")  # fmt: skip
    parser.add_argument("--share", action=argparse.BooleanOptionalAction, default=True,
                        help="the workers share each solve, as in training (default); --no-share: each solves")  # fmt: skip
    parser.add_argument("--plot", type=plot_file, metavar="OUT.png", help="median wait per case, both ways (log scale)")
