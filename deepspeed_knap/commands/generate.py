"""``deepspeed-knap generate``: images for a JSONL file of requests, balanced across the ranks.

    deepspeed --num_gpus 8 --no_local_rank --module deepspeed_knap.cli generate \\
        --requests prompts.jsonl --model-path /models/FLUX.1-dev --out images/ --max-tokens-per-gpu 65536
    deepspeed-knap generate --requests prompts.jsonl --tiny --out images/   # one process, a tiny random FLUX.1
    deepspeed-knap generate --requests prompts.jsonl --tiny --family flux2 --out images/   # a tiny FLUX.2
    deepspeed-knap generate --requests prompts.jsonl --tiny --family flux3 --out images/   # a tiny FLUX.3
    deepspeed-knap generate --requests clips.jsonl --tiny --family wan --out videos/   # a tiny Wan 2.1

One request per line (``{"prompt": ..., "height": ..., "width": ..., "steps": ..., "guidance": ...,
"seed": ...}``, Wan's ``"frames"``, ``"negative_prompt"`` for classifier-free guidance, or
``"embeddings"`` for precomputed text embeddings; docs/generation.md). Rank ``r`` encodes and decodes
lines ``r``, ``r + N``, ...; the family (FLUX.1, FLUX.2, FLUX.3, Wan or Qwen-Image) is the model's: ``--model-path``'s
checkpoint, or ``--tiny --family``; the transformer runs every rank's running requests together,
balanced (topology ``auto``), and requests join and leave at step boundaries under the token
budget; each request set's plan is solved in a worker process while the set before it runs
(``--no-plan-ahead``: at the step the set starts). Writes ``OUT/{id}.png`` per image
(``OUT/{id}.gif`` per video) as each finishes, each rank's timings so far in
``OUT/timings.rank{r}.jsonl``, and at the end ``OUT/timings.json`` (per request and per rank), which
replaces them. Bad lines are refused before any work and the others generated; the exit code is
then 1, as it is for a missing model, an ``--out`` this user cannot write in (found before any
work), and an image that could not be written (the others still are). A rank that does not reach a
collective within ``--timeout`` fails the ranks that waited, each naming the step and the missing
ranks. Launched without a launcher it runs as one rank, unbalanced.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

from deepspeed_knap.options import add_family_argument, positive_int

HELP = "images for a JSONL file of requests, balanced across the ranks"
DTYPES = ("bfloat16", "float16", "float32", "float64")
# Training's knapformer.timeout_s, its default and its range (runtime/config.py: 1 s to a day).
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_RANGE_S = (1.0, 86400.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", required=True, metavar="FILE.jsonl", help="one JSON request per line")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the PNGs and timings.json go")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-path", metavar="DIR",
                       help="a diffusers FLUX.1, FLUX.2, FLUX.3 (modular), Wan or Qwen-Image pipeline directory (model_index.json "
                       "or modular_model_index.json); its family is its transformer's")  # fmt: skip
    model.add_argument("--tiny", action="store_true", help="a tiny random pipeline of --family (CPU demos, tests)")
    add_family_argument(parser, "the --tiny model's family (default: flux)", default=None, having="generator")
    parser.add_argument("--seed", type=int, default=0, help="of the --tiny weights")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--max-tokens-per-gpu", type=positive_int, default=None,
                        help="token budget of the running requests, per GPU (default: every request at once, "
                        "each of at most 2**18 tokens a GPU)")  # fmt: skip
    parser.add_argument("--no-reuse", action="store_true",
                        help="gather, solve and prepare the route every step, as training does (to compare)")  # fmt: skip
    parser.add_argument("--no-plan-ahead", action="store_true",
                        help="solve each request set's plan at the step it starts, not in a worker process "
                        "while the set before it runs (the plans are the same)")  # fmt: skip
    parser.add_argument("--decode-at-home", action="store_true",
                        help="decode each request on its home rank, not where the decodes of its step are "
                        "spread (docs/generation.md, Decodes; to compare)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    parser.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="seconds a rank waits in a collective for the others (one stopped, stuck or dead) "
                        "before the run fails on the ranks that waited, naming the step and the missing ranks; "
                        "while the model loads, this or DEEPSPEED_TIMEOUT, whichever is longer (training's "
                        "knapformer.timeout_s)")  # fmt: skip


def _seconds(text: str) -> float:
    """An argparse type: seconds in :data:`TIMEOUT_RANGE_S` (gloo rounds less than a millisecond to no
    wait at all, and ``datetime.timedelta`` overflows far above a day)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    low, high = TIMEOUT_RANGE_S
    if not low <= value <= high:  # NaN fails it too
        raise argparse.ArgumentTypeError(f"{text} is not from {low:g} to {high:g} seconds")
    return value


