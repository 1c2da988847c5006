"""``deepspeed-knap``: command-line entry point.

``deepspeed-knap plan`` solves one step of a bundled workload (or lengths from a JSON file) with
every solver and compares them: modeled step time, imbalance, distance to the lower bound, tokens
moved, memory, solve time. ``deepspeed-knap calibrate`` fits the workload model to blocks timed on
this device (:mod:`deepspeed_knap.bench.calibrate`). ``deepspeed-knap bench planner`` and ``bench step``
run the benchmarks of :mod:`deepspeed_knap.bench.planner` and :mod:`deepspeed_knap.bench.step`; their
modules import on use, so the planner commands never import torch.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from deepspeed_knap.bench.planner import timed_plan
from deepspeed_knap.planner import DEFAULT_SOLVER, SOLVERS, RoutingPlan, lower_bound
from deepspeed_knap.topology import AUTO, build_topology
from deepspeed_knap.workload import MODEL_PRESETS, default_workload
from deepspeed_knap.workloads import WORKLOADS, sample_workload

_MODEL_KEYS = ("hidden", "double_blocks", "single_blocks", "mlp_ratio")


def parse_model(text: str) -> dict[str, int]:
    """``flux-dev`` (a preset) or ``hidden=3072,double_blocks=19,single_blocks=38[,mlp_ratio=4]``."""
    if text in MODEL_PRESETS:
        return dict(MODEL_PRESETS[text])
    dims = dict(MODEL_PRESETS["flux-dev"])
    for item in text.split(","):
        key, sep, value = item.partition("=")
        number = value.strip()
        valid = number.isdigit() or (key.strip() == "mlp_ratio" and number.replace(".", "", 1).isdigit())
        if not sep or key.strip() not in _MODEL_KEYS or not valid:
            raise argparse.ArgumentTypeError(
                f"bad --model part {item!r}: give a preset ({', '.join(MODEL_PRESETS)}) or "
                f"key=int pairs with keys {', '.join(_MODEL_KEYS)} (mlp_ratio may be fractional)"
            )
        dims[key.strip()] = float(number) if key.strip() == "mlp_ratio" else int(number)
    return dims


def load_lengths(path: str) -> list[list[int]]:
    """A JSON list with one list of sequence lengths per rank.

    Raises:
        ValueError: an unreadable file or another shape (the CLI exits 2 with the message).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read --lengths {path}: {error}") from None
    if not isinstance(data, list) or not all(isinstance(rank, list) for rank in data):
        raise ValueError(
            f"--lengths {path} must hold a JSON list with one list of lengths per rank, e.g. [[4096, 256], [], "
            f"[16384]]; got {json.dumps(data)[:80]}"
        )
    return data


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _summary(plan: RoutingPlan, baseline: RoutingPlan, solve_ms: float) -> dict:
    return {
        "max_load_s": plan.max_load,
        "imbalance": plan.imbalance,
        "lower_bound": plan.lower_bound,
        "ratio_to_lower_bound": plan.max_load / plan.lower_bound if plan.lower_bound > 0 else 1.0,
        "speedup_vs_none": baseline.max_load / plan.max_load if plan.max_load > 0 else 1.0,
        "tokens_moved_fraction": plan.tokens_moved_fraction,
        "max_gpu_tokens": int(plan.gpu_tokens.max()) if plan.num_gpus else 0,
        "solve_ms": solve_ms,
        "gpu_loads": plan.gpu_loads.tolist(),
    }


