"""``deepspeed-knap generate``: images for a JSONL file of requests, balanced across the ranks.

    deepspeed --num_gpus 8 --no_local_rank --module deepspeed_knap.cli generate \\
        --requests prompts.jsonl --model-path /models/FLUX.1-dev --out images/ --max-tokens-per-gpu 65536
    deepspeed-knap generate --requests prompts.jsonl --tiny --out images/   # one process, a tiny random FLUX.1
    deepspeed-knap generate --requests prompts.jsonl --tiny --family flux2 --out images/   # a tiny FLUX.2
    deepspeed-knap generate --requests clips.jsonl --tiny --family wan --out videos/   # a tiny Wan 2.1

One request per line (``{"prompt": ..., "height": ..., "width": ..., "steps": ..., "guidance": ...,
"seed": ...}``, Wan's ``"frames"``, ``"negative_prompt"`` for classifier-free guidance, or
``"embeddings"`` for precomputed text embeddings; docs/generation.md). Rank ``r`` encodes and decodes
lines ``r``, ``r + N``, ...; the family (FLUX.1, FLUX.2 or Wan) is the model's: ``--model-path``'s
checkpoint, or ``--tiny --family``; the transformer runs every rank's running requests together,
balanced (topology ``auto``), and requests join and leave at step boundaries under the token
budget; each request set's plan is solved in a worker process while the set before it runs
(``--no-plan-ahead``: at the step the set starts). Writes ``OUT/{id}.png`` per image
(``OUT/{id}.gif`` per video) and ``OUT/timings.json`` (per request and per rank). Bad lines are refused before any work and the others generated; the exit code is then 1,
as it is for a missing model, and for an image that could not be written (the others still are).
Launched without a launcher it runs as one rank, unbalanced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from deepspeed_knap.options import DefaultsHelp, add_family_argument, positive_int

HELP = "images for a JSONL file of requests, balanced across the ranks"
FORMATTER = DefaultsHelp
DTYPES = ("bfloat16", "float16", "float32", "float64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", required=True, metavar="FILE.jsonl", help="one JSON request per line")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the PNGs and timings.json go")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-path", metavar="DIR",
                       help="a diffusers FLUX.1, FLUX.2 or Wan (text-to-video) pipeline directory (model_index.json); "
                       "its family is its transformer's")  # fmt: skip
    model.add_argument("--tiny", action="store_true", help="a tiny random pipeline of --family (CPU demos, tests)")
    add_family_argument(parser, "the --tiny model's family (default: flux)", default=None, having="generator")
    parser.add_argument("--seed", type=int, default=0, help="of the --tiny weights")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--max-tokens-per-gpu", type=positive_int, default=None,
                        help="token budget of the running requests, per GPU (default: every request at once)")  # fmt: skip
    parser.add_argument("--no-reuse", action="store_true",
                        help="gather, solve and prepare the route every step, as training does (to compare)")  # fmt: skip
    parser.add_argument("--no-plan-ahead", action="store_true",
                        help="solve each request set's plan at the step it starts, not in a worker process "
                        "while the set before it runs (the plans are the same)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")


def run(args: argparse.Namespace) -> int:
    import torch

    from deepspeed_knap.generation.requests import RequestFileError
    from deepspeed_knap.generation.runner import (
        GenerationError,
        all_gather_json,
        generate,
        generation_balancer,
        rank_and_world,
    )

    _join_launched_job()
    rank, world = rank_and_world()
    dtype = getattr(torch, args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"))
    problem = None
    if args.family is not None and not args.tiny:
        problem = (f"--family {args.family} picks the --tiny model's family; --model-path {args.model_path}'s family "
                   "is its checkpoint's: drop --family")  # fmt: skip
    elif args.model_path and not (Path(args.model_path) / "model_index.json").is_file():
        problem = (f"--model-path {args.model_path}: no model_index.json there; give a diffusers FLUX.1, FLUX.2 or "
                   "Wan pipeline directory (what FluxPipeline, Flux2Pipeline or WanPipeline.save_pretrained writes), "
                   "or --tiny")  # fmt: skip
    out = Path(args.out)
    if problem is None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            problem = f"cannot make --out {out}: {error}"
    generator = None
    if problem is None:
        try:
            generator = _load(args, dtype)
        except Exception as error:  # every rank must hear of it, or the others wait in the gather
            problem = f"cannot load {args.model_path or 'the --tiny model'}: {type(error).__name__}: {error}"
    if _report_fatal(all_gather_json(problem), rank, "loading the model"):
        return 1
    balancer = generation_balancer(generator.model, args.max_tokens_per_gpu, not args.no_reuse) if world > 1 else None
    unwritten: list[dict] = []

    def write_output(request, image) -> None:
        from PIL import Image

        from deepspeed_knap.models.wan.finetune import write_gif

        path = out / f"{request.id}.{'gif' if image.ndim == 4 else 'png'}"
        try:
            if image.ndim == 4:  # [F, H, W, 3] frames
                write_gif(image, path)
            else:  # diffusers' numpy_to_pil: the same rounding as FluxPipeline's output_type="pil".
                Image.fromarray((image * 255).round().astype("uint8")).save(path)
        except (OSError, ValueError) as error:  # a full disk, a name the file system refuses: go on
            unwritten.append({"line": request.line, "id": request.id, "rank": rank,
                              "reason": f"line {request.line}: cannot write {path}: {error}"})  # fmt: skip

    try:
        report = generate(args.requests, generator, balancer, write_output, args.max_tokens_per_gpu,
                          progress=not args.no_progress, plan_ahead=not args.no_plan_ahead)  # fmt: skip
    except RequestFileError as error:  # the same error on every rank
        return 1 if _report_fatal([str(error)], rank, "reading the requests") else 0
    except GenerationError as error:  # the same error on every rank
        return 1 if _report_fatal([str(error)], rank, "generating") else 0
    # Outputs not written: by write_output (a file system error), or by the loop (a decode, or any
    # other error handing the output over).
    reports = all_gather_json({**dataclasses.asdict(report), "unwritten": unwritten + report.failed})
    if rank == 0:
        summary = summarize(reports)
        (out / "timings.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(format_summary(summary, out))
    return 1 if report.refused or any(r["unwritten"] for r in reports) else 0


def _join_launched_job() -> None:
    """Join the process group when a launcher started this process (``RANK`` set), on one device per
    local rank, and drop this rank's DeepSpeed CPU all-reduce buffer once every rank has mapped it."""
    if "RANK" not in os.environ:
        return
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    deepspeed.init_distributed(verbose=False)
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.barrier()
    unlink_own_shm_buffer(dist.get_rank())


