"""Balanced generation: the intake of a request file and the denoising loop every rank runs.

    generator = load_generator(path, torch.bfloat16, device)  # a family's (deepspeed_knap.models.generators)
    balancer = generation_balancer(generator.model, max_tokens_per_gpu=65536)  # collective
    report = generate("requests.jsonl", generator, balancer, on_image=write_png)

**Intake** (:func:`take_requests`, collective): every rank reads the request file and checks the
requests it owns (request ``i`` is rank ``i % world_size``'s: it parses the line and asks the family
for its tokens, which checks the size and any embeddings file); one all-gather then gives every
rank the same table of every request's tokens and steps, or why it was refused. What only the table
shows is decided from it alike everywhere: an id used twice, a request over the budget even alone
on the largest group. A file that differs between ranks, or that a rank cannot read, is one error
on every rank. Refused requests are reported; the others are generated.

**Loop** (:func:`generate`): every rank steps the same :class:`~deepspeed_knap.generation.schedule.StepBatcher`
(joins and leaves at step boundaries under the token budget, a plan per set). Each step a rank
packs its own running requests, the transformer runs them balanced with every other rank's
(:class:`~deepspeed_knap.generation.balancer.ReusingBalancer`, under ``torch.no_grad``), and each
request takes its scheduler step at home. The requests that finish at a step are decoded where
:func:`~deepspeed_knap.generation.decodes.place_decodes` spreads them (their states sent there in
one all-to-all) and handed to ``on_image`` on that rank. A rank with nothing running still joins
every step's collectives.

A family's generator (:class:`~deepspeed_knap.models.flux.generate.FluxGenerator` for FLUX.1,
:class:`~deepspeed_knap.models.flux.generate.Flux2Generator` for FLUX.2,
:class:`~deepspeed_knap.models.wan.generate.WanGenerator` for Wan) gives ``model`` (the packed
transformer), ``request_seq_lens(request)`` (the tokens of each sequence the request runs per step:
two with classifier-free guidance; raises ``RequestError``), ``start(request)`` (a
:class:`~deepspeed_knap.generation.denoising.Denoising`: ``samples()``, ``advance(predictions)``,
``done``) and ``decode(state)`` (an image ``[H, W, 3]`` or a video ``[F, H, W, 3]``).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepspeed_knap.generation.balancer import ReusingBalancer, WorkerPlanAhead, forward_cost_model
from deepspeed_knap.generation.deadline import Deadline
from deepspeed_knap.generation.requests import Request, RequestError, RequestFileError, parse_request, request_lines
from deepspeed_knap.generation.schedule import Job, StepBatcher
from deepspeed_knap.runtime.attention import KnapDistributedAttention
from deepspeed_knap.runtime.groups import all_gather_bytes, text_digest

# The most tokens one request may put on a GPU when no --max-tokens-per-gpu is given (times the
# GPUs of the largest group it may be split over; a guided pair's two sequences, every GPU's):
# 2**18, an 8,192 x 8,192 px FLUX image or a 720p Wan clip of 285 frames. Around it one forward's
# activations fill a GPU (FLUX.1 in bfloat16 keeps ~16 x 3,072 values a token live: 26 GB, the
# attention's own aside), and one step of FLUX.1 takes about two minutes on an H100. It is the same
# on every rank, unlike free memory, so every run of a file refuses the same lines;
# --max-tokens-per-gpu sets the bound instead.
DEFAULT_MAX_TOKENS_PER_GPU = 2**18


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` in a process that joined no process group."""
    import deepspeed.comm as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_json(value: Any) -> list[Any]:
    """Every rank's JSON-able ``value``, by rank. Collective when a process group exists."""
    if rank_and_world()[1] == 1:
        return [value]
    return [json.loads(data) for data in all_gather_bytes(json.dumps(value).encode())]


class GenerationError(RuntimeError):
    """A request that could not start on its rank, raised on every rank together."""


@dataclass
class Intake:
    """The agreed request table (identical on every rank) and this rank's requests.

    Attributes:
        jobs: every accepted request, in file order (for the batcher).
        ids: every accepted request's id, by index.
        mine: this rank's accepted requests, by index.
        refused: every refused request, in file order: ``{"line", "id", "reason"}``.
        count: requests in the file.
    """

    jobs: list[Job]
    ids: dict[int, str]
    mine: dict[int, Request]
    refused: list[dict]
    count: int


