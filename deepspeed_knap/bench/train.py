"""Measured training steps on real ranks: balancing off against knapformer, refine and auto.

    deepspeed-knap bench train --ranks 2 --mix long_video --token-scale 0.0625 --steps 8
    deepspeed-knap bench train --ranks 2 --mix kf_image_video --token-scale 0.03 --slow-rank 1:3 --online
    deepspeed-knap bench train --ranks 2 --family wan --mix wan_image_video --token-scale 0.015625
    deepspeed-knap bench train --ranks 2 --family wan --expert both --token-scale 0.0625 --modes off,knapformer,auto

Spawns ``--ranks`` local processes (gloo on CPU, NCCL with one GPU each on CUDA) that train the tiny
packed model of ``--family`` (any registered family: its spec's ``tiny_config``; ``--flux-dims`` for
FLUX.1's width on GPUs; ``--expert`` for Wan 2.2 A14B's two experts as training builds them) with
DeepSpeed, the real routes and Ulysses all-to-alls, on the same
synthetic samples of ``--mix`` (default: the family's ``default_mix``) in every mode:
``off`` (no balancing: every sequence stays home), ``knapformer`` and ``refine`` on ``--topology``
(default: one bag of all ranks) or on a topology of their own (``knapformer@g1n2``: the mode may be
given once per topology, to compare fixed topologies in the same run), and ``auto``. Every mode is
built first (the same initial weights), then the modes run interleaved step by step: step ``s`` runs in
every mode in turn, before step ``s + 1``, so that drift of the machine (another process, a clock
change) lands on every mode alike instead of on the modes that happened to run then. The orders are
a Williams design, each order followed by its mirror (:func:`carryover_balanced_orders`): over
``2 * len(modes)`` steps each mode runs equally often in each place and right after each other mode
twice, and right after itself once (across a step boundary), with one extra predecessor each (for an
even count, the mode listed before it). A step runs slower after some modes than after others (on 2
CPU ranks, 10% after a balanced mode's step than after ``off``'s): with the order only rotating,
``auto`` listed after ``knapformer@g1n2`` followed it in most steps and trailed it 1.30x to 1.53x
over ``off``; listed before it, the two were level. Per mode and step it reports the measured step time
(slowest rank, synchronised), the speedup over ``off`` on the same step, the measured max/mean of the
ranks' compute seconds, the cost model's error (the largest over ranks), and each rank's time by
phase (plan, route, Ulysses all-to-alls, compute, reverse route) as the balancer measured it; and per
mode the step at which the cost model first put each rank's speed off 1 (``--slow-rank``'s rank
should be the one, soon).

``--slow-rank R:F`` makes rank ``R``'s compute ``F`` times slower (it sleeps ``F - 1`` times each
block's forward and backward; CPU ranks only). ``--online`` turns on the cost model's online refit,
which learns that rank's speed. ``--startup-calibration`` times the blocks at start-up
(``cost_model.startup_calibration``) at the mix's lengths; the slow-down does not reach those
timings (they run a copy of the blocks), so the refit is what finds a slow rank. The cost model's
prior is the FLOP model of the tiny dims, whose absolute scale is far from a CPU's: its error is
large until the refit has run (or give ``--calibration FILE`` from ``deepspeed-knap calibrate``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from tqdm import tqdm

from deepspeed_knap.cost.calibrate import read_calibration
from deepspeed_knap.models.registry import spec
from deepspeed_knap.options import (
    add_family_argument,
    add_mix_argument,
    output_file,
    plot_file,
    positive_float,
    positive_int,
)
from deepspeed_knap.planner.solve import plan_loads
from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.plots import write_report
from deepspeed_knap.runtime.config import get_knapformer_config
from deepspeed_knap.runtime.shm_buffers import remove_job_buffers
from deepspeed_knap.training.arguments import TrainingArguments

DEFAULT_MODES = "off,knapformer,refine,auto"
MODES = ("off", "knapformer", "refine", "auto")
# The plan by part (the lengths gather, recording the closed step and the online refit, the solve or
# the wait for the worker's, the agreement on a prefetched plan), then the exchanges and the compute,
# as the balancer measured them.
PHASES = ("gather", "refit", "solve", "agree", "route", "ulysses", "compute", "reverse_route")

HELP = "measured training steps on local ranks: off, knapformer, refine, auto"


def parse_slow_rank(text: str) -> tuple[int, float]:
    """``R:F`` -> ``(R, F)`` with ``F >= 1``."""
    try:
        rank, factor = text.split(":")
        parsed = int(rank), float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--slow-rank {text!r}: give RANK:FACTOR, e.g. 1:3") from None
    if parsed[0] < 0 or not parsed[1] >= 1:
        raise argparse.ArgumentTypeError(f"--slow-rank {text!r}: the rank must be >= 0 and the factor >= 1")
    return parsed


def ds_config(mode: str, topology: str, world: int, cost_model: dict, online: bool) -> dict:
    """The DeepSpeed config of one mode (ZeRO-1, the ``"knapformer"`` block per mode). ``off`` runs
    the balancer with solver ``none`` on single GPUs: every sequence stays home, as without the
    block, but its compute is timed the same way (its step pays the lengths gather, the agreement on
    the prefetched plan and the route's check: small all-gathers; a plan that moves no token skips
    the routes' all-to-alls). ``solver@topology`` runs the solver on that topology instead of ``topology``."""
    mode, _, own_topology = mode.partition("@")
    topology = {"off": f"g1n{world}", "auto": "auto"}.get(mode, own_topology or topology)
    solver = {"off": "none", "knapformer": "knapformer"}.get(mode, "refine")
    refit = {"online": True} if online and mode in ("refine", "auto") else {}
    knap = {"enabled": True, "topology": topology, "solver": solver, "attention_backend": "auto",
            "cost_model": {**cost_model, **refit}, "log_interval": 0}  # fmt: skip
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
            "zero_allow_untested_optimizer": True, "knapformer": knap}  # fmt: skip