def _load(args: argparse.Namespace, dtype):
    import torch
    from deepspeed.accelerator import get_accelerator

    from deepspeed_knap.models.generators import load_generator, tiny_generator

    device = torch.device(get_accelerator().current_device_name())
    if args.tiny:
        return tiny_generator(args.family or "flux", dtype, device, args.seed)
    return load_generator(args.model_path, dtype, device)


def _report_fatal(problems: list[str | None], rank: int, what: str) -> bool:
    """Whether any rank found a problem that stops the run; rank 0 prints them (every rank has them)."""
    found = {message: [r for r, m in enumerate(problems) if m == message] for message in problems if message}
    if found and rank == 0:
        for message, ranks in found.items():
            where = "" if len(problems) == 1 else f" (rank(s) {ranks})"
            print(f"deepspeed-knap generate: error {what}{where}: {message}")
    return bool(found)


def summarize(reports: list[dict]) -> dict:
    """Every rank's report as the timings file: per request, per rank, the run's totals and what
    was refused."""
    wall = max(report["wall_s"] for report in reports)
    requests = sorted((dict(r, rank=report["rank"]) for report in reports for r in report["requests"]),
                      key=lambda r: r["line"])  # fmt: skip
    ranks = [{"rank": report["rank"], "wall_s": report["wall_s"], "busy_s": report["busy_s"],
              "images": len(report["requests"]), "plan_s": sum(report["plan_s"]), "route_s": sum(report["route_s"]),
              "solve_in_step_s": report["solve_in_step_s"], "plan_wait_s": report["plan_wait_s"]}
             for report in reports]  # fmt: skip
    unwritten = sorted((u for report in reports for u in report.get("unwritten", [])), key=lambda u: u["line"])
    first = reports[0]
    return {"images": len(requests), "requests_in_file": first["count"], "wall_s": wall,
            "images_per_s": len(requests) / wall if wall > 0 else 0.0, "steps": first["steps"],
            "set_changes": first["set_changes"], "solves": first["solves"], "planned_ahead": first["planned_ahead"],
            "solved_in_step": first["solved_in_step"], "back_offs": first["back_offs"],
            "refused": first["refused"], "unwritten": unwritten, "requests": requests, "ranks": ranks}  # fmt: skip


def format_summary(summary: dict, out: Path) -> str:
    lines = [f"generated {summary['images']} of {summary['requests_in_file']} requests into {out} in "
             f"{summary['wall_s']:.1f} s ({summary['images_per_s']:.2f} images/s, {summary['steps']} steps, "
             f"{summary['set_changes']} request sets, {summary['solves']} plans solved)"]  # fmt: skip
    planned = summary["planned_ahead"] + summary["solved_in_step"]
    if planned:  # balanced
        lines.append(f"request set plans: {summary['planned_ahead']} of {planned} planned ahead in the worker, "
                     f"{summary['solved_in_step']} solved in the step")  # fmt: skip
    for rank in summary["ranks"]:
        busy = rank["busy_s"] / rank["wall_s"] if rank["wall_s"] > 0 else 0.0
        line = (f"  rank {rank['rank']}: {rank['images']} images, busy {rank['busy_s']:.1f} s of "
                f"{rank['wall_s']:.1f} ({busy:.0%})")  # fmt: skip
        if planned:
            line += (f", set plans: {rank['solve_in_step_s']:.3f} s solving in the step, "
                     f"{rank['plan_wait_s']:.3f} s waiting for the worker")  # fmt: skip
        lines.append(line)
    if summary["refused"]:
        lines.append(f"refused {len(summary['refused'])} request(s):")
        lines += [f"  {refusal['reason']}" for refusal in summary["refused"]]
    if summary.get("unwritten"):
        lines.append(f"could not write {len(summary['unwritten'])} output(s):")
        lines += [f"  {failure['reason']}" for failure in summary["unwritten"]]
    lines.append(f"per-request and per-rank timings: {out / 'timings.json'}")
    return "\n".join(lines)