def take_requests(path: str | Path, generator: Any, max_tokens_per_gpu: int | None = None,
                  max_degree: int = 1, balanced: bool = True,
                  solve: Callable[[list[list[int]]], Any] | None = None) -> Intake:  # fmt: skip
    """Read and check the request file, and agree on the table. Collective.

    Args:
        path: the JSONL request file.
        generator: the family's generator (``request_seq_lens``).
        max_tokens_per_gpu: the per-GPU token budget, or ``None``: a request may then put at most
            :data:`DEFAULT_MAX_TOKENS_PER_GPU` tokens on a GPU.
        max_degree: the largest group a sequence may be split over (its GPUs hold it together).
        balanced: the requests run balanced; ``False``: each on its home rank, all its sequences there.
        solve: the batcher's planner (raises ``ValueError`` for a set it cannot place), of topology
            ``auto`` (:func:`generation_balancer`'s, whose single GPUs are groups). Given, with
            a budget, a request of several sequences (classifier-free guidance) that do not each fit
            a GPU of their own is planned alone at its home, and refused if even that fails: two
            sequences each over one GPU's budget need two groups, which ``auto`` may not have, and a
            pair within one group's budget may still not fit (a group's first GPUs carry each split
            sequence's odd token).

    Raises:
        RequestFileError: on every rank, when a rank cannot read the file or ranks read different files.
    """
    rank, world = rank_and_world()
    problem, lines, digest = None, [], 0
    try:
        lines = request_lines(path)
        digest = text_digest(json.dumps(lines))
    except RequestFileError as error:
        problem = str(error)
    entries = []
    for index in range(rank, len(lines), world):
        number, text = lines[index]
        entry = {"index": index, "line": number, "id": f"line{number}", "seq_lens": [], "steps": 0, "reason": None}
        try:
            request = parse_request(index, number, text, Path(path).parent, default_steps=generator.default_steps)
            entry["id"] = request.id  # a request the family refuses is reported under its own id
            seq_lens = generator.request_seq_lens(request)
            entry.update(seq_lens=[int(n) for n in seq_lens], steps=request.steps)
            entry["request"] = request
        except RequestError as error:
            entry["reason"] = str(error)
        except Exception as error:  # raised here, it would leave the other ranks in the gather
            entry.update(seq_lens=[], steps=0, reason=f"line {number}: cannot take this request: "
                         f"{type(error).__name__}: {error}")  # fmt: skip
        entries.append(entry)
    views = all_gather_json({"problem": problem, "digest": digest, "entries": [_public(e) for e in entries]})
    problems = {r: view["problem"] for r, view in enumerate(views) if view["problem"]}
    if problems:
        raise RequestFileError("; ".join(f"rank {r}: {message}" for r, message in problems.items()))
    if len({view["digest"] for view in views}) > 1:
        raise RequestFileError(f"the request file {path} differs between ranks (digests by rank: "
                         f"{[view['digest'] for view in views]}); give every rank the same file")  # fmt: skip
    table = sorted((entry for view in views for entry in view["entries"]), key=lambda e: e["index"])
    mine = {e["index"]: e["request"] for e in entries if e["reason"] is None}
    seen: dict[str, int] = {}
    # Without a budget every request runs at once, but one request still has to fit the GPUs it may
    # spread over: the ceiling stands in for the budget in the checks of one request.
    per_gpu = DEFAULT_MAX_TOKENS_PER_GPU if max_tokens_per_gpu is None else max_tokens_per_gpu
    limit = per_gpu * max_degree
    hold = world if balanced else 1  # the GPUs a request's sequences may spread over
    fix = "raise --max-tokens-per-gpu" if max_tokens_per_gpu is not None else "give --max-tokens-per-gpu"
    placeable: dict[tuple[int, tuple[int, ...]], bool] = {}  # (home, sequences) planned alone: requests repeat sizes
    jobs, ids, refused = [], {}, []
    for entry in table:
        reason, seq_lens = entry["reason"], entry["seq_lens"]
        if reason is None and entry["id"] in seen:
            reason = (f"line {entry['line']}: id {entry['id']!r} is line {seen[entry['id']]}'s too; ids name the "
                      "output files: make them unique")  # fmt: skip
        elif reason is None and max(seq_lens) > limit:
            under = ("the budget" if max_tokens_per_gpu is not None
                     else "the ceiling without --max-tokens-per-gpu")  # fmt: skip
            reason = (f"line {entry['line']}: {max(seq_lens)} tokens exceed what the largest group holds under "
                      f"{under}, {per_gpu} per GPU x {max_degree} GPUs = {limit}; make the image smaller, or "
                      f"{fix}")  # fmt: skip
        elif reason is None and sum(seq_lens) > per_gpu * hold:
            under = "budget" if max_tokens_per_gpu is not None else "ceiling (without --max-tokens-per-gpu)"
            reason = (f"line {entry['line']}: its {len(seq_lens)} sequences (classifier-free guidance runs the "
                      f"unconditional branch too) of {seq_lens} tokens exceed the {under} of {hold} GPU(s) "
                      f"({'every GPU together' if balanced else 'unbalanced, its home rank holds them all'}), "
                      f"{per_gpu} per GPU; make the image smaller, or {fix}")  # fmt: skip
        elif (reason is None and solve is not None and max_tokens_per_gpu is not None and len(seq_lens) > 1
              and not (max(seq_lens) <= per_gpu and len(seq_lens) <= world)):  # fmt: skip
            # Sequences that each fit a GPU of their own always place (auto has every single GPU); any
            # other pair is planned alone once: within one group's budget is not enough, as a group's
            # first GPUs carry each split sequence's odd token (169 and 165 tokens at 167 a GPU on 2:
            # 85 + 83 on the first), and one the batcher then cannot plan would end the run.
            home = entry["index"] % world
            if (home, tuple(seq_lens)) not in placeable:  # deterministic: every rank decides alike
                alone = [list(seq_lens) if rank_index == home else [] for rank_index in range(world)]
                try:
                    solve(alone)
                    placeable[home, tuple(seq_lens)] = True
                except ValueError:
                    placeable[home, tuple(seq_lens)] = False
            if not placeable[home, tuple(seq_lens)]:
                reason = (f"line {entry['line']}: its {len(seq_lens)} sequences (classifier-free guidance) of "
                          f"{seq_lens} tokens cannot be placed even alone under the budget of {max_tokens_per_gpu} "
                          f"per GPU on these {world} ranks (each needs a group of its own); make the image smaller, "
                          "or raise --max-tokens-per-gpu")  # fmt: skip
        if reason is None:
            seen[entry["id"]] = entry["line"]
            jobs.append(Job(entry["index"], entry["index"] % world, tuple(seq_lens), entry["steps"]))
            ids[entry["index"]] = entry["id"]
        else:
            refused.append({"line": entry["line"], "id": entry["id"], "reason": reason})
            mine.pop(entry["index"], None)
    return Intake(jobs, ids, mine, refused, len(table))