def cmd_plan(args: argparse.Namespace) -> int:
    lengths = load_lengths(args.lengths) if args.lengths else None
    auto = args.topology.strip() == AUTO
    if args.max_degree is not None and not auto:
        raise ValueError(f"--max-degree {args.max_degree} applies to --topology auto only")
    num_gpus = len(lengths) if lengths is not None else args.gpus
    topology = build_topology(args.topology, num_gpus if auto else None, args.gpus_per_node, args.max_degree)
    if lengths is not None:
        source = args.lengths
    else:
        lengths, source = (
            sample_workload(args.workload, topology.group_size, args.seed),
            f"{args.workload} (seed {args.seed})",
        )
    workload = default_workload(args.model, tflops=args.tflops, alltoall_gbps=args.alltoall_gbps)
    available = [s for s in SOLVERS if not (auto and s == "knapformer")]  # knapformer needs fixed bags
    solvers = available if args.solver == "all" else sorted({"none", args.solver}, key=SOLVERS.index)
    plans, timings = {}, {}
    for solver in solvers:
        # The baselines cannot honour a cap: they are shown without it, to compare against.
        cap = args.max_tokens_per_gpu if solver == "refine" else None
        plans[solver], timings[solver] = timed_plan(lengths, topology, workload, solver, cap, args.repeat)
    baseline = plans["none"]
    report = {
        "topology": topology.spec,
        "num_gpus": topology.group_size,
        "max_degree": topology.max_degree,
        "lengths": source,
        "num_sequences": int(baseline.seq_lens.size),
        "num_tokens": int(baseline.seq_lens.sum()),
        "max_tokens_per_gpu": args.max_tokens_per_gpu,
        "flexible_lower_bound": _flexible_bound(lengths, topology, workload, args.max_tokens_per_gpu),
        "solvers": {name: _summary(plan, baseline, timings[name]) for name, plan in plans.items()},
    }
    if args.plot:
        from deepspeed_knap.bench.plots import plot_loads

        plot_loads(plans, args.plot, f"{topology.spec}, {source}", topology)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    layout = f"groups of 1 to {topology.max_degree} GPUs" if auto else _plural(topology.num_bags, "bag")
    print(
        f"topology {topology.spec}: {layout} over {topology.group_size} GPUs; lengths {source}: "
        f"{_plural(report['num_sequences'], 'sequence')}, {_plural(report['num_tokens'], 'token')}"
    )
    bound = plans.get("refine", baseline).lower_bound  # the cap's, where refine honours one
    print(f"lower bound on the modeled step: {bound:.4g} s; with every sequence free to pick its "
          f"Ulysses degree (auto): {report['flexible_lower_bound']:.4g} s")  # fmt: skip
    if args.max_tokens_per_gpu is not None and len(solvers) > 1:
        print(f"max_tokens_per_gpu={args.max_tokens_per_gpu} applies to refine; the baselines cannot honour it")
    header = f"{'solver':<11}{'step s':>9}{'imbalance':>11}{'vs bound':>10}{'speedup':>9}{'moved':>8}{'max tok/GPU':>13}{'solve ms':>10}"
    print(header)
    print("-" * len(header))
    for name, row in report["solvers"].items():
        print(
            f"{name:<11}{row['max_load_s']:>9.4g}{row['imbalance']:>11.4f}{row['ratio_to_lower_bound']:>10.4f}"
            f"{row['speedup_vs_none']:>8.2f}x{row['tokens_moved_fraction']:>8.1%}{row['max_gpu_tokens']:>13,}{row['solve_ms']:>10.2f}"
        )
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


def _flexible_bound(lengths, topology, workload, cap) -> float:
    """The modeled step time no plan can beat when every sequence may pick its own group of 1, 2, 4, ...
    GPUs up to the largest bag, within a node (the lower bound of topology ``auto`` on the same GPUs;
    for ``auto`` itself, its own, groups of whole nodes included)."""
    if topology.elastic:
        return lower_bound(lengths, topology, workload, cap)
    largest = min(max(topology.bag_sizes), topology.gpus_per_node or topology.group_size)  # auto stays in nodes
    elastic = build_topology(AUTO, topology.group_size, topology.gpus_per_node, 1 << (largest.bit_length() - 1))
    return lower_bound(lengths, elastic, workload, cap)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


