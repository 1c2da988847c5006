"""Measured step time, balanced against unbalanced, emulating the ranks of a balance group on one device.

    deepspeed-knap bench step --topology g4n2 --mix kf_image_video              # CPU, small dims
    deepspeed-knap bench step --topology g8n1 --flux-dims --dtype bfloat16 --token-scale 1   # one GPU

Each step samples the group's sequence lengths (scaled by ``--token-scale``) and plans them twice:
``none`` and ``--solver``, under a cost model whose ``a, b`` are calibrated on this device
(``--calibration FILE``, else measured first on the same blocks over lengths spanning the step's)
and whose all-to-all term ``c`` comes from the bandwidth model (``--alltoall-gbps``). Then, for every
emulated rank, it builds exactly the tokens that plan gives the rank and times forward + backward of
one FLUX double-stream and one single-stream block on them (median of ``--repeats``), weighted by
the model's block counts. The measured step time is the max over ranks.

A bag is emulated without communication: a member runs its projections, modulation and MLP on its
own chunks, and attention over its bags' whole sequences on its share of the heads (its own q, k, v
repeated to the full length: the kernel gets the shapes a real all-to-all would deliver). So the
measured times are compute only. Communication is reported separately, *from the bandwidth model,
not measured*: the Ulysses all-to-alls (the model's ``c`` term) and the route + reverse route of the
moved token states, forward and backward, at ``--alltoall-gbps`` per GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from deepspeed_knap.cost.calibrate import calibrate, read_calibration
from deepspeed_knap.cost.model import DEFAULT_ALLTOALL_GBPS, CostModel, degree_efficiency_pairs
from deepspeed_knap.models.flux.calibrate import FluxBlockTimer, flux_blocks_step
from deepspeed_knap.models.registry import sample_shapes
from deepspeed_knap.options import (
    add_mix_argument,
    device,
    flux_head_dim,
    nonnegative_int,
    output_file,
    plot_file,
    positive_float,
    positive_int,
)
from deepspeed_knap.planner import SOLVERS
from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.solve import DEFAULT_SOLVER, plan_loads, plan_routing
from deepspeed_knap.planner.topology import AUTO, build_topology
from deepspeed_knap.plots import write_report
from deepspeed_knap.runtime.emulation import emulated_rank_batch

HELP = "measured step time of emulated ranks, balanced against not"


def scaled_lengths(mix: str, num_gpus: int, seed: int, token_scale: float) -> tuple[list[list[int]], np.ndarray]:
    """Per-rank sequence lengths of one step scaled by ``token_scale`` (at least one visual token per
    sample: :meth:`~deepspeed_knap.data.mixes.SampleShape.scaled`), and ``[N]`` text tokens
    of each sequence in plan order."""
    shapes = [[shape.scaled(token_scale) for shape in rank] for rank in sample_shapes(mix, num_gpus, seed)]
    lengths = [[shape.length for shape in rank] for rank in shapes]
    return lengths, np.array([shape.text for rank in shapes for shape in rank], dtype=np.int64)


def route_seconds(plan: RoutingPlan, dim: int, bytes_per_element: int, gbps: float) -> float:
    """Bandwidth-model seconds of the route and reverse route, forward and backward: four exchanges
    of the moved token states, each as slow as the GPU that sends or receives the most."""
    home = np.repeat(plan.seq_src_rank, np.diff(plan.chunk_offsets))
    moved = plan.chunk_gpu != home
    sent = np.bincount(home[moved], weights=plan.chunk_len[moved], minlength=plan.num_gpus)
    received = np.bincount(plan.chunk_gpu[moved], weights=plan.chunk_len[moved], minlength=plan.num_gpus)
    busiest = max(sent.max(initial=0), received.max(initial=0))
    return 4 * busiest * dim * bytes_per_element / (gbps * 1e9)


def measure_plan(plan: RoutingPlan, text_lens: np.ndarray, timer: FluxBlockTimer, compute: CostModel,
                 overhead_s: float, comm: CostModel, bytes_per_element: int, gbps: float) -> dict:  # fmt: skip
    """Measured and modeled per-rank seconds of one plan.

    Args:
        compute: the calibrated model without the all-to-all term (what the emulation measures).
        overhead_s: the calibrated per-step overhead, modeled on every rank that holds tokens.
        comm: ``compute`` with the bandwidth model's all-to-all term (their difference is the
            modeled Ulysses time).
    """
    measured = np.array([
        timer(emulated_rank_batch(plan, gpu, text_lens, timer.dim, timer.device, timer.dtype))
        for gpu in range(plan.num_gpus)
    ])  # fmt: skip
    compute_s = plan_loads(plan, compute)
    ulysses = plan_loads(plan, comm) - compute_s
    modeled = compute_s + overhead_s * (plan.gpu_tokens > 0)
    busy = measured > 0
    error = (modeled[busy] - measured[busy]) / measured[busy]
    return {
        "solver": plan.solver,
        "tokens": plan.gpu_tokens.tolist(),
        "measured_s": measured.tolist(),
        "modeled_s": modeled.tolist(),
        "measured_step_s": float(measured.max()),
        "measured_imbalance": float(measured.max() / measured.mean()) if measured.mean() > 0 else 1.0,
        "modeled_step_s": float(modeled.max()),
        "modeled_imbalance": float(modeled.max() / modeled.mean()) if modeled.mean() > 0 else 1.0,
        "median_abs_error": float(np.median(np.abs(error))) if error.size else 0.0,
        "max_abs_error": float(np.abs(error).max(initial=0.0)),
        "ulysses_comm_s": float(ulysses.max(initial=0.0)),
        "route_comm_s": route_seconds(plan, timer.dim, bytes_per_element, gbps),
    }


def calibrate_here(timer: FluxBlockTimer, seq_lens: Sequence[int], repeats: int) -> dict:
    """Fit ``overhead + a*s + b*s^2`` on this device, one sequence at a time, at geometric lengths
    spanning ``seq_lens``. Returns the calibration (``linear_coef``, ``quadratic_coef``,
    ``overhead_s``, fit quality)."""
    lo, hi = max(16, min(seq_lens)), max(max(seq_lens), 32)
    grid = sorted({round(x) for x in np.geomspace(lo, hi, 6)})
    step = flux_blocks_step(timer.heads, timer.head_dim, timer.double_blocks, timer.single_blocks,
                            str(timer.device), timer.dtype, timer.backend)  # fmt: skip
    model, _, fit = calibrate(step, grid, repeats)
    return {"linear_coef": model.linear_coef, "quadratic_coef": model.quadratic_coef, "seq_lens": grid, **fit}


def bench_step(
    topology_spec: str,
    mix: str,
    steps: int,
    timer: FluxBlockTimer,
    token_scale: float,
    solver: str = DEFAULT_SOLVER,
    calibration: dict | None = None,
    alltoall_gbps: float = DEFAULT_ALLTOALL_GBPS,
    num_gpus: int = 8,
) -> dict:
    """Measure ``steps`` steps under ``none`` and ``solver``; see the module docstring.

    Args:
        num_gpus: emulated GPUs of topology ``auto`` (a fixed topology has its own count).
        calibration: ``linear_coef``, ``quadratic_coef`` and optionally ``overhead_s`` and
            ``degree_efficiency`` (``[[G, efficiency], ...]``), as ``deepspeed-knap calibrate`` writes
            them; ``None`` calibrates on the first step's lengths.

    Returns:
        ``{"calibration": ..., "steps": [{"seed", "none": measure_plan(...), solver: ...}, ...]}``.
    """
    if solver == "none":
        raise ValueError("--solver none would compare no balancing with itself; choose knapformer or refine")
    topology = build_topology(topology_spec, num_gpus if topology_spec.strip() == AUTO else None)
    if max(topology.bag_sizes) > timer.heads:
        raise ValueError(f"topology {topology_spec!r} has bags of {max(topology.bag_sizes)} GPUs but the blocks have "
                         f"{timer.heads} heads; give --heads >= the largest bag")  # fmt: skip
    bytes_per_element = torch.finfo(timer.dtype).bits // 8
    alltoall_coef = CostModel.from_model_dims(timer.dim, timer.double_blocks, timer.single_blocks,
                                                  alltoall_gbps=alltoall_gbps,
                                                  bytes_per_element=bytes_per_element).alltoall_coef  # fmt: skip
    calibration = None if calibration is None else {"source": "given", **calibration}
    results = []
    for seed in tqdm(range(steps), desc="bench step", unit="step"):
        seq_lens, text_lens = scaled_lengths(mix, topology.group_size, seed, token_scale)
        if calibration is None:
            calibration = calibrate_here(timer, [s for rank in seq_lens for s in rank], timer.repeats)
            calibration["source"] = "measured here"
        try:  # the bag efficiency training's planner uses: the plan and the modeled seconds here use it too
            efficiency = degree_efficiency_pairs(calibration.get("degree_efficiency"))
        except ValueError as error:
            raise ValueError(f"--calibration: {error}") from None
        compute = CostModel(calibration["linear_coef"], calibration["quadratic_coef"], degree_efficiency=efficiency)
        comm = dataclasses.replace(compute, alltoall_coef=alltoall_coef)
        overhead_s = calibration.get("overhead_s", 0.0)
        row = {"seed": seed, "tokens": int(sum(map(sum, seq_lens)))}
        for name in ("none", solver):
            plan = plan_routing(seq_lens, topology, comm, name)
            row[name] = measure_plan(plan, text_lens, timer, compute, overhead_s, comm, bytes_per_element,
                                     alltoall_gbps)  # fmt: skip
        results.append(row)
    return {"topology": topology_spec, "mix": mix, "solver": solver, "token_scale": token_scale,
            "calibration": calibration, "steps": results}  # fmt: skip


def format_report(report: dict) -> str:
    solver = report["solver"]
    lines = [
        f"{report['topology']}, {report['mix']} x{report['token_scale']:g} tokens; model a = "
        f"{report['calibration']['linear_coef']:.3g} s/token, b = {report['calibration']['quadratic_coef']:.3g} "
        f"s/token^2, overhead {report['calibration'].get('overhead_s', 0.0):.3g} s ({report['calibration']['source']})",
        "",
        f"{'step':>4} {'plan':<11}{'measured s':>11}{'imbalance':>10}{'modeled s':>10}{'imbalance':>10}"
        f"{'err med':>8}{'err max':>8}{'ulysses s*':>11}{'route s*':>9}",
    ]
    speedups = []
    for row in report["steps"]:
        for name in ("none", solver):
            m = row[name]
            lines.append(
                f"{row['seed']:>4} {name:<11}{m['measured_step_s']:>11.4g}{m['measured_imbalance']:>10.3f}"
                f"{m['modeled_step_s']:>10.4g}{m['modeled_imbalance']:>10.3f}{m['median_abs_error']:>8.1%}"
                f"{m['max_abs_error']:>8.1%}{m['ulysses_comm_s']:>11.3g}{m['route_comm_s']:>9.3g}"
            )
        none, ours = row["none"], row[solver]
        speedups.append(
            (none["measured_step_s"] / ours["measured_step_s"], none["modeled_step_s"] / ours["modeled_step_s"])
        )
        lines.append(f"     measured speedup {speedups[-1][0]:.2f}x (modeled {speedups[-1][1]:.2f}x)")
    measured, modeled = np.median(np.array(speedups), axis=0)
    lines += ["", f"median over {len(speedups)} steps: measured speedup {measured:.2f}x, modeled {modeled:.2f}x",
              "* modeled from bandwidth, not measured: compute times above exclude all communication", ""]  # fmt: skip
    lines += _per_rank_lines(report["steps"][-1], ("none", solver))
    return "\n".join(lines)


def _per_rank_lines(row: dict, names: tuple[str, str]) -> list[str]:
    """Tokens, measured and modeled seconds and the model's error of every rank, one step."""
    lines = [f"per rank, step {row['seed']}:", f"{'rank':>4}" + "".join(
        f"{name + ' tokens':>16}{'measured s':>11}{'modeled s':>10}{'error':>8}" for name in names)]  # fmt: skip
    for rank in range(len(row["none"]["tokens"])):
        cells = []
        for name in names:
            m = row[name]
            measured, modeled = m["measured_s"][rank], m["modeled_s"][rank]
            error = f"{(modeled - measured) / measured:+8.1%}" if measured > 0 else f"{'-':>8}"
            cells.append(f"{m['tokens'][rank]:>16,}{measured:>11.4g}{modeled:>10.4g}{error}")
        lines.append(f"{rank:>4}" + "".join(cells))
    return lines