def _public(entry: dict) -> dict:
    """An intake entry without the parsed request (which stays on its rank)."""
    return {key: value for key, value in entry.items() if key != "request"}


def generation_balancer(model: torch.nn.Module, max_tokens_per_gpu: int | None = None, reuse: bool = True,
                        cost_model: Any = None, timeout: datetime.timedelta | None = None) -> ReusingBalancer:  # fmt: skip
    """Process groups of topology ``auto`` over the world (groups up to the model's heads, inside
    nodes as the launcher reports them, agreed by every rank:
    :func:`~deepspeed_knap.runtime.groups.launcher_gpus_per_node`) and a :class:`ReusingBalancer`
    with the forward-only cost model of ``model.config`` unless ``cost_model`` is given. The groups'
    collectives wait ``timeout`` at most for a rank (default DeepSpeed's: ``DEEPSPEED_TIMEOUT``
    minutes, 10 unless set). Collective: every rank calls it, after joining the process group."""
    import deepspeed.comm as dist

    from deepspeed_knap.planner.topology import build_topology, default_max_degree
    from deepspeed_knap.runtime.groups import check_same_on_every_rank, create_process_groups, launcher_gpus_per_node

    # Read on each rank: a node launched with other slots would lay out other groups (and take other
    # requests at the intake). Agreed first, as the engine does.
    world, node = dist.get_world_size(), launcher_gpus_per_node()
    check_same_on_every_rank({"gpus per node from the launcher": str(node)})
    heads = model.config["num_attention_heads"]
    topology = build_topology("auto", world, node, max_degree=default_max_degree(world, node, heads))  # fmt: skip
    groups = create_process_groups(topology, timeout)
    for module in model.modules():  # every attention (two experts have two): checks the heads against the groups
        if isinstance(module, KnapDistributedAttention):
            module.configure(topology)
    cost_model = forward_cost_model(model.family, model.config) if cost_model is None else cost_model
    return ReusingBalancer(groups, cost_model, max_tokens_per_gpu=max_tokens_per_gpu, reuse=reuse)