PLAN_DESCRIPTION = """Solve one step of a bundled workload (or lengths from a JSON file) with every solver and
compare them: modeled step time, imbalance, distance to the lower bound, speedup over no balancing,
tokens moved, the most tokens on one GPU, and solve time. --topology auto gives every sequence its
own Ulysses degree; a fixed topology such as g8n4 puts every sequence in one bag of its bags."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepspeed-knap", description="KnapFormer-style balancing for DeepSpeed.")
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="solve one step and compare solvers", description=PLAN_DESCRIPTION,
                               formatter_class=_DefaultsHelp)  # fmt: skip
    plan.add_argument("--topology", default="g8n4", help="auto, or bags such as g8n4 or g1n8+g2n4")
    plan.add_argument("--gpus", type=int, default=32, help="GPUs of topology auto (with --workload)")
    plan.add_argument("--max-degree", type=int, default=None,
                      help="topology auto: the largest group (8, or the node if smaller, when not given); "
                           "above the node, groups of whole nodes for sequences the cap keeps out of a node")  # fmt: skip
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--workload", default="kf_image_video", choices=list(WORKLOADS), help="bundled workload")
    source.add_argument("--lengths", metavar="FILE.json", help="JSON list of per-rank lists of sequence lengths")
    plan.add_argument("--seed", type=int, default=0, help="seed of the bundled workload")
    plan.add_argument("--solver", default="all", choices=["all", *SOLVERS],
                      help=f"'all', or one solver to run next to 'none' ('{DEFAULT_SOLVER}' is the one training uses)")  # fmt: skip
    plan.add_argument("--model", type=parse_model, default="flux-dev",
                      help="preset or dims: hidden=3072,double_blocks=19,single_blocks=38,mlp_ratio=4")  # fmt: skip
    plan.add_argument("--tflops", type=float, default=400.0, help="sustained TFLOP/s per GPU")
    plan.add_argument("--alltoall-gbps", type=float, default=150.0, help="per-GPU all-to-all GB/s inside a bag")
    plan.add_argument("--gpus-per-node", type=int, default=None, help="keep bags inside nodes of this many GPUs")
    plan.add_argument("--max-tokens-per-gpu", type=int, default=None, help="hard memory cap on routed tokens")
    plan.add_argument("--repeat", type=int, default=5, help="solves per solver; the median time is reported")
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON")
    plan.add_argument("--plot", metavar="OUT.png", help="write per-GPU loads before and after")
    plan.set_defaults(func=cmd_plan)

    calibrate = commands.add_parser("calibrate", help="fit the workload model to timed blocks on this device",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    calibrate.add_argument("--out", required=True, metavar="FILE.json", help="where to write the fitted model")
    calibrate.add_argument("--seq-lens", default="256,512,1024,2048,4096", help="comma-separated lengths to time")
    calibrate.add_argument("--repeats", type=int, default=3, help="timed runs per length (median)")
    calibrate.add_argument("--callable", metavar="MODULE:FN", help="time FN(seq_len) instead of FLUX blocks")
    calibrate.add_argument("--heads", type=int, default=4, help="FLUX blocks: attention heads")
    calibrate.add_argument("--head-dim", type=int, default=32, help="FLUX blocks: channels per head")
    calibrate.add_argument("--flux-dims", action="store_true", help="FLUX.1 width: 24 heads of 128 (GPU)")
    calibrate.add_argument("--double-blocks", type=int, default=19, help="double-stream blocks of the model")
    calibrate.add_argument("--single-blocks", type=int, default=38, help="single-stream blocks of the model")
    calibrate.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    calibrate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    calibrate.add_argument("--backend", default="auto", help="attention kernel (see the README's backends)")
    calibrate.add_argument("--plot", metavar="OUT.png", help="plot measured and fitted seconds")
    calibrate.add_argument("--degrees", default=None, metavar="2,4,8",
                           help="also time emulated members of bags of these sizes and fit their efficiency")  # fmt: skip
    calibrate.set_defaults(func=cmd_calibrate)

    bench = commands.add_parser("bench", help="benchmarks: the planner suite, measured step emulation")
    benches = bench.add_subparsers(dest="bench", required=True)
    suite = benches.add_parser("planner", help="plan quality and solve time over workloads, topologies, GPU counts",
                               description=_module_doc("planner"), formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    suite.add_argument("--gpus", type=int, nargs="+", default=[32, 256, 1024], help="balance-group sizes")
    suite.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    suite.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=list(SOLVERS))
    suite.add_argument("--steps", type=int, default=20, help="sampled steps per case (seeds 0..steps-1)")
    suite.add_argument("--sensitivity", type=float, default=None, metavar="F",
                       help="also solve with the quadratic term scaled by 1-F and 1+F (e.g. 0.2)")  # fmt: skip
    suite.add_argument("--csv", metavar="OUT.csv", help="write every row")
    suite.add_argument("--plot-dir", metavar="DIR", help="write speedup.png and loads.png here")
    suite.set_defaults(func=_bench_runner("planner"))

    step = benches.add_parser("step", help="measured step time of emulated ranks, balanced against not",
                              description=_module_doc("step"), formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    step.add_argument("--topology", default="g4n2", help="auto, or bags of the emulated balance group")
    step.add_argument("--gpus", type=int, default=8, help="emulated GPUs of topology auto")
    step.add_argument("--workload", default="kf_image_video", choices=list(WORKLOADS))
    step.add_argument("--solver", default=DEFAULT_SOLVER, choices=[s for s in SOLVERS if s != "none"])
    step.add_argument("--steps", type=int, default=3, help="sampled steps (seeds 0..steps-1)")
    step.add_argument("--token-scale", type=float, default=1 / 16, help="scale the workload's lengths (CPU: small)")
    step.add_argument("--heads", type=int, default=8, help="attention heads (at least the largest bag)")
    step.add_argument("--head-dim", type=int, default=32, help="channels per head")
    step.add_argument("--flux-dims", action="store_true", help="FLUX.1 width: 24 heads of 128 (GPU)")
    step.add_argument("--double-blocks", type=int, default=19, help="double-stream blocks of the model")
    step.add_argument("--single-blocks", type=int, default=38, help="single-stream blocks of the model")
    step.add_argument("--repeats", type=int, default=3, help="timed runs per rank (median)")
    step.add_argument("--calibration", metavar="FILE.json", help="a, b and overhead from deepspeed-knap calibrate")
    step.add_argument("--alltoall-gbps", type=float, default=150.0, help="bandwidth model, per GPU, GB/s")
    step.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    step.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    step.add_argument("--backend", default="auto", help="attention kernel (see the README's backends)")
    step.add_argument("--json", metavar="OUT.json", help="write every per-rank figure")
    step.add_argument("--plot", metavar="OUT.png", help="per-rank measured vs modeled seconds, last step")
    step.set_defaults(func=_bench_runner("step"))

    routing = benches.add_parser("routing", help="bytes moved by routing and Ulysses, before and after routing less",
                                 description=_module_doc("routing"), formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    routing.add_argument("--topology", default="g1n8+g2n4+g4n2+g8n1", help="bags, or auto (on --gpus GPUs)")
    routing.add_argument("--gpus", type=int, default=32, help="GPUs of topology auto")
    routing.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    routing.add_argument("--solver", default=DEFAULT_SOLVER, choices=list(SOLVERS))
    routing.add_argument("--model", default="flux-dev", choices=["flux-dev", "flux2-dev"], help="FLUX dims")
    routing.add_argument("--steps", type=int, default=20, help="sampled steps per workload (median)")
    routing.set_defaults(func=_bench_runner("routing"))

    ahead = benches.add_parser("ahead", help="how long a step waits for its plan: solved in the step or ahead",
                               description=_module_doc("ahead"), formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ahead.add_argument("--gpus", type=int, nargs="+", default=[32, 1024], help="GPU counts of topology auto")
    ahead.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ahead.add_argument("--steps", type=int, default=10, help="sampled steps per case (median)")
    ahead.add_argument("--plot", metavar="OUT.png", help="median wait per case, both ways (log scale)")
    ahead.set_defaults(func=_bench_runner("ahead"))

    train = benches.add_parser("train", help="measured training steps on local ranks: off, knapformer, refine, auto",
                               description=_module_doc("train"), formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    train.add_argument("--ranks", type=int, default=2, help="local processes (one GPU each on CUDA)")
    train.add_argument("--workload", default="long_video", choices=list(WORKLOADS))
    train.add_argument("--token-scale", type=float, default=1 / 16, help="scale the workload's lengths (CPU: small)")
    train.add_argument("--steps", type=int, default=6, help="training steps per mode (the first is not summarised)")
    train.add_argument("--modes", default="off,knapformer,refine,auto", help="comma-separated, from " + ", ".join(
        ["off", "knapformer", "refine", "auto"]))  # fmt: skip
    train.add_argument("--topology", default=None, help="bags of knapformer and refine (default: one bag of all ranks)")
    train.add_argument("--slow-rank", type=_parse_slow_rank, default=None, metavar="R:F",
                       help="rank R computes F times slower (CPU ranks)")  # fmt: skip
    train.add_argument("--online", action="store_true", help="refit the cost model online (not knapformer)")
    train.add_argument("--calibration", metavar="FILE.json", help="cost model from deepspeed-knap calibrate")
    train.add_argument("--flux-dims", action="store_true", help="FLUX.1 width: 24 heads of 128 (GPUs)")
    train.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    train.add_argument("--json", metavar="OUT.json", help="write every per-step, per-rank figure")
    train.add_argument("--plot", metavar="OUT.png", help="step times and the last step's phases per rank")
    train.set_defaults(func=_bench_runner("train"))

    doctor_doc = ast.get_docstring(ast.parse(Path(__file__).with_name("doctor.py").read_text()))  # torch-free
    doctor = commands.add_parser("doctor", help="versions, attention kernels, a kernel check and a calibration here",
                                 description=doctor_doc, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    doctor.add_argument(
        "--out", default="doctor", metavar="DIR", help="writes doctor.json, doctor.txt, calibration.json"
    )
    doctor.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    doctor.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on CUDA, float32 on CPU")  # fmt: skip
    doctor.add_argument("--heads", type=int, default=None, help="attention heads (default: 24 on CUDA, 4 on CPU)")
    doctor.add_argument(
        "--head-dim", type=int, default=None, help="channels per head (default: 128 on CUDA, 32 on CPU)"
    )
    doctor.add_argument("--double-blocks", type=int, default=19, help="double-stream blocks of the model")
    doctor.add_argument("--single-blocks", type=int, default=38, help="single-stream blocks of the model")
    doctor.add_argument("--seq-lens", default=None, help="calibration lengths (default: 1k-16k on CUDA, 64-512 on CPU)")
    doctor.add_argument(
        "--compare-lens", default=None, help="lengths to compare kernels at (default: 4096,32768 on CUDA)"
    )
    doctor.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    doctor.set_defaults(func=cmd_doctor)
    return parser


def _parse_slow_rank(text: str):
    from deepspeed_knap.bench.train import parse_slow_rank  # torch-free module-level: imports on use

    return parse_slow_rank(text)


def _module_doc(bench: str) -> str:
    """A benchmark module's docstring, read without importing it (``bench step`` imports torch)."""
    source = Path(__file__).with_name("bench").joinpath(f"{bench}.py").read_text()
    return ast.get_docstring(ast.parse(source)) or ""


