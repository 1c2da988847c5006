"""``deepspeed-knap plan``: solve one step of a bundled data mix (or lengths from a JSON file) with
every solver and compare them: modeled step time, imbalance, distance to the lower bound, speedup over
no balancing, tokens moved, the most tokens on one GPU, and solve time. ``--topology auto`` gives every
sequence its own Ulysses degree; a fixed topology such as ``g8n4`` puts every sequence in one bag of
its bags. Pure NumPy: it never imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import stat
import sys

from deepspeed_knap.cost.model import DEFAULT_ALLTOALL_GBPS, DEFAULT_TFLOPS
from deepspeed_knap.models.registry import PRESETS, SPECS, default_cost_model, sample_mix, sample_segments
from deepspeed_knap.options import (
    add_mix_argument,
    gpu_count,
    int_at_least,
    nonnegative_int,
    plot_file,
    positive_float,
    positive_int,
)
from deepspeed_knap.planner import DEFAULT_SOLVER, SOLVERS, RoutingPlan, lower_bound
from deepspeed_knap.planner.solve import timed_plan
from deepspeed_knap.planner.topology import AUTO, MAX_GPUS, build_topology

HELP = "solve one step and compare solvers"

# The most sequences `plan` solves in a step: the slowest case measured at it (2-core CPU; topology
# auto, refine, per solve; --repeat solves each solver that many times) is all 65,536 on 2 GPUs, 23 s;
# on 8 GPUs 5.9 s; --mix kf_image_video over 16,384 GPUs (45,568) 6.1 s; fixed bags under 1 s. 2**17
# took 87 s on 2 GPUs and 2**20 ran past 280 s. The planner itself takes up to 2**20 (problem.py).
MAX_PLAN_SEQUENCES = 2**16
# Solves per solver: each repeats the whole solve.
MAX_REPEAT = 100
# A --lengths file's most bytes: 65,536 lengths of up to 13 digits, separated and indented, in 16,384
# ranks' lists fill ~2 MiB.
MAX_LENGTHS_BYTES = 16 * 2**20


def parse_model(text: str) -> dict[str, float]:
    """A preset (``flux-dev``, ``wan2.1-14b``, ...: every family's), or ``key=number`` dims over the
    first preset of the family whose presets have those keys and the fewest others (FLUX's
    ``hidden=3072,double_blocks=19,single_blocks=38[,mlp_ratio=4]`` over ``flux-dev``, Wan's
    ``dim=5120,ffn_dim=13824,num_heads=40,num_layers=40[,text_len=512]`` over ``wan2.1-14b``,
    Qwen-Image's ``hidden``, ..., ``num_heads`` over ``qwen-image``, not FLUX.3's ``flux3``, whose
    ``mode_blocks`` they lack); ties go to the family registered first."""
    if text in PRESETS:
        return dict(PRESETS[text][1])
    items = [item.partition("=") for item in text.split(",")]
    given = {key.strip() for key, _, _ in items}
    bases = [next(iter(family.presets.values())) for family in SPECS.values() if family.presets]
    base = min((dims for dims in bases if given <= set(dims)), key=len, default=None)  # min keeps the first of ties
    dims = dict(base or {})
    for key, sep, value in items:
        number = value.strip()
        if base is None or not sep or not re.fullmatch(r"\d+(\.\d+)?", number):
            keys = "; ".join(f"{family.title}'s {', '.join(next(iter(family.presets.values())))}"
                             for family in SPECS.values() if family.presets)  # fmt: skip
            raise argparse.ArgumentTypeError(
                f"bad --model {text!r}: give a preset ({', '.join(PRESETS)}), or key=number pairs of one "
                f"family's dims ({keys})"
            )
        dims[key.strip()] = float(number) if "." in number else int(number)
    return dims


def load_lengths(path: str) -> list[list[int]]:
    """A JSON list with one list of sequence lengths per rank: a regular file of at most
    ``MAX_LENGTHS_BYTES``, at most ``MAX_GPUS`` ranks and ``MAX_PLAN_SEQUENCES`` sequences.

    Raises:
        ValueError: an unreadable file, not a regular file (a device, a pipe: never read), too large,
            or another shape (the CLI exits 2 with the message).
    """
    try:
        # Non-blocking: opening a FIFO for reading would wait for a writer. Nothing is read before
        # the descriptor is known to be a regular file's.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"--lengths {path} is not a regular file; give a JSON file")
            text = file.read(MAX_LENGTHS_BYTES + 1)
        if len(text) > MAX_LENGTHS_BYTES:
            raise ValueError(
                f"--lengths {path} is over {MAX_LENGTHS_BYTES // 2**20} MiB, more than {MAX_PLAN_SEQUENCES:,} "
                "sequences take; give one step's lengths"
            )
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read --lengths {path}: {error}") from None
    if not isinstance(data, list) or not all(isinstance(rank, list) for rank in data):
        raise ValueError(
            f"--lengths {path} must hold a JSON list with one list of lengths per rank, e.g. [[4096, 256], [], "
            f"[16384]]; got {json.dumps(data)[:80]}"
        )
    if len(data) > MAX_GPUS:
        raise ValueError(f"--lengths {path} holds {len(data):,} ranks' lists, over {MAX_GPUS:,}, the most GPUs a "
                         "balance group may have")  # fmt: skip
    _check_sequence_count(sum(map(len, data)), f"--lengths {path}")
    return data


def _check_sequence_count(count: int, source: str) -> None:
    """Refuse a step of more than ``MAX_PLAN_SEQUENCES`` sequences before solving it."""
    if count > MAX_PLAN_SEQUENCES:
        raise ValueError(
            f"{source} gives {count:,} sequences, over {MAX_PLAN_SEQUENCES:,}, the most `plan` solves (at the cap a "
            "solve takes up to ~25 s); give fewer GPUs or a smaller step"
        )


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


def run(args: argparse.Namespace) -> int:
    lengths = load_lengths(args.lengths) if args.lengths else None
    auto = args.topology.strip() == AUTO
    if args.max_degree is not None and not auto:
        raise ValueError(f"--max-degree {args.max_degree} applies to --topology auto only")
    if args.max_tokens_per_gpu is not None and args.solver not in ("all", "refine"):
        raise ValueError(f"--max-tokens-per-gpu {args.max_tokens_per_gpu} applies to solver refine, which --solver "
                         f"{args.solver} does not run; use --solver refine (or all), or drop the cap")  # fmt: skip
    num_gpus = len(lengths) if lengths is not None else args.gpus
    topology = build_topology(args.topology, num_gpus if auto else None, args.gpus_per_node, args.max_degree)
    # Training lays copies of a balance group back to back: a copy that starts mid-node can cross one.
    node_aligned = topology.elastic or topology.gpus_per_node is None or build_topology(
        args.topology, math.lcm(topology.group_size, topology.gpus_per_node), topology.gpus_per_node).node_aligned  # fmt: skip
    if lengths is not None:
        source = args.lengths
    else:
        lengths, source = (
            sample_mix(args.mix, topology.group_size, args.seed),
            f"{args.mix} (seed {args.seed})",
        )
        _check_sequence_count(sum(map(len, lengths)), f"--mix {args.mix} over {topology.group_size:,} GPUs")
    cost_model = default_cost_model(args.model, tflops=args.tflops, alltoall_gbps=args.alltoall_gbps)
    # A model with blocks that attend by segment (flux3) prices a mix's samples by their segments
    # (text, image, references); --lengths files carry none.
    segments = None
    if args.lengths is None and cost_model.segment_attention_share:
        segments = sample_segments(args.mix, topology.group_size, args.seed)
        source += ", priced by segment"
    available = [s for s in SOLVERS if not (auto and s == "knapformer")]  # knapformer needs fixed bags
    solvers = available if args.solver == "all" else sorted({"none", args.solver}, key=SOLVERS.index)
    plans, timings = {}, {}
    for solver in solvers:
        # The baselines cannot honour a cap: they are shown without it, to compare against.
        cap = args.max_tokens_per_gpu if solver == "refine" else None
        plans[solver], timings[solver] = timed_plan(lengths, topology, cost_model, solver, cap, args.repeat, segments)
    baseline = plans["none"]
    report = {
        "topology": topology.spec,
        "num_gpus": topology.group_size,
        "max_degree": topology.max_degree,
        "lengths": source,
        "num_sequences": int(baseline.seq_lens.size),
        "num_tokens": int(baseline.seq_lens.sum()),
        "max_tokens_per_gpu": args.max_tokens_per_gpu,
        "node_aligned": node_aligned,
        "flexible_lower_bound": _flexible_bound(lengths, topology, cost_model, args.max_tokens_per_gpu, segments),
        "solvers": {name: _summary(plan, baseline, timings[name]) for name, plan in plans.items()},
    }
    if args.plot:
        from deepspeed_knap.plots import plot_loads

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
    flexible = report["flexible_lower_bound"]
    flexible = "n/a (such groups cannot hold every sequence under the cap)" if flexible is None else f"{flexible:.4g} s"
    print(f"lower bound on the modeled step: {bound:.4g} s; with every sequence free to pick its "
          f"Ulysses degree (auto): {flexible}")  # fmt: skip
    if not node_aligned:
        print(f"note: bags cross node boundaries (nodes of {topology.gpus_per_node} GPUs) here, priced at the inter-"
              "node all-to-all; a training config with this topology is refused: use bags that divide the node, or "
              "whole nodes")  # fmt: skip
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


def _flexible_bound(lengths, topology, cost_model, cap, segments=None) -> float | None:
    """The modeled step time no plan can beat when every sequence may pick its own group of 1, 2, 4, ...
    GPUs up to the largest bag, within a node (the lower bound of topology ``auto`` on the same GPUs;
    for ``auto`` itself, its own, groups of whole nodes included); ``None`` when such groups cannot
    hold some sequence under the cap ``cap`` (only a bag of another size, or across nodes, can)."""
    if topology.elastic:
        return lower_bound(lengths, topology, cost_model, cap, segments)
    largest = min(max(topology.bag_sizes), topology.gpus_per_node or topology.group_size)  # auto stays in nodes
    elastic = build_topology(AUTO, topology.group_size, topology.gpus_per_node, 1 << (largest.bit_length() - 1))
    try:
        return lower_bound(lengths, elastic, cost_model, cap, segments)
    except ValueError:  # the cap: the report's extra line, not a reason to refuse a plan that fits
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", default="g8n4", help="auto, or bags such as g8n4 or g1n8+g2n4")
    parser.add_argument(
        "--gpus", type=gpu_count, default=32, help=f"GPUs of topology auto (with --mix), at most {MAX_GPUS:,}"
    )
    parser.add_argument("--max-degree", type=gpu_count, default=None,
                        help="topology auto: the largest group (8, or the node if smaller, when not given); "
                             "above the node, groups of whole nodes for sequences the cap keeps out of a node")  # fmt: skip
    source = parser.add_mutually_exclusive_group()
    add_mix_argument(source, "kf_image_video")
    source.add_argument("--lengths", metavar="FILE.json", help="JSON list of per-rank lists of sequence lengths")
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the bundled data mix")
    parser.add_argument("--solver", default="all", choices=["all", *SOLVERS],
                        help=f"'all', or one solver to run next to 'none' ('{DEFAULT_SOLVER}' is the one training uses)")  # fmt: skip
    parser.add_argument("--model", type=parse_model, default="flux-dev",
                        help=f"a preset ({', '.join(PRESETS)}) or dims: FLUX's hidden=3072,double_blocks=19,"
                             "single_blocks=38,mlp_ratio=4, or Wan's dim=,ffn_dim=,num_heads=,num_layers=,text_len=")  # fmt: skip
    parser.add_argument("--tflops", type=positive_float, default=DEFAULT_TFLOPS, help="sustained TFLOP/s per GPU")
    parser.add_argument(
        "--alltoall-gbps",
        type=positive_float,
        default=DEFAULT_ALLTOALL_GBPS,
        help="per-GPU all-to-all GB/s inside a bag",
    )
    parser.add_argument(
        "--gpus-per-node", type=gpu_count, default=None, help="keep bags inside nodes of this many GPUs"
    )
    parser.add_argument(
        "--max-tokens-per-gpu", type=positive_int, default=None, help="hard memory cap on routed tokens"
    )
    parser.add_argument("--repeat", type=int_at_least(1, MAX_REPEAT), default=5,
                        help=f"solves per solver (at most {MAX_REPEAT}); the median time is reported")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--plot", type=plot_file, metavar="OUT.png", help="write per-GPU loads before and after")