@dataclass
class GenerationReport:
    """One rank's run.

    Attributes:
        rank: global rank.
        requests: the requests this rank decoded: ``id``, ``line``, ``home`` (its rank), ``tokens``,
            ``steps``, ``first_step`` and ``last_step`` (of the run), ``encode_s``, ``denoise_s``
            (from its first step's start to its last step's end, at home), ``decode_s``,
            ``decoded_on`` (this rank).
        refused: every rank's refused requests (:attr:`Intake.refused`).
        count: requests in the file.
        steps: denoising steps the run took (each runs every running request once).
        set_changes: steps whose request set differs from the step before's (the first included).
        solves: plans solved (once per change of the request set; with ``reuse=False`` every step too).
        planned_ahead: set plans solved in the plan worker while the steps before the set ran, ready
            when it started (``generate``'s ``plan_ahead``).
        solved_in_step: set plans solved at the step that starts the set: the first set's, those
            after a back-off or a failed plan ahead, and every one without plan ahead.
        back_offs: sets the planner refused, each giving back its newest joiner (then nothing joins
            until a request leaves).
        wall_s: from the intake to the last image, this rank.
        busy_s: this rank's own work in that time: encoding, packing, the transformer's compute
            (less its all-to-alls and the waits in them), scheduler steps, decoding.
        solve_in_step_s: this rank's seconds solving set plans in the step (refused sets included).
        plan_wait_s: this rank's seconds waiting for the plan worker's set plans at the steps that
            started their sets (what planning ahead did not hide).
        plan_s, route_s: per step, this rank's seconds to get the plan and to route (balanced runs).
        failed: the requests whose decode, hand-over to the decoding rank or ``on_image`` raised
            here (``line``, ``id``, ``rank``, ``reason``); the run went on.
    """

    rank: int
    requests: list[dict]
    refused: list[dict]
    count: int
    steps: int = 0
    set_changes: int = 0
    solves: int = 0
    planned_ahead: int = 0
    solved_in_step: int = 0
    back_offs: int = 0
    wall_s: float = 0.0
    busy_s: float = 0.0
    solve_in_step_s: float = 0.0
    plan_wait_s: float = 0.0
    plan_s: list[float] = field(default_factory=list)
    route_s: list[float] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)