class _SlowDown:
    """Makes a model's blocks ``factor`` times slower: each block sleeps ``factor - 1`` times what its
    forward took, and the same after its backward."""

    def __init__(self, blocks: Sequence[torch.nn.Module], factor: float) -> None:
        self.factor = factor
        self.handles = []
        for block in blocks:
            self.handles += [
                block.register_forward_pre_hook(self._start),
                block.register_forward_hook(self._stop),
                block.register_full_backward_pre_hook(self._start_backward),
                block.register_full_backward_hook(self._stop_backward),
            ]

    def _start(self, module, *_):
        module._slow_clock = time.perf_counter()

    def _stop(self, module, *_):
        time.sleep((self.factor - 1) * (time.perf_counter() - module._slow_clock))

    def _start_backward(self, module, *_):
        module._slow_clock_backward = time.perf_counter()

    def _stop_backward(self, module, *_):
        time.sleep((self.factor - 1) * (time.perf_counter() - module._slow_clock_backward))


@dataclasses.dataclass
class _ModeRun:
    """One mode's state on a rank: its engine and balancer, its step inputs (bound to its own model
    and data), its slow-down hooks, and its next step's inputs (prepared a step ahead, for prefetch)."""

    mode: str
    engine: Any
    balancer: Any
    step_inputs: Callable[[int], tuple]
    slow: _SlowDown | None
    upcoming: tuple | None


