"""Measured generation on local ranks: balanced against unbalanced against one diffusers pipeline call
per request, on the same request file and weights.

    deepspeed-knap bench generate --ranks 2 --plot generate.png

Spawns ``--ranks`` local processes (gloo on CPU, NCCL with one GPU each on CUDA) that generate the
request file (``--requests``, or by default an imbalanced one: lines alternate a large and a small
image, and rank ``r`` owns lines ``r``, ``r + ranks``, ...: with ``--ranks 2`` rank 0 gets every large
one, with any even number of ranks the even ranks get them) with a random tiny model of
``--family`` (FLUX.1 ``TINY_FLUX``, FLUX.2 ``TINY_FLUX2``, FLUX.3 ``TINY_FLUX3`` or Wan
``TINY_WAN``; ``--heads`` and ``--head-dim`` widen it). For Wan the large requests are clips of
``--frames`` frames, run with classifier-free guidance (two sequences per step), the small ones
one-frame images without; FLUX.3 guides every request (its default guidance, 3.5). In each mode:

* ``balanced``: ``deepspeed-knap generate``'s path: topology ``auto``, plan and route reused per set;
* ``decode-at-home``: the same, but each request decoded on its home rank (the decodes not placed);
* ``no-reuse``: the same as ``balanced``, but the plan gathered and solved, and the route prepared, every step (the
  training path): what reuse saves, per step;
* ``unbalanced``: each rank runs its own requests packed, with no communication;
* ``pipeline``: each rank calls the family's diffusers pipeline (``FluxPipeline``,
  ``Flux2Pipeline``, FLUX.3's modular ``Flux3AutoBlocks``, ``WanPipeline``) once per request it owns (the requests the balanced modes'
  intake accepts: its refusals are skipped; ``embeddings`` requests are given their embeddings).

``--ranks 1`` runs the balanced modes' path on one process (a plan of one group, routes that move
nothing): against ``unbalanced``, the balancer's own per-step cost (on a GPU at FLUX.1's width:
``--ranks 1 --heads 24 --head-dim 128 --dtype bfloat16``).

Reported per mode: images per second (all images over the slowest rank's wall time), the ranks'
busy seconds' max over their mean, each rank's
wall and busy seconds (its own work: encoding, compute less the all-to-alls and the waits in them,
scheduler steps, decoding) and CPU seconds (the process's, all threads: on a CPU shared with other
jobs the wall clock also counts their turns), and for the balanced modes the median per-step
seconds to get the plan and to route.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from deepspeed_knap.bench.train import _free_port
from deepspeed_knap.models.registry import spec
from deepspeed_knap.options import add_family_argument, output_file, plot_file, positive_int
from deepspeed_knap.plots import write_report
from deepspeed_knap.runtime.shm_buffers import remove_job_buffers

MODES = ("balanced", "decode-at-home", "no-reuse", "unbalanced", "pipeline")
BALANCED = ("balanced", "decode-at-home", "no-reuse")
HELP = "measured generation on local ranks: balanced, unbalanced, one pipeline call per request"


def imbalanced_requests(count: int, large: int, small: int, steps: tuple[int, int],
                        frames: int | None = None) -> list[dict]:  # fmt: skip
    """``count`` requests alternating a ``large`` and a ``small`` square image (pixels), steps
    alternating ``steps[0]`` and ``steps[1]`` per pair, prompts and seeds all different. With
    ``frames`` (Wan) the large ones are clips of that many frames with guidance 5.0 (two sequences),
    the small ones one-frame images with guidance 1.0 (one)."""
    requests = []
    for index in range(count):
        side = large if index % 2 == 0 else small
        request = {"id": f"r{index:03d}", "prompt": f"a picture number {index}", "height": side, "width": side,
                   "steps": steps[(index // 2) % 2], "seed": index, "max_sequence_length": 16}  # fmt: skip
        if frames is not None:
            large_clip = index % 2 == 0
            request.update(frames=frames if large_clip else 1, guidance=5.0 if large_clip else 1.0)
        requests.append(request)
    return requests


def _worker(rank: int, world: int, port: int, options: dict, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(options["threads"])
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from deepspeed_knap.generation.runner import generate, generation_balancer, take_requests
    from deepspeed_knap.models.generators import tiny_generator
    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    deepspeed.init_distributed(verbose=False)
    get_accelerator().set_device(rank)
    dist.barrier()
    unlink_own_shm_buffer(rank)
    device = torch.device(get_accelerator().current_device_name())
    dtype = getattr(torch, options["dtype"])
    config = spec(options["family"]).load("generator").tiny_config(options["heads"], options["head_dim"])
    generator = tiny_generator(options["family"], dtype, device, seed=0, config=config)
    balancers = {
        "balanced": generation_balancer(generator.model, options["max_tokens_per_gpu"], reuse=True),
        "no-reuse": generation_balancer(generator.model, options["max_tokens_per_gpu"], reuse=False),
    }
    pipe, intake = None, None
    if "pipeline" in options["modes"]:
        pipe = _reference_pipeline(generator, config)
        # The requests the balanced run accepts (the same intake, collective), refusals skipped.
        topology = balancers["balanced"].groups.topology
        intake = take_requests(options["requests"], generator, options["max_tokens_per_gpu"],
                               max(size for _, size in topology.groups))  # fmt: skip
    records = {}
    for mode in options["modes"]:
        for _ in range(options["repeats"]):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            if mode == "pipeline":
                record = _pipeline_calls(pipe, intake.mine, generator)
            else:
                balancer = balancers["balanced" if mode == "decode-at-home" else mode] if mode in BALANCED else None
                report = generate(options["requests"], generator, balancer, progress=False,
                                  max_tokens_per_gpu=options["max_tokens_per_gpu"],
                                  balance_decodes=mode != "decode-at-home")  # fmt: skip
                record = {"images": len(report.requests), "busy_s": report.busy_s, "steps": report.steps,
                          "solves": report.solves, "plan_s": report.plan_s, "route_s": report.route_s}  # fmt: skip
            get_accelerator().synchronize()
            record["wall_s"] = time.perf_counter() - start  # to this rank's end; the slowest rank's is the run's
            record["cpu_s"] = time.process_time() - cpu_start
            record.setdefault("busy_s", record["wall_s"])  # pipeline calls: all this rank's own work
            dist.barrier()
            if mode not in records or record["wall_s"] < records[mode]["wall_s"]:
                records[mode] = record  # the best of the repeats: the first pays warm-up
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()


def _reference_pipeline(generator, config: dict):
    """The family's diffusers pipeline with the generator's parts and diffusers transformers of its weights."""
    transformers = type(generator.model).pipeline_transformers(config, generator.model.state_dict())
    pipe = generator.reference_pipeline({name: transformer.to(generator.device, generator.dtype)
                                         for name, transformer in transformers.items()})  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_calls(pipe, mine: dict, generator) -> dict:
    """This rank's accepted requests (:attr:`~deepspeed_knap.generation.runner.Intake.mine`: parsed
    with the request file's directory, refusals left out), one pipeline call each, in file order, at
    the guidance ``generator`` gives each (Wan: its frames; FLUX.1: true CFG where asked)."""
    for _, request in sorted(mine.items()):
        generator.run_pipeline(pipe, request)
    return {"images": len(mine), "steps": 0, "solves": 0, "plan_s": [], "route_s": []}


def bench_generate(options: dict) -> dict:
    """Run the ranks; per mode, every rank's record."""
    with tempfile.TemporaryDirectory(prefix="knap-bench-generate-") as out_dir:
        if options["requests"] is None:
            path = Path(out_dir, "requests.jsonl")
            steps = (options["steps"], options["steps"] * 2)
            frames = options["frames"] if spec(options["family"]).video else None
            lines = imbalanced_requests(options["count"], options["large"], options["small"], steps, frames)
            path.write_text("".join(json.dumps(line) + "\n" for line in lines))
            options = {**options, "requests": str(path)}
        port = _free_port()
        try:
            mp.start_processes(_worker, args=(options["ranks"], port, options, out_dir), nprocs=options["ranks"],
                               start_method="spawn")  # fmt: skip
        finally:
            remove_job_buffers(port)  # a rank that failed before unlinking its own leaves it
        ranks = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(options["ranks"])]
    modes = {}
    for mode in options["modes"]:
        records = [rank[mode] for rank in ranks]
        wall = max(r["wall_s"] for r in records)
        images = sum(r["images"] for r in records)
        modes[mode] = {"images": images, "wall_s": wall, "images_per_s": images / wall,
                       "rank_wall_s": [r["wall_s"] for r in records], "rank_busy_s": [r["busy_s"] for r in records], "rank_cpu_s": [r["cpu_s"] for r in records],
                       "rank_images": [r["images"] for r in records], "steps": records[0]["steps"],
                       "solves": records[0]["solves"],
                       "plan_ms": _median_ms(records[0]["plan_s"]), "route_ms": _median_ms(records[0]["route_s"])}  # fmt: skip
    return {"options": {k: v for k, v in options.items() if k != "requests"}, "modes": modes}