def plot_report(report: dict, path: str | Path) -> None:
    """Per-rank measured and modeled seconds of the last step, a panel per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = report["steps"][-1]
    names = ("none", report["solver"])
    fig, axes = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, sharey=True)
    for ax, name in zip(axes, names, strict=True):
        m = row[name]
        ranks = np.arange(len(m["measured_s"]))
        ax.bar(ranks - 0.2, m["measured_s"], 0.4, label="measured (compute)")
        ax.bar(ranks + 0.2, m["modeled_s"], 0.4, label="modeled overhead + a*s + b*s^2")
        ax.set_title(f"{name}: measured step {m['measured_step_s']:.3g} s, imbalance {m['measured_imbalance']:.3f}",
                     fontsize=10, loc="left")  # fmt: skip
        ax.set_ylabel("seconds")
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("emulated rank")
    fig.suptitle(f"{report['topology']}, {report['mix']} (seed {row['seed']})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.repeats < 1 or args.token_scale <= 0:
        raise ValueError(f"--steps and --repeats must be >= 1 and --token-scale > 0; got {args.steps}, "
                         f"{args.repeats}, {args.token_scale}")  # fmt: skip
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    heads, head_dim = (24, 128) if args.flux_dims else (args.heads, args.head_dim)
    timer = FluxBlockTimer(heads, head_dim, args.double_blocks, args.single_blocks, device,
                           getattr(torch, args.dtype), args.backend, args.repeats)  # fmt: skip
    calibration = None
    if args.calibration:
        read_calibration(args.calibration)  # a file without its coefficients: a ValueError naming it
        data = json.loads(Path(args.calibration).read_text())
        keys = ("linear_coef", "quadratic_coef", "overhead_s", "degree_efficiency")
        calibration = {key: data[key] for key in keys if key in data}
    report = bench_step(args.topology, args.mix, args.steps, timer, args.token_scale, args.solver,
                        calibration, args.alltoall_gbps, args.gpus)  # fmt: skip
    report["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report["dims"] = f"{heads}x{head_dim} heads, {args.double_blocks}+{args.single_blocks} blocks, {args.dtype}"
    print(f"{report['device']}, {report['dims']}")
    print(format_report(report))
    write_report(report, args.json, "per-rank figures", args.plot, plot_report)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", default="g4n2", help="auto, or bags of the emulated balance group")
    parser.add_argument("--gpus", type=positive_int, default=8, help="emulated GPUs of topology auto")
    add_mix_argument(parser, "kf_image_video")
    parser.add_argument("--solver", default=DEFAULT_SOLVER, choices=[s for s in SOLVERS if s != "none"])
    parser.add_argument("--steps", type=positive_int, default=3, help="sampled steps (seeds 0..steps-1)")
    parser.add_argument(
        "--token-scale", type=positive_float, default=1 / 16, help="scale the mix's lengths (CPU: small)"
    )
    parser.add_argument("--heads", type=positive_int, default=8, help="attention heads (at least the largest bag)")
    parser.add_argument("--head-dim", type=flux_head_dim, default=32, help="channels per head (even)")
    parser.add_argument("--flux-dims", action="store_true", help="FLUX.1 width: 24 heads of 128 (GPU)")
    parser.add_argument("--double-blocks", type=nonnegative_int, default=19, help="double-stream blocks of the model")
    parser.add_argument("--single-blocks", type=nonnegative_int, default=38, help="single-stream blocks of the model")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per rank (median)")
    parser.add_argument("--calibration", metavar="FILE.json", help="a, b and overhead from deepspeed-knap calibrate")
    parser.add_argument(
        "--alltoall-gbps", type=positive_float, default=DEFAULT_ALLTOALL_GBPS, help="bandwidth model, per GPU, GB/s"
    )
    parser.add_argument("--device", type=device, default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--backend", default="auto", help="attention kernel (docs/integration.md, Attention kernels)")
    parser.add_argument("--json", type=output_file, metavar="OUT.json", help="write every per-rank figure")
    parser.add_argument(
        "--plot", type=plot_file, metavar="OUT.png", help="per-rank measured vs modeled seconds, last step"
    )