def _worker(rank: int, world: int, port: int, options: dict, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(max(1, options["threads"]))
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from deepspeed_knap.engine import initialize, token_mean_loss
    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    deepspeed.init_distributed(verbose=False)
    get_accelerator().set_device(rank)  # one GPU each: bind before anything lands on a device
    family = spec(options["family"])
    hooks = family.hooks()
    dims = dict(family.tiny_config)
    if options["flux_dims"]:
        dims.update(num_attention_heads=24, attention_head_dim=128, axes_dims_rope=(16, 56, 56))
    device = torch.device(get_accelerator().current_device_name())
    runs: list[_ModeRun] = []
    for mode in options["modes"]:  # every mode built first: then the modes take turns, step by step
        torch.manual_seed(0)  # every mode trains the same initial weights
        if options["expert"] is None:
            model = family.model_class(**dims)
        else:  # the family's hooks build what training builds for --expert (tiny: both experts' shape)
            model = hooks.load_model(TrainingArguments(None, family=options["family"], expert=options["expert"]), {})
        config = ds_config(mode, options["topology"], world, options["cost_model"], options["online"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _, balancer = initialize(model=model, optimizer=optimizer, config=config)
        unlink_own_shm_buffer(rank)
        dit = engine.module
        slow = None
        if options["slow_rank"] is not None and options["slow_rank"][0] == rank:
            slow = _SlowDown(dit.block_stack, options["slow_rank"][1])
        data = hooks.synthetic_data(options["mix"], dit.config, options["token_scale"], 0)
        guidance = 1.0 if dit.config.get("guidance_embeds") else None

        def step_inputs(step: int, data=data, dit=dit, guidance=guidance):  # bound: this mode's
            latents, generator = data.step_samples(step, rank, world), torch.Generator().manual_seed(step * 4099 + rank)
            objective = hooks.objective(latents, generator, dit.config, guidance)
            inputs, _ = hooks.pack(dit, objective.samples, balanced=True)
            return inputs.to(device), objective

        if options["prefetch"]:  # as train_dit.py: the worker starts during set-up, not at step 0
            balancer.plan_worker().start()
        runs.append(_ModeRun(mode, engine, balancer, step_inputs, slow, step_inputs(0)))
    del model, optimizer, engine, balancer, dit, data, slow  # the runs hold them

    # The set-up's objects (models, engines) go to the permanent generation, so that a full collection
    # scans only what the steps make: else one 150-200 ms collection fell on step 15 of one mode in every
    # run of off, refine@g1n2, auto (2 CPU ranks, kf_mixed_res x1/4), 6-10% of that mode's summed time.
    gc.collect()
    gc.freeze()
    records = []
    steps = options["steps"]
    progress = tqdm(total=steps * len(runs), desc="bench train", disable=rank != 0, leave=False)
    orders = carryover_balanced_orders(len(runs))
    for step in range(steps):
        for index in orders[step % len(orders)]:
            run = runs[index]
            (inputs, objective), run.upcoming = run.upcoming, run.step_inputs(step + 1) if step + 1 < steps else None
            get_accelerator().synchronize()
            dist.barrier()  # every rank starts the step together: the step time is the slowest rank's
            start = time.perf_counter()
            if options["prefetch"] and run.upcoming is not None:  # as train_dit.py: this mode's next plan solves now
                run.balancer.prefetch(run.upcoming[0].seq_lens, next_segments=run.upcoming[0].segments)
            prediction = run.engine(inputs, run.balancer)
            forward_end = time.perf_counter()
            targets = objective.targets
            target = torch.cat(targets).to(device) if targets else torch.zeros_like(prediction)
            weights = torch.cat(objective.weights).to(device) if objective.weights else None
            loss = token_mean_loss((prediction.float() - target.float()).square().mean(dim=-1), weights)
            run.engine.backward(loss)
            get_accelerator().synchronize()
            backward_end = time.perf_counter()
            run.engine.step()
            dist.barrier()
            step_s = time.perf_counter() - start
            # Its "step" (close to close, this mode's) holds the other modes' steps run in between.
            phases = run.balancer.close_step() or {}
            plan = run.balancer._last[1]
            records.append({"mode": run.mode, "step": step, "rank": rank, "step_s": step_s,
                            "forward_s": forward_end - start, "backward_s": backward_end - forward_end,
                            "phases": phases, "predicted_s": predicted_compute_s(run.balancer),
                            "speeds": list(run.balancer.model.gpu_speed or ()),
                            "tokens": int(plan.gpu_tokens[run.balancer.groups.group_rank])})  # fmt: skip
            progress.update()
    progress.close()
    for run in runs:
        if run.slow is not None:
            for handle in run.slow.handles:
                handle.remove()
    del run, runs  # each mode's engine and balancer (and its plan worker)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()


def calibration_lengths(mix: str, ranks: int, token_scale: float, steps: int = 8) -> list[int]:
    """Four lengths for ``--startup-calibration``: the 10th, 50th and 90th percentiles and the
    longest of the mix's sequences over ``steps`` steps of ``ranks`` ranks, scaled (at least 3
    different, doubling from the shortest where the mix's are too alike)."""
    import numpy as np

    from deepspeed_knap.models.registry import sample_shapes

    lengths = [shape.scaled(token_scale).length for step in range(steps)
               for rank in sample_shapes(mix, ranks, seed=step) for shape in rank]  # fmt: skip
    picked = sorted({int(np.percentile(lengths, q)) for q in (10, 50, 90)} | {max(lengths)})
    while len(picked) < 3:
        picked = sorted({*picked, 2 * picked[-1]})
    return picked


def predicted_compute_s(balancer) -> float:
    """The cost model's compute seconds for this rank under the balancer's last plan (the model it
    planned with, all-to-all term left out: the measured compute excludes the exchanges)."""
    plan, rank = balancer._last[1], balancer.groups.group_rank
    if balancer.online is not None:
        return balancer.online.predicted_s(plan)[rank]
    return float(plan_loads(plan, dataclasses.replace(balancer.cost_model, alltoall_coef=0.0))[rank])


def carryover_balanced_orders(count: int) -> list[list[int]]:
    """Mode orders for bench train's steps, ``2 * count`` of them: each of a Williams design's
    ``count`` orders, then that order mirrored (for an odd count the mirrors complete the design):
    each index twice in each place and right after each other index twice (for an even count, once
    each within the orders and within the mirrors). Between two steps nothing else runs, so the last
    of one order runs right before the first of the next: the mirror makes that the same index (every index
    once per design, alike for all), and leaves one extra predecessor per index and design (for an
    even count the index before it, ``i - 1`` before ``i``). E.g. 2: ``[0, 1], [1, 0], [1, 0], [0, 1]``."""
    first = [0] + [(i + 1) // 2 if i % 2 else count - i // 2 for i in range(1, count)]
    williams = [[(index + shift) % count for index in first] for shift in range(count)]
    return [order for forward in williams for order in (forward, forward[::-1])]


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_train(options: dict) -> dict:
    """Run the ranks and assemble their records: per mode, per step, per rank."""
    from deepspeed_knap.runtime.balancer import balancer_overhead_s

    with tempfile.TemporaryDirectory(prefix="knap-bench-train-") as out_dir:
        port = _free_port()
        try:
            mp.start_processes(_worker, args=(options["ranks"], port, options, out_dir), nprocs=options["ranks"],
                               start_method="spawn")  # fmt: skip
        finally:
            remove_job_buffers(port)  # a rank that failed before unlinking its own leaves it
        records = [
            r for rank in range(options["ranks"]) for r in json.loads(Path(out_dir, f"rank{rank}.json").read_text())
        ]
    steps = []
    for mode in options["modes"]:
        for step in range(options["steps"]):
            ranks = sorted((r for r in records if r["mode"] == mode and r["step"] == step), key=lambda r: r["rank"])
            compute = [r["phases"].get("compute", float("nan")) for r in ranks]
            errors = [(r["predicted_s"] - c) / c if r["predicted_s"] is not None and c > 0 else None
                      for r, c in zip(ranks, compute, strict=True)]  # fmt: skip
            shares = share_errors([r["predicted_s"] for r in ranks], compute)
            step_s = max(r["step_s"] for r in ranks)
            overhead = balancer_overhead_s([r["phases"] for r in ranks]) / step_s
            steps.append({"mode": mode, "step": step, "step_s": step_s, "overhead": overhead,
                          "compute_s": compute, "compute_imbalance": max(compute) / (sum(compute) / len(compute)),
                          "model_error": errors, "share_error": shares, "phases": [r["phases"] for r in ranks],
                          "speeds": ranks[0]["speeds"], "tokens": [r["tokens"] for r in ranks]})  # fmt: skip
    return {"options": {k: v for k, v in options.items() if k != "cost_model"}, "steps": steps}


def share_errors(predicted_s: Sequence[float | None], measured_s: Sequence[float]) -> list[float] | None:
    """``[S]`` how far the cost model's split of a step's compute among the ranks is from the
    measured split: ``(predicted[r] / sum(predicted)) / (measured[r] / sum(measured)) - 1``. A plan
    evens out the predicted seconds, so this is what its balance misses by; a change of speed that
    every rank shares (the whole machine slower for a step) is in the model error and not in this.
    ``None`` for one rank, or where a rank has no prediction or no time."""
    if len(measured_s) < 2 or any(p is None for p in predicted_s) or not all(m > 0 for m in measured_s):
        return None
    predicted_sum, measured_sum = sum(predicted_s), sum(measured_s)
    if predicted_sum <= 0:
        return None
    return [(p / predicted_sum) / (m / measured_sum) - 1 for p, m in zip(predicted_s, measured_s, strict=True)]


def summarize(report: dict, skip: int = 1) -> dict[str, dict[str, float]]:
    """Per mode, over steps ``skip..`` (the first warms up; online, it is not learned from): the
    median step seconds, speedup over ``off`` on the same step and compute max/mean, the median
    |model error| and |share error| (:func:`share_errors`), the speedup of the summed step times
    (what a training run of these steps gains), and the median overhead budget
    (:func:`~deepspeed_knap.runtime.balancer.balancer_overhead_s` over the step: the largest refit and
    solve of a rank over ranks plus each collective part's least time over ranks, so a fast rank's
    wait for a slow one is not counted as the balancer's)."""
    by_mode: dict[str, list[dict]] = {}
    for row in report["steps"]:
        by_mode.setdefault(row["mode"], []).append(row)
    off = {row["step"]: row["step_s"] for row in by_mode.get("off", [])}
    summary = {}
    for mode, rows in by_mode.items():
        rows = [row for row in rows if row["step"] >= skip] or rows
        errors = [abs(e) for row in rows for e in row["model_error"] if e is not None]
        shares = [abs(e) for row in rows for e in row.get("share_error") or ()]
        summary[mode] = {
            "step_s": statistics.median(row["step_s"] for row in rows),
            "speedup": statistics.median(off[row["step"]] / row["step_s"] for row in rows) if off else float("nan"),
            "total_speedup": (
                sum(off[row["step"]] for row in rows) / sum(row["step_s"] for row in rows) if off else float("nan")
            ),
            "compute_imbalance": statistics.median(row["compute_imbalance"] for row in rows),
            "model_error": statistics.median(errors) if errors else float("nan"),
            "share_error": statistics.median(shares) if shares else float("nan"),
            "overhead": statistics.median(row["overhead"] for row in rows),
        }
    return summary


def speed_calls(report: dict) -> dict[str, dict[int, tuple[int, float]]]:
    """Per mode, each rank whose speed the cost model the mode planned with put off 1: ``rank ->
    (the first step it did, its speed then)``; modes that called none are left out."""
    calls: dict[str, dict[int, tuple[int, float]]] = {}
    for row in report["steps"]:
        for rank, speed in enumerate(row["speeds"] or ()):
            if speed != 1.0 and rank not in calls.get(row["mode"], {}):
                calls.setdefault(row["mode"], {})[rank] = (row["step"], speed)
    return calls


def format_report(report: dict) -> str:
    options = report["options"]
    family = options["family"] + (f" (--expert {options['expert']})" if options.get("expert") else "")
    lines = [f"{options['ranks']} ranks, tiny {family}, {options['mix']} x{options['token_scale']:g} tokens, topology "
             f"{options['topology']} (knapformer, refine) and auto; off keeps every sequence home"
             + (f", rank {options['slow_rank'][0]} {options['slow_rank'][1]:g}x slower" if options["slow_rank"] else "")
             + (", online refit" if options["online"] else "")
             + (", plans solved a step ahead (prefetch)" if options["prefetch"] else ", plans solved in the step"), "",
             f"{'mode':<16}{'step':>5}{'step s':>9}{'speedup':>9}{'compute max/mean':>18}{'|model error|':>15}"
             f"{'|share error|':>15}  tokens per rank (routed)"]  # fmt: skip
    off = {row["step"]: row["step_s"] for row in report["steps"] if row["mode"] == "off"}
    for row in report["steps"]:
        speedup = f"{off[row['step']] / row['step_s']:>8.2f}x" if row["step"] in off else f"{'-':>9}"
        errors = [abs(e) for e in row["model_error"] if e is not None]
        error = f"{max(errors):>15.1%}" if errors else f"{'-':>15}"
        shares = row.get("share_error")
        share = f"{max(abs(e) for e in shares):>15.1%}" if shares else f"{'-':>15}"
        lines.append(f"{row['mode']:<16}{row['step']:>5}{row['step_s']:>9.3f}{speedup}{row['compute_imbalance']:>18.3f}"
                     f"{error}{share}  {row['tokens']}")  # fmt: skip
    lines.append("|model error|: the largest over ranks of (the cost model's compute seconds - the measured) / the "
                 "measured, the model the step planned with; |share error|: the largest over ranks of its share of "
                 "the step's compute, modeled over measured, - 1 (what the plan's balance misses by: a speed change "
                 "every rank shares is in the model error only)")  # fmt: skip
    for mode, called in speed_calls(report).items():
        lines.append(f"{mode}: " + ", ".join(f"rank {rank} called {speed:g}x at step {step}"
                                             for rank, (step, speed) in sorted(called.items())))  # fmt: skip
    lines += ["", f"medians over steps 1..{options['steps'] - 1} (total: the summed step times):",
              f"{'mode':<16}{'step s':>9}{'speedup':>9}{'total':>8}{'compute max/mean':>18}{'|model error|':>15}"
              f"{'|share error|':>15}{'overhead':>10}"]  # fmt: skip
    for mode, s in summarize(report).items():
        lines.append(f"{mode:<16}{s['step_s']:>9.3f}{s['speedup']:>8.2f}x{s['total_speedup']:>7.2f}x"
                     f"{s['compute_imbalance']:>18.3f}{s['model_error']:>15.1%}{s['share_error']:>15.1%}"
                     f"{s['overhead']:>10.1%}")  # fmt: skip
    lines.append("overhead: the balancer's seconds over the step: the largest over ranks of a rank's refit "
                 "(recording the last step's times, refitting the cost model online) and solve (or wait for the "
                 "worker's plan), plus the least over ranks of each collective (lengths gather, plan agreement, "
                 "route, reverse route), whose time on a rank includes waiting for slower ranks (the last to arrive "
                 "waits least); plan parts on the host clock, routes by device events")  # fmt: skip
    last = [row for row in report["steps"] if row["step"] == options["steps"] - 1]
    lines += ["", f"seconds by phase, last step ({options['steps'] - 1}):",
              f"{'mode':<16}{'rank':>5}" + "".join(f"{p:>14}" for p in PHASES)]  # fmt: skip
    for row in last:
        for rank, phases in enumerate(row["phases"]):
            lines.append(
                f"{row['mode']:<16}{rank:>5}" + "".join(f"{phases.get(p, float('nan')):>14.4f}" for p in PHASES)
            )
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path) -> None:
    """Step time per step by mode, and the last step's time by phase per rank and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(row["mode"] for row in report["steps"]))
    fig, (steps_ax, phases_ax) = plt.subplots(1, 2, figsize=(12, 4))
    for mode in modes:
        rows = [row for row in report["steps"] if row["mode"] == mode]
        steps_ax.plot([row["step"] for row in rows], [row["step_s"] for row in rows], "o-", label=mode)
    steps_ax.set(xlabel="step", ylabel="measured step s (slowest rank)", title="step time")
    steps_ax.legend(fontsize=8)
    last = [row for row in report["steps"] if row["step"] == report["options"]["steps"] - 1]
    ranks = report["options"]["ranks"]
    width = 0.8 / ranks
    colors = dict(zip(PHASES, ("0.85", "0.7", "0.55", "0.4", "tab:orange", "tab:red", "tab:blue", "tab:green"),
                      strict=True))  # fmt: skip
    for m, row in enumerate(last):
        for rank, phases in enumerate(row["phases"]):
            bottom = 0.0
            for phase in PHASES:
                value = phases.get(phase, 0.0)
                phases_ax.bar(m + (rank - (ranks - 1) / 2) * width, value, width * 0.9, bottom=bottom,
                              color=colors[phase], label=phase if (m, rank) == (0, 0) else None)  # fmt: skip
                bottom += value
    phases_ax.set_xticks(range(len(last)), [row["mode"] for row in last])
    phases_ax.set(ylabel="seconds (bars: ranks)", title="last step by phase and rank")
    phases_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m.partition("@")[0] not in MODES]
    if unknown or "off" not in modes or len(set(modes)) < len(modes):
        raise ValueError(f"--modes {args.modes!r}: choose among {', '.join(MODES)}, each once, including off (the "
                         "baseline); knapformer and refine may name a topology, e.g. knapformer@g1n2")  # fmt: skip
    built = {}  # the topologies of the modes that have one, by name: refused before the ranks start
    for mode in modes:
        solver, _, own_topology = mode.partition("@")
        if own_topology and solver not in ("knapformer", "refine"):
            raise ValueError(f"--modes: {mode!r}: only knapformer and refine run on a topology of their own")
        if own_topology:
            built[own_topology] = build_topology(own_topology, args.ranks)
    if args.ranks < 1 or args.steps < 2 or args.token_scale <= 0:
        raise ValueError(f"need --ranks >= 1, --steps >= 2, --token-scale > 0; got {args.ranks}, {args.steps}, "
                         f"{args.token_scale}")  # fmt: skip
    if args.slow_rank is not None and (args.slow_rank[0] >= args.ranks or torch.cuda.is_available()):
        raise ValueError(f"--slow-rank {args.slow_rank[0]}:{args.slow_rank[1]:g} needs a rank below --ranks "
                         f"{args.ranks}, on CPU ranks (it sleeps on the host)")  # fmt: skip
    topology = args.topology or f"g{args.ranks}n1"
    if any(mode in ("knapformer", "refine") for mode in modes):  # the modes without a topology of their own
        built[topology] = build_topology(topology, args.ranks)  # one the ranks cannot form is refused now
    if args.flux_dims and args.family != "flux":
        raise ValueError("--flux-dims sets FLUX.1's width: it goes with --family flux")
    heads = 24 if args.flux_dims else spec(args.family).tiny_config["num_attention_heads"]
    for name, built_topology in sorted(built.items()):  # a head per GPU: refused in every rank otherwise
        if not built_topology.elastic and (largest := max(built_topology.bag_sizes)) > heads:
            raise ValueError(f"--topology {name}: bags of {largest} GPUs, but the model has {heads} attention heads "
                             "(Ulysses needs one per GPU); give smaller bags, or --ranks of at most the heads")  # fmt: skip
    spec(args.family).hooks().check_arguments(TrainingArguments(None, family=args.family, expert=args.expert))
    cost_model = {"model": f"{args.family}-tiny"}
    if args.calibration:
        cost_model = {"calibration_file": str(Path(args.calibration).resolve())}
    if args.startup_calibration:
        lengths = calibration_lengths(args.mix or spec(args.family).default_mix, args.ranks, args.token_scale)
        cost_model["startup_calibration"] = {"enabled": True, "seq_lens": lengths}
    if args.route_coef:
        cost_model["route_coef"] = args.route_coef
    for mode in modes:  # each mode's block as its ranks will read it (knapformer on auto, say), before they start
        try:
            get_knapformer_config(ds_config(mode, topology, args.ranks, cost_model, args.online))
        except ValueError as error:
            default = "" if args.modes != DEFAULT_MODES else " (the default --modes; give --modes to choose others)"
            raise ValueError(f"--modes {mode}{default} on --topology {topology}: {error}") from None
    if args.calibration:
        read_calibration(args.calibration)  # a missing or incomplete file, named, before the ranks start
    mix = args.mix or spec(args.family).default_mix
    options = {"ranks": args.ranks, "family": args.family, "mix": mix, "token_scale": args.token_scale, "steps": args.steps,
               "modes": modes, "topology": topology, "slow_rank": args.slow_rank,
               "online": args.online, "flux_dims": args.flux_dims, "threads": args.threads, "prefetch": args.prefetch,
               "cost_model": cost_model, "expert": args.expert}  # fmt: skip
    report = bench_train(options)
    print(format_report(report))
    write_report(report, args.json, "per-step, per-rank figures", args.plot, plot_report)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=positive_int, default=2, help="local processes (one GPU each on CUDA)")
    add_family_argument(parser, "the tiny model trained (its spec's tiny_config)")
    add_mix_argument(parser, None)  # default: the family's default_mix
    parser.add_argument(
        "--token-scale", type=positive_float, default=1 / 16, help="scale the mix's lengths (CPU: small)"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=6,
        help="training steps per mode (the first is not summarised); the modes run interleaved step by step, in "
        "carryover-balanced orders (1 + a multiple of twice the mode count balances them)",
    )
    parser.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated, from " + ", ".join(
        ["off", "knapformer", "refine", "auto"]) + "; knapformer@TOPOLOGY (refine too) runs it on that topology")  # fmt: skip
    parser.add_argument(
        "--topology", default=None, help="bags of knapformer and refine (default: one bag of all ranks)"
    )
    parser.add_argument("--slow-rank", type=parse_slow_rank, default=None, metavar="R:F",
                       help="rank R computes F times slower (CPU ranks)")  # fmt: skip
    parser.add_argument("--online", action="store_true", help="refit the cost model online (not knapformer)")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                        help="solve each step's plan a step ahead in the worker process, as examples/train_dit.py "
                             "does (default); --no-prefetch solves in the step")  # fmt: skip
    parser.add_argument("--calibration", metavar="FILE.json", help="cost model from deepspeed-knap calibrate")
    parser.add_argument("--startup-calibration", action="store_true",
                        help="the cost model's startup_calibration at the mix's lengths (10th, 50th, 90th "
                        "percentile and longest), in every mode")  # fmt: skip
    parser.add_argument("--route-coef", type=positive_float, default=None, metavar="S",
                        help="seconds of one moved token's round trip: the planner prices routes (default: free)")  # fmt: skip
    parser.add_argument("--flux-dims", action="store_true", help="FLUX.1 width: 24 heads of 128 (GPUs)")
    parser.add_argument("--expert", choices=["both", "high", "low"], default=None,
                        help="Wan 2.2 A14B's experts, as examples/train_dit.py --expert trains them: both (two tiny "
                             "experts, each sample's noise level picks its own; boundary_ratio 0.875), or one")  # fmt: skip
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    parser.add_argument("--json", type=output_file, metavar="OUT.json", help="write every per-step, per-rank figure")
    parser.add_argument(
        "--plot", type=plot_file, metavar="OUT.png", help="step times and the last step's phases per rank"
    )