def _median_ms(seconds: list[float]) -> float | None:
    """The median in milliseconds; ``None`` (JSON's null) for a mode that never plans or routes."""
    return statistics.median(seconds) * 1e3 if seconds else None


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_report(report: dict) -> str:
    options = report["options"]
    name = spec(options["family"]).title
    lines = [f"{options['ranks']} ranks, {options['dtype']}, {name} {options['heads']} heads x {options['head_dim']}; "
             f"best of {options['repeats']}; images/s = all images / the slowest rank's wall time", "",
             f"{'mode':<15}{'images/s':>9}{'wall s':>8}{'busy max/mean':>14}{'steps':>6}{'solves':>7}{'plan ms/step':>13}"
             f"{'route ms/step':>14}  per rank: images, busy s / wall s, CPU s"]  # fmt: skip
    base = report["modes"].get("unbalanced", {}).get("images_per_s")
    for mode, m in report["modes"].items():
        ranks = ", ".join(f"{n} {b:.2f}/{w:.2f} {c:.2f}" for n, b, w, c in zip(m["rank_images"], m["rank_busy_s"],
                          m["rank_wall_s"], m["rank_cpu_s"], strict=True))  # fmt: skip
        speedup = f" ({m['images_per_s'] / base:.2f}x)" if base else ""
        imbalance = max(m["rank_busy_s"]) / statistics.mean(m["rank_busy_s"])
        lines.append(f"{mode:<15}{m['images_per_s']:>9.2f}{m['wall_s']:>8.2f}{imbalance:>14.2f}{m['steps']:>6}{m['solves']:>7}"
                     f"{_ms(m['plan_ms']):>13}{_ms(m['route_ms']):>14}  {ranks}{speedup}")  # fmt: skip
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path) -> None:
    """Images per second by mode, and each rank's busy and waiting seconds by mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    fig, (rate_ax, ranks_ax) = plt.subplots(1, 2, figsize=(11, 4))
    rate_ax.bar(modes, [report["modes"][m]["images_per_s"] for m in modes], color="tab:blue")
    rate_ax.set(ylabel="images / s", title="throughput (slowest rank's wall time)")
    ranks = report["options"]["ranks"]
    width = 0.8 / ranks
    for index, mode in enumerate(modes):
        m = report["modes"][mode]
        for rank in range(ranks):
            x = index + (rank - (ranks - 1) / 2) * width
            busy = m["rank_busy_s"][rank]
            ranks_ax.bar(x, busy, width * 0.9, color="tab:green", label="busy" if (index, rank) == (0, 0) else None)
            ranks_ax.bar(x, m["wall_s"] - busy, width * 0.9, bottom=busy, color="0.75",
                         label="waiting or idle" if (index, rank) == (0, 0) else None)  # fmt: skip
    ranks_ax.set_xticks(range(len(modes)), modes)
    ranks_ax.set(ylabel="seconds (bars: ranks)", title="per-rank busy time of the run")
    ranks_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",")]
    if any(m not in MODES for m in modes):
        raise ValueError(f"--modes {args.modes!r}: choose among {', '.join(MODES)}")
    if args.head_dim % 2 or args.head_dim < 8:
        raise ValueError(f"--head-dim {args.head_dim}: give an even number >= 8 (RoPE rotates channel pairs)")
    if args.head_dim % 8:  # FLUX.2 splits a head over 4 RoPE axes of even size
        raise ValueError(f"--head-dim {args.head_dim}: give a multiple of 8 (every family's RoPE axes fit)")
    for name in ("large", "small"):  # the tiny VAEs' scale times the 2x2 patches: 4 px (FLUX), 16 px (Wan)
        if getattr(args, name) % 16:
            raise ValueError(f"--{name} {getattr(args, name)}: give a multiple of 16 px (the tiny VAEs and patches)")
    if (args.frames - 1) % 4:
        raise ValueError(f"--frames {args.frames}: video VAEs take 1 + a multiple of 4 frames")
    if args.requests is not None:  # read in every rank once they start: a file missing is found now
        from deepspeed_knap.generation.requests import request_lines

        request_lines(args.requests)  # a RequestFileError (a ValueError) names it
    options = {"ranks": args.ranks, "family": args.family, "frames": args.frames, "requests": args.requests,
               "count": args.count, "large": args.large,
               "small": args.small, "steps": args.steps, "modes": modes, "heads": args.heads,
               "head_dim": args.head_dim, "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats,
               "max_tokens_per_gpu": args.max_tokens_per_gpu}  # fmt: skip
    report = bench_generate(options)
    print(format_report(report))
    write_report(report, args.json, "figures", args.plot, plot_report)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=positive_int, default=2, help="local processes (one GPU each on CUDA)")
    add_family_argument(parser, "the random tiny model", having="generator")
    parser.add_argument("--requests", metavar="FILE.jsonl", help="request file (default: an imbalanced one)")
    parser.add_argument("--count", type=positive_int, default=8, help="requests of the default file")
    parser.add_argument("--large", type=positive_int, default=128, help="large images' side, pixels (default file)")
    parser.add_argument("--small", type=positive_int, default=32, help="small images' side, pixels (default file)")
    parser.add_argument("--steps", type=positive_int, default=4, help="steps of the default file (and twice that)")
    parser.add_argument("--frames", type=positive_int, default=17, help="Wan: frames of the default file's clips")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads of the random FLUX.1")
    parser.add_argument("--head-dim", type=positive_int, default=16, help="channels per head")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32")
    parser.add_argument("--max-tokens-per-gpu", type=positive_int, default=None, help="token budget per GPU")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs per mode (the best is reported)")
    parser.add_argument("--json", type=output_file, metavar="OUT.json", help="write every figure")
    parser.add_argument("--plot", type=plot_file, metavar="OUT.png", help="throughput and per-rank busy time")