def _bench_runner(bench: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(f"deepspeed_knap.bench.{bench}").run(args)

    return run


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from deepspeed_knap.bench.calibrate import calibrate, flux_blocks_step, load_callable, write_calibration

    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    if len(set(seq_lens)) < 4 or min(seq_lens) < 1:
        raise ValueError(
            f"--seq-lens {args.seq_lens!r}: give at least 4 positive lengths to fit overhead, a and b with one to spare"
        )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    heads, head_dim = (24, 128) if args.flux_dims else (args.heads, args.head_dim)
    if args.callable:
        step, about = load_callable(args.callable), {"callable": args.callable}
    else:
        step = flux_blocks_step(heads, head_dim, args.double_blocks, args.single_blocks, device,
                                getattr(torch, args.dtype), args.backend)  # fmt: skip
        about = {"blocks": f"FLUX {args.double_blocks}+{args.single_blocks} blocks, {heads}x{head_dim} heads"}
    about.update(device=torch.cuda.get_device_name() if device.startswith("cuda") else device, dtype=args.dtype)
    model, times, fit = calibrate(step, seq_lens, args.repeats)
    degrees = [int(g) for g in args.degrees.split(",")] if args.degrees else []
    if degrees:
        if args.callable:
            raise ValueError("--degrees times emulated bag members of FLUX blocks; it cannot time a --callable")
        from deepspeed_knap.bench.step import FluxBlockTimer, calibrate_degrees

        timer = FluxBlockTimer(heads, head_dim, args.double_blocks, args.single_blocks, torch.device(device),
                               getattr(torch, args.dtype), args.backend, args.repeats)  # fmt: skip
        efficiency, by_degree = calibrate_degrees(timer, seq_lens, degrees, model, fit["overhead_s"])
        about["degree_efficiency"] = [[g, e] for g, e in efficiency.items()]
        about["degree_seconds"] = {str(g): t for g, t in by_degree.items()}
    write_calibration(args.out, model, seq_lens, times, fit, about)

    print(f"{'seq_len':>8}{'measured s':>13}{'model s':>13}{'rel err':>9}")
    for s, t in zip(seq_lens, times, strict=True):
        fitted = fit["overhead_s"] + model.linear_coef * s + model.quadratic_coef * s * s
        print(f"{s:>8}{t:>13.5g}{fitted:>13.5g}{(fitted - t) / t:>9.1%}")
    print(f"a = {model.linear_coef:.4g} s/token, b = {model.quadratic_coef:.4g} s/token^2, per-step overhead "
          f"{fit['overhead_s']:.4g} s (not used in planning); R^2 = {fit['r2']:.4f}, max rel error "
          f"{fit['max_rel_error']:.1%}; written to {args.out}")  # fmt: skip
    for degree, efficiency in about.get("degree_efficiency", []):
        print(f"bag of {degree}: a member does {efficiency:.0%} of the ideal 1/{degree} share's speed "
              f"(measured {', '.join(f'{t:.4g}' for t in about['degree_seconds'][str(degree)])} s)")  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        grid = np.linspace(0, max(seq_lens), 200)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(seq_lens, times, "o", label="measured")
        fitted = fit["overhead_s"] + model.linear_coef * grid + model.quadratic_coef * grid**2
        ax.plot(grid, fitted, label="overhead + a*s + b*s^2")
        ax.set(xlabel="sequence length (tokens)", ylabel="seconds (forward + backward)", title=about.get("blocks", ""))
        ax.legend()
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"plot written to {args.plot}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import torch

    from deepspeed_knap.doctor import run_doctor

    def lengths(text: str | None) -> list[int] | None:
        return [int(s) for s in text.split(",")] if text else None

    report = run_doctor(args.out, args.device, getattr(torch, args.dtype) if args.dtype else None, args.heads,
                        args.head_dim, args.double_blocks, args.single_blocks, lengths(args.seq_lens),
                        lengths(args.compare_lens), args.repeats)  # fmt: skip
    print((Path(args.out) / "doctor.txt").read_text(), end="")
    print(f"report written to {Path(args.out) / 'doctor.json'} and doctor.txt")
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"deepspeed-knap {args.command}: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