def generate(path: str | Path, generator: Any, balancer: ReusingBalancer | None = None,
             on_image: Callable[[Request, np.ndarray], None] | None = None, max_tokens_per_gpu: int | None = None,
             progress: bool = True, plan_ahead: bool = True, deadline: Deadline | None = None,
             on_record: Callable[[str, dict], None] | None = None,
             balance_decodes: bool = True) -> GenerationReport:  # fmt: skip
    """Generate every acceptable request of ``path``. Collective: every rank calls it.

    With a balancer that reuses plans, each request set's plan after the first is solved in a plan
    worker process (:class:`~deepspeed_knap.generation.balancer.WorkerPlanAhead`) during the steps
    of the set before it, and is ready when the set starts; a plan the worker does not give on
    every rank is solved in the step on every rank. The plans are the same either way.

    Args:
        path: the JSONL request file (:mod:`~deepspeed_knap.generation.requests`).
        generator: the family's generator, the same weights on every rank.
        balancer: from :func:`generation_balancer`; ``None``: each rank runs its own requests alone
            (no communication in the transformer).
        on_image: called on the rank that decoded it (its home rank, unless the decodes are
            placed: ``balance_decodes``) with each request and its ``[H, W, 3]`` image (a video:
            ``[F, H, W, 3]`` frames) in ``[0, 1]``.
        max_tokens_per_gpu: the per-GPU token budget of the running set (the balancer's, when given).
        progress: a tqdm bar on rank 0 (request-steps done of all).
        plan_ahead: plan the next request set in the worker process; ``False``: solve each set's
            plan at the step that starts it. Unused unbalanced and with ``balancer.reuse`` off
            (which solves every step's plan in the step).
        deadline: names where the run was (``"the intake"``, ``"step N"``, steps counted from 0 as
            the report's ``first_step``) and the ranks missing when a collective fails
            (:class:`~deepspeed_knap.generation.deadline.Deadline`; the groups' timeout is its
            caller's to set); ``None``: a collective's failure raises as the backend raised it.
        on_record: called as the run goes, so that what is done is kept whatever happens later:
            ``("request", record)`` on the decoding rank as each request's output was handed over (the
            record as :attr:`GenerationReport.requests` holds it), ``("failed", failure)`` as
            :attr:`GenerationReport.failed` gets it, and on rank 0 ``("refused", refusal)`` for each
            of :attr:`Intake.refused` once the intake is agreed.
        balance_decodes: with a balancer, each step's finished requests are decoded where
            :func:`~deepspeed_knap.generation.decodes.place_decodes` puts them (their states sent
            there: :func:`_hand_over`); ``False``, or without a balancer: on their home ranks.

    Raises:
        RequestFileError: on every rank, for a request file that ranks cannot read alike.
        GenerationError: on every rank, when a request's ``generator.start`` raised on its rank (its
            encoders or embeddings file failed after the intake's checks), or the packed model
            refused its inputs (``model.pack`` of its samples alone), at the step it joins, or the
            planner refused a set of requests that no request can leave (its message).
        MissingRanksError: on the ranks that waited, when a collective timed out or a rank left
            (with a ``deadline``).
    """
    from tqdm import tqdm

    rank, world = rank_and_world()
    start = time.perf_counter()
    if balancer is not None:
        max_tokens_per_gpu = balancer.max_tokens_per_gpu
    topology = None if balancer is None else balancer.groups.topology
    max_degree = 1 if topology is None else max(size for _, size in topology.groups)
    busy = time.perf_counter()
    solve = _solver(balancer, max_tokens_per_gpu)
    watching = contextlib.nullcontext if deadline is None else deadline.watching
    keep = on_record or (lambda kind, value: None)
    with watching("the intake"):
        intake = take_requests(path, generator, max_tokens_per_gpu, max_degree, balanced=balancer is not None,
                               solve=solve if balancer is not None else None)  # fmt: skip
    busy = time.perf_counter() - busy  # the intake's own checks; the gather is shared waiting
    for refusal in intake.refused if rank == 0 else []:
        keep("refused", refusal)
    planner = None
    if plan_ahead and balancer is not None and balancer.reuse:
        planner = WorkerPlanAhead(balancer, generator.device)
    batcher = StepBatcher(intake.jobs, world, max_tokens_per_gpu, solve, planner)
    # A balancer may serve several runs: this run's counts are what it adds.
    solves_before, steps_before = (balancer.solves, len(balancer.plan_s)) if balancer is not None else (0, 0)
    report = GenerationReport(rank, [], intake.refused, intake.count)
    states: dict[int, Any] = {}
    records: dict[int, dict] = {}
    place = balancer is not None and balance_decodes and world > 1

    def fail(line: int, request_id: str, reason: str) -> None:
        report.failed.append({"line": line, "id": request_id, "rank": rank, "reason": f"line {line}: {reason}"})
        keep("failed", report.failed[-1])

    model = generator.model
    bar = tqdm(total=batcher.total_request_steps, disable=not progress or rank != 0, unit="step",
               desc=f"generate ({len(intake.jobs)} requests, {world} ranks)")  # fmt: skip
    try:
        with watching():
            while True:
                if deadline is not None:  # next_step may collect the plan made ahead: collective
                    deadline.at(f"step {batcher.steps_taken}")
                try:
                    step = batcher.next_step()
                except ValueError as error:  # the planner's refusal of a set: decided alike on every rank
                    raise GenerationError(f"planning step {batcher.steps_taken + 1}: {error}") from error
                if step is None:
                    break
                step_start = time.perf_counter()
                report.set_changes += step.changed
                problem = None
                for index in step.joined:
                    if index in intake.mine and problem is None:
                        request = intake.mine[index]
                        records[index] = {"id": request.id, "line": request.line, "home": rank,
                                          "tokens": batcher.jobs[index].tokens,
                                          "steps": request.steps, "first_step": step.number, "started_at": step_start}  # fmt: skip
                        clock = time.perf_counter()
                        what = "cannot start the request"
                        try:
                            states[index] = generator.start(request)
                            # The batcher runs it request.steps steps, the state finishes at its
                            # timesteps' end: a scheduler that gave another count would leave it
                            # undecoded, or index past its timesteps on this rank alone.
                            what = "its scheduler's timesteps are not its steps"
                            if (count := len(states[index].timesteps)) != request.steps:
                                raise ValueError(f"{count} timesteps for {request.steps} steps")
                            # Its inputs' shapes are the same every step: packed alone once here, a
                            # sample the model refuses is agreed on below instead of raising in a
                            # later step's pack on this rank alone.
                            what = "its inputs do not fit the packed model"
                            model.pack(states[index].samples())
                        except Exception as error:  # raised here alone, it would leave the others in the forward
                            states.pop(index, None)
                            problem = (f"rank {rank}, line {request.line} ({request.id!r}): {what}: "
                                       f"{type(error).__name__}: {error}")  # fmt: skip
                        records[index]["encode_s"] = time.perf_counter() - clock
                if step.joined:  # every rank knows the joiners: it agrees at the same steps
                    problems = [p for p in all_gather_json(problem) if p]
                    if problems:
                        raise GenerationError("; ".join(problems))
                clock = time.perf_counter()
                mine = [index for index in step.active if index in states]
                inputs = model.pack([sample for index in mine for sample in states[index].samples()]).to(
                    generator.device
                )
                if balancer is not None:
                    balancer.begin_step(step.active, step.plan, batcher.seq_lens_per_rank(step.active))
                busy += time.perf_counter() - clock
                clock = time.perf_counter()
                with torch.no_grad():
                    predictions = inputs.split(model(inputs, balancer))
                busy += balancer.forward_seconds()["compute"] if balancer is not None else time.perf_counter() - clock
                clock = time.perf_counter()
                for index in mine:  # each request's branches, in the order packed
                    branches = len(states[index].branches)
                    states[index].advance(predictions[:branches])
                    predictions = predictions[branches:]
                busy += time.perf_counter() - clock
                finished = []
                for index in [index for index in mine if states[index].done]:  # denoised: decoded next
                    record = records.pop(index)
                    record.update(last_step=step.number, denoise_s=time.perf_counter() - record.pop("started_at"))
                    finished.append((index, intake.mine[index], states.pop(index), record))
                clock = time.perf_counter()
                if place and batcher.finishing():  # every rank knows the step's leavers: it agrees alike
                    finished = _hand_over(finished, batcher, busy + time.perf_counter() - clock, generator.device,
                                          fail)  # fmt: skip
                busy += time.perf_counter() - clock  # the gather's waits too: small beside the decodes
                for _, request, state, record in finished:
                    clock = time.perf_counter()
                    try:  # a failure here is this request's alone: the rank goes on (no other rank waits on it)
                        image = generator.decode(state)
                        decode_s = time.perf_counter() - clock
                        if on_image is not None:
                            on_image(request, image)
                    except Exception as error:
                        fail(request.line, request.id, f"cannot decode or hand over the output: "
                             f"{type(error).__name__}: {error}")  # fmt: skip
                        continue
                    record.update(decode_s=decode_s, decoded_on=rank)
                    busy += decode_s
                    report.requests.append(record)
                    keep("request", record)
                bar.update(len(step.active))
    finally:
        if planner is not None:
            planner.close()
    bar.close()
    report.steps, report.wall_s, report.busy_s = batcher.steps_taken, time.perf_counter() - start, busy
    report.back_offs = batcher.back_offs
    if balancer is not None:  # unbalanced, the batcher's "solve" makes no plan
        report.solves = batcher.solves + balancer.solves - solves_before
        report.planned_ahead, report.solved_in_step = batcher.planned_ahead, batcher.solves - batcher.planned_ahead
        report.solve_in_step_s = batcher.solve_s
        report.plan_wait_s = 0.0 if planner is None else planner.wait_s
        report.plan_s, report.route_s = balancer.plan_s[steps_before:], balancer.route_s[steps_before:]
    return report