def run(args: argparse.Namespace) -> int:
    import torch

    from deepspeed_knap.generation.deadline import MissingRanksError
    from deepspeed_knap.generation.requests import RequestFileError
    from deepspeed_knap.generation.runner import (
        GenerationError,
        all_gather_json,
        generate,
        generation_balancer,
        rank_and_world,
    )

    _join_launched_job(args.timeout)
    rank, world = rank_and_world()
    deadline = _start_deadline(args.timeout) if world > 1 else None
    watching = contextlib.nullcontext if deadline is None else deadline.watching
    dtype = getattr(torch, args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32"))
    out = Path(args.out)
    problem = _check_options(args, out)  # [what, message]
    generator = None
    if problem is None:
        try:
            generator = _load(args, dtype)
        except Exception as error:  # every rank must hear of it, or the others wait in the gather
            problem = ["loading the model",
                       f"cannot load {args.model_path or 'the --tiny model'}: {type(error).__name__}: {error}"]  # fmt: skip
    try:
        with watching("loading the model"):  # the fast ranks wait for the slow loaders here
            problems = all_gather_json(problem)
    except MissingRanksError as error:
        return _report_missing(error, rank)
    if _report_fatal(problems, rank):
        return 1
    if deadline is not None:
        deadline.set_timeout()  # from here on every collective waits --timeout at most
    balancer = None
    if world > 1:
        balancer = generation_balancer(generator.model, args.max_tokens_per_gpu, not args.no_reuse,
                                       timeout=deadline.timeout)  # fmt: skip
    journal = _Journal(out / f"timings.rank{rank}.jsonl")
    if rank == 0:  # an earlier run's journals of ranks this run does not have (each rank removes its own)
        for stale in out.glob("timings.rank*.jsonl"):
            number = stale.name.removeprefix("timings.rank").removesuffix(".jsonl")
            if number.isdigit() and int(number) >= world:
                with contextlib.suppress(OSError):  # as _Journal.remove: a file left behind is harmless
                    stale.unlink(missing_ok=True)
    unwritten: list[dict] = []

    def write_output(request, image) -> None:
        from PIL import Image

        from deepspeed_knap.models.wan.finetune import write_gif

        if image.ndim == 4 and len(image) == 1:  # a video model's one frame is an image: a PNG (no palette)
            image = image[0]
        path = out / f"{request.id}.{'gif' if image.ndim == 4 else 'png'}"
        # Written aside, then renamed: a write that fails part way (a full disk) leaves no truncated
        # file under the output's name. Aside is a folder of this rank's that no output can be (outputs
        # are files named by their ids), under a short name (ids may be 251 bytes long).
        partial = out / f".partial-rank{rank}" / f"line{request.line}{path.suffix}"
        try:
            partial.parent.mkdir(exist_ok=True)
            if image.ndim == 4:  # [F, H, W, 3] frames
                write_gif(image, partial, generator.frames_per_second)
            else:  # diffusers' numpy_to_pil: the same rounding as FluxPipeline's output_type="pil".
                Image.fromarray((image * 255).round().astype("uint8")).save(partial)
            os.replace(partial, path)
        except (OSError, ValueError) as error:  # a full disk, a name the file system refuses: go on
            unwritten.append({"line": request.line, "id": request.id, "rank": rank,
                              "reason": f"line {request.line}: cannot write {path}: {error}"})  # fmt: skip
            journal.add("unwritten", unwritten[-1])
        finally:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
                partial.parent.rmdir()

    try:
        report = generate(args.requests, generator, balancer, write_output, args.max_tokens_per_gpu,
                          progress=not args.no_progress, plan_ahead=not args.no_plan_ahead, deadline=deadline,
                          on_record=journal.add, balance_decodes=not args.decode_at_home)  # fmt: skip
    except RequestFileError as error:  # the same error on every rank
        return 1 if _report_fatal([["reading the requests", str(error)]], rank) else 0
    except MissingRanksError as error:  # this rank's view: each rank that waited says it
        return _report_missing(error, rank, journal)
    except GenerationError as error:  # the same error on every rank
        _report_fatal([["generating", str(error)]], rank)
        if rank == 0:
            print(
                f"what was done is kept: the outputs in {out}, their timings in {out}/timings.rank*.jsonl",
                file=sys.stderr,
            )
        return 1
    # Outputs not written: by write_output (a file system error), or by the loop (a decode, or any
    # other error handing the output over).
    try:
        with watching("the final report"):
            reports = all_gather_json({**dataclasses.asdict(report), "unwritten": unwritten + report.failed})
    except MissingRanksError as error:
        return _report_missing(error, rank, journal)
    written = True
    if rank == 0:
        summary = summarize(reports)
        print(format_summary(summary, out))
        try:
            (out / "timings.json").write_text(json.dumps(summary, indent=1) + "\n")
        except OSError as error:
            written = False
            print(f"deepspeed-knap generate: error: cannot write {out / 'timings.json'}: {error}; the timings are "
                  f"in {out}/timings.rank*.jsonl", file=sys.stderr)  # fmt: skip
    try:
        with watching("the final report"):
            written = all_gather_json(written)[0]
    except MissingRanksError as error:
        return _report_missing(error, rank, journal)
    if written:  # timings.json holds this rank's records
        journal.remove()
    return 1 if report.refused or any(r["unwritten"] for r in reports) or not written else 0


def _check_options(args: argparse.Namespace, out: Path) -> list[str] | None:
    """``[what, message]`` of the first problem with the options that stops the run, or ``None``;
    the request file is read, and ``--out`` made and a file written and removed in it, before any
    work."""
    if args.family is not None and not args.tiny:
        return ["checking the options", f"--family {args.family} picks the --tiny model's family; --model-path "
                f"{args.model_path}'s family is its checkpoint's: drop --family"]  # fmt: skip
    indexes = ("model_index.json", "modular_model_index.json")  # a FLUX.3 modular pipeline's may be the second
    if args.model_path and not any((Path(args.model_path) / index).is_file() for index in indexes):
        return ["checking the options", f"--model-path {args.model_path}: no model_index.json there (nor a modular "
                "pipeline's modular_model_index.json); give a diffusers FLUX.1, FLUX.2, FLUX.3, Wan or Qwen-Image "
                "pipeline directory (what FluxPipeline, Flux2Pipeline, Flux2KleinPipeline, FLUX.3's modular "
                "pipeline, WanPipeline or QwenImagePipeline.save_pretrained writes), or --tiny"]  # fmt: skip
    from deepspeed_knap.generation.requests import RequestFileError, request_lines

    try:  # read again (with its lines' checks) once the model is loaded: a file missing is found now
        request_lines(args.requests)
    except RequestFileError as error:
        return ["reading the requests", str(error)]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return ["checking --out", f"cannot make --out {out}: {error}"]
    try:  # the outputs and timings.json go here after all the work: find out now
        with tempfile.NamedTemporaryFile(dir=out, prefix=".deepspeed-knap-write-check-"):
            pass
    except OSError as error:  # its reason alone: the file's name differs between ranks, the message may not
        return ["checking --out", f"cannot write in --out {out}: {error.strerror or error}; give a directory this "
                "user can write in"]  # fmt: skip
    return None


class _Journal:
    """This rank's timings as the run goes (``OUT/timings.rank{r}.jsonl``): a JSON line per request
    handed over (``{"request": record}``), per failure (``"failed"``, ``"unwritten"``) and, on
    rank 0, per refusal (``"refused"``), appended as each comes, so a run that fails late keeps the
    timings of what it finished. An earlier run's is removed at the start, this run's once
    ``timings.json`` holds them all. A journal that cannot be written is said once on stderr; the
    run goes on (never raises: a rank raising alone would leave the others waiting)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._failed = False
        self.remove()

    def add(self, kind: str, value: dict) -> None:
        if self._failed:
            return
        try:
            with self.path.open("a") as file:
                file.write(json.dumps({kind: value}) + "\n")
        except OSError as error:
            self._failed = True
            print(f"deepspeed-knap generate: warning: cannot write {self.path}: {error}; the timings are kept "
                  "only in timings.json at the end", file=sys.stderr)  # fmt: skip

    def remove(self) -> None:
        with contextlib.suppress(OSError):  # --out was found writable; a file left behind is harmless
            self.path.unlink(missing_ok=True)


def _join_launched_job(timeout_s: float) -> None:
    """Join the process group when a launcher started this process (``RANK`` set, or ``mpirun``:
    DeepSpeed finds the ranks through mpi4py), on one device per local rank, and drop this rank's
    DeepSpeed CPU all-reduce buffer once every rank has mapped it. The rendezvous waits ``timeout_s``
    or DeepSpeed's default, whichever is longer.

    Raises:
        SystemExit: ``srun`` started several tasks without ``RANK`` (each would generate everything).
    """
    from deepspeed_knap.runtime.groups import launched_by_mpi, unjoinable_launch

    if problem := unjoinable_launch():
        raise SystemExit(f"deepspeed-knap generate: {problem}")
    if "RANK" not in os.environ and not launched_by_mpi():
        return
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    # Under mpirun, DeepSpeed's discovery would take port 29500 unless told (as training's start-up).
    deepspeed.init_distributed(verbose=False, timeout=_start_up_timeout(timeout_s),
                               distributed_port=int(os.environ.get("MASTER_PORT", "29500")))  # fmt: skip
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.barrier()
    unlink_own_shm_buffer(dist.get_rank())


def _start_deadline(timeout_s: float):
    """The run's :class:`~deepspeed_knap.generation.deadline.Deadline` (collective). Until the model
    is loaded on every rank, collectives wait ``timeout_s`` or DeepSpeed's default
    (``DEEPSPEED_TIMEOUT`` minutes, 10 unless set), whichever is longer, as training's start-up
    does: ranks load at their own pace."""
    from deepspeed_knap.generation.deadline import Deadline

    deadline = Deadline(timeout_s)
    deadline.set_timeout(_start_up_timeout(timeout_s).total_seconds())
    return deadline


def _start_up_timeout(timeout_s: float) -> datetime.timedelta:
    from deepspeed.constants import default_pg_timeout

    return max(datetime.timedelta(seconds=timeout_s), default_pg_timeout)


def _load(args: argparse.Namespace, dtype):
    import torch
    from deepspeed.accelerator import get_accelerator

    from deepspeed_knap.models.generators import load_generator, tiny_generator

    device = torch.device(get_accelerator().current_device_name())
    if args.tiny:
        return tiny_generator(args.family or "flux", dtype, device, args.seed)
    return load_generator(args.model_path, dtype, device)


def _report_fatal(problems: list[list[str] | None], rank: int) -> bool:
    """Whether any rank found a problem (``[what, message]``) that stops the run; rank 0 prints them
    (every rank has them)."""
    found: dict[tuple[str, str], list[int]] = {}
    for r, problem in enumerate(problems):
        if problem:
            found.setdefault(tuple(problem), []).append(r)
    if found and rank == 0:
        for (what, message), ranks in found.items():
            where = "" if len(problems) == 1 else f" (rank(s) {ranks})"
            print(f"deepspeed-knap generate: error {what}{where}: {message}", file=sys.stderr)
    return bool(found)


def _report_missing(error: Exception, rank: int, journal: _Journal | None = None) -> int:
    """A collective that some rank did not reach: every rank that waited says so (rank 0 may be the
    one missing), and what it had done is kept."""
    kept = (
        ""
        if journal is None or not journal.path.exists()
        else f"; its finished requests' timings are in {journal.path}"
    )
    print(f"deepspeed-knap generate: error on rank {rank}: {error}{kept}", file=sys.stderr)
    return 1


def summarize(reports: list[dict]) -> dict:
    """Every rank's report as the timings file: per request, per rank, the run's totals and what
    was refused; ``images`` counts the outputs written (a request whose file could not be written,
    or whose decode failed, is in ``unwritten``)."""
    wall = max(report["wall_s"] for report in reports)
    requests = sorted((dict(r, rank=report["rank"]) for report in reports for r in report["requests"]),
                      key=lambda r: r["line"])  # fmt: skip
    unwritten = sorted((u for report in reports for u in report.get("unwritten", [])), key=lambda u: u["line"])
    # A request generated but whose output could not be written is timed (requests) but no image.
    lost = {u["line"] for u in unwritten}
    ranks = [{"rank": report["rank"], "wall_s": report["wall_s"], "busy_s": report["busy_s"],
              "images": sum(r["line"] not in lost for r in report["requests"]), "plan_s": sum(report["plan_s"]),
              "route_s": sum(report["route_s"]), "solve_in_step_s": report["solve_in_step_s"],
              "plan_wait_s": report["plan_wait_s"]}
             for report in reports]  # fmt: skip
    images = sum(rank["images"] for rank in ranks)
    first = reports[0]
    return {"images": images, "requests_in_file": first["count"], "wall_s": wall,
            "images_per_s": images / wall if wall > 0 else 0.0, "steps": first["steps"],
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