def _hand_over(finished: list[tuple[int, Request, Any, dict]], batcher: StepBatcher, busy_s: float,
               device: torch.device, fail: Callable[[int, str, str], None]) -> list[tuple[int, Request, Any, dict]]:  # fmt: skip
    """The decodes this rank runs for the step just taken: of every rank's ``finished`` requests
    (``(index, request, state, record)``, this rank's own), those
    :func:`~deepspeed_knap.generation.decodes.place_decodes` puts here. Collective: one all-gather
    of each rank's busy seconds so far (``busy_s``) and its finished requests' prices, then, if any
    decode moves, one exchange of the moving states (:meth:`Denoising.for_decode`, with their
    requests and records). A state that cannot be sent or read is ``fail``-ed (line, id, reason) on
    the rank that found it; the others go on."""
    from deepspeed_knap.generation.decodes import place_decodes
    from deepspeed_knap.runtime.groups import exchange_bytes

    rank, world = rank_and_world()
    views = all_gather_json(
        {"busy_s": busy_s, "works": [[index, state.decode_work()] for index, _, state, _ in finished]}
    )
    works = {index: work for view in views for index, work in view["works"]}
    if sorted(works) != list(batcher.finishing()):  # the same views on every rank: every rank raises
        raise RuntimeError(f"the ranks finished requests {sorted(works)} at this step; the batcher has "
                           f"{list(batcher.finishing())}")  # fmt: skip
    homes = {index: batcher.jobs[index].home for index in works}
    placed = place_decodes(works, homes, [view["busy_s"] for view in views])
    kept = [item for item in finished if placed[item[0]] == rank]
    if all(placed[index] == homes[index] for index in works):
        return kept
    outgoing: list[dict[int, tuple[int, str, bytes]]] = [{} for _ in range(world)]
    for index, request, state, record in finished:
        if placed[index] != rank:
            buffer = io.BytesIO()
            try:
                torch.save((request, state.for_decode(), record), buffer)
            except Exception as error:  # this request's alone: the exchange still runs on every rank
                fail(request.line, request.id, f"cannot send it to rank {placed[index]} to decode: "
                     f"{type(error).__name__}: {error}")  # fmt: skip
                continue
            outgoing[placed[index]][index] = (request.line, request.id, buffer.getvalue())
    for blob in exchange_bytes([pickle.dumps(items) if items else b"" for items in outgoing]):
        for index, (line, request_id, data) in (pickle.loads(blob) if blob else {}).items():
            try:  # the bytes come from this job's own ranks
                request, state, record = torch.load(io.BytesIO(data), map_location=device, weights_only=False)
            except Exception as error:
                fail(line, request_id, f"cannot read its state from rank {homes[index]} to decode: "
                     f"{type(error).__name__}: {error}")  # fmt: skip
                continue
            kept.append((index, request, state, record))
    return kept


def _solver(balancer: ReusingBalancer | None,
            max_tokens_per_gpu: int | None = None) -> Callable[[list[list[int]]], Any]:  # fmt: skip
    """The batcher's ``solve``: the balancer's planner (solver, cost model, budget), or, unbalanced,
    no plan (every request runs at home), refusing a set that puts more than ``max_tokens_per_gpu``
    on any rank (the batcher's budget is the world's total, and unbalanced each rank holds its own)."""
    from deepspeed_knap.planner.solve import plan_routing

    if balancer is None:

        def unbalanced(seq_lens_per_rank: list[list[int]]) -> None:
            loads = [sum(lengths) for lengths in seq_lens_per_rank]
            if max_tokens_per_gpu is not None and max(loads) > max_tokens_per_gpu:
                raise ValueError(f"unbalanced, the ranks would hold {loads} tokens; max_tokens_per_gpu "
                                 f"{max_tokens_per_gpu} could not be met")  # fmt: skip

        return unbalanced
    return lambda seq_lens_per_rank: plan_routing(seq_lens_per_rank, balancer.groups.topology, balancer.cost_model,
                                                  balancer.solver, balancer.max_tokens_per_gpu)  # fmt: skip
