"""Balanced generation on gloo ranks: every image (or video) equals diffusers' FluxPipeline (FLUX.1),
Flux2Pipeline (FLUX.2), Flux2KleinPipeline (FLUX.2 [klein]), QwenImagePipeline (Qwen-Image) or
WanPipeline (Wan) run alone for that request with the same seed (fp64),
with requests of mixed sizes, frames and step counts joining and leaving mid-run under a token
budget, and classifier-free guidance's two branches as sequences of their own; the plan is solved
once per change of the request set; bad lines are refused on every rank alike while the others are
generated.

One spawn per world size (spawning costs most of the time): each rank runs one generation per
family and returns its images and reports.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.generation import check_images, reference_image, write_reference_images

pytest.importorskip("diffusers")

# Tiny FLUX.1's and FLUX.2's VAEs are 2x and their patches 2x2: sizes in multiples of 4 px, one token
# per 4x4 px.
# Mixed sizes (6 to 144 image tokens) and steps (2 to 5); text padded to 8 tokens.
REQUESTS = [
    {"id": "wide", "prompt": "a wide red barn", "height": 32, "width": 48, "steps": 4, "seed": 1},
    {"id": "small", "prompt": "a cat", "height": 16, "width": 16, "steps": 2, "seed": 2, "guidance": 5.0},
    {"id": "tall", "prompt": "a tall tower at night", "height": 64, "width": 32, "steps": 3, "seed": 3},
    {"id": "tiny", "prompt": "dot", "height": 8, "width": 12, "steps": 5, "seed": 4},
    {"id": "square", "prompt": "a square window", "height": 48, "width": 48, "steps": 2, "seed": 5},
    {"id": "odd", "prompt": "mountains 42", "height": 24, "width": 40, "steps": 3, "seed": 6, "guidance": 2.5},
    {"id": "late", "prompt": "the sea", "height": 40, "width": 24, "steps": 4, "seed": 7},
]
# FLUX.1's true classifier-free guidance: two sequences of 8 + 36 tokens per step.
GUIDED = {"id": "guided", "prompt": "a blue bird", "negative_prompt": "blurry", "true_cfg_scale": 3.0, "height": 24,
          "width": 24, "steps": 3, "seed": 8}  # fmt: skip
TEXT_TOKENS = 8
# 2 ranks x 160 = 320 tokens at a time: the first three requests (128 + 40 + 136 with text) start,
# the others wait and join as those leave.
BUDGET = 160
# Tiny Wan: an 8x VAE (4x in time) and 1x2x2 patches, one video token per 16x16 px of a latent frame.
# Clips of 1 to 13 frames; guidance 5.0 (the default) or 3.0 runs two sequences per step, 1.0 one.
# Video tokens per sequence: 18, 4, 48, 4, 16.
WAN_REQUESTS = [
    {"id": "clip", "prompt": "a red cat", "negative_prompt": "blue", "height": 32, "width": 48, "frames": 9,
     "steps": 3, "seed": 1},
    {"id": "still", "prompt": "a dog", "height": 32, "width": 32, "frames": 1, "steps": 2, "seed": 2, "guidance": 1.0},
    {"id": "long", "prompt": "bird video", "height": 48, "width": 64, "frames": 13, "steps": 4, "seed": 3},
    {"id": "short", "prompt": "the green dog", "height": 16, "width": 32, "frames": 5, "steps": 2, "seed": 4,
     "guidance": 3.0},
    {"id": "later", "prompt": "an image of a bird", "height": 64, "width": 32, "frames": 5, "steps": 3, "seed": 5},
]  # fmt: skip
# 2 ranks x 50 = 100 tokens at a time: "clip" (2 x 18) and "still" start, "long" (2 x 48) waits for
# both to leave, the last two wait for it.
WAN_BUDGET = 50
# FLUX.2 edits (Flux2Pipeline(image=...)): reference images as reference tokens after the noise's.
# The tiny VAE is 2x, so a token is 4x4 px, and the pipeline takes references of 64 px a side or more:
# "edit" holds 8 + 64 + 256 tokens, "edits" (two references) 8 + 48 + 288 + 256.
FLUX2_EDITS = [
    {"id": "edit", "prompt": "the same cat in red", "image": "ref_a.png", "height": 32, "width": 32, "steps": 3,
     "seed": 9},
    {"id": "edits", "prompt": "both together", "image": ["ref_b.png", "ref_a.png"], "height": 24, "width": 32,
     "steps": 2, "seed": 10},
]  # fmt: skip
REFERENCE_IMAGES = {"ref_a.png": (64, 64), "ref_b.png": (72, 64)}  # (height, width) px
# Tiny Qwen-Image: a 4x VAE and 2x2 patches, 8 px a token; true CFG (a negative prompt) runs two
# sequences of the two texts' lengths: the character tokenizer makes a prompt its templated characters
# less the 34 dropped (a 5-letter prompt 133 rows, " " 129), uncapped at 160. Tokens per sequence:
# "a" 161, "b" 169 and 165, "c" 170 and 166, "d" 137, "e" 160.
QWEN_TEXT = {"max_sequence_length": 160}
QWEN_REQUESTS = [
    {"id": "a", "prompt": "a red cat", "height": 32, "width": 48, "steps": 3, "seed": 1, **QWEN_TEXT},
    {"id": "b", "prompt": "a dog", "negative_prompt": " ", "height": 48, "width": 48, "steps": 2, "seed": 2,
     **QWEN_TEXT},
    {"id": "c", "prompt": "tall tower", "negative_prompt": "blurry", "true_cfg_scale": 2.5, "height": 64, "width": 32,
     "steps": 4, "seed": 3, **QWEN_TEXT},
    {"id": "d", "prompt": "dot", "height": 16, "width": 24, "steps": 5, "seed": 4, **QWEN_TEXT},
    {"id": "e", "prompt": "the sea", "height": 40, "width": 40, "steps": 2, "seed": 5, **QWEN_TEXT},
]  # fmt: skip
# 2 ranks x 200 = 400 tokens at a time: "a" starts, "b" (334) waits for it, the others join as they leave.
QWEN_BUDGET = 200
# FLUX.2 [klein] (Flux2KleinPipeline, base): above guidance 1 (its default 4.0) classifier-free
# guidance, two sequences of the same tokens (the unconditional text "" padded like the prompt, and an
# edit's references in both); guidance 1 one. Its Qwen3 chat template puts 6 tokens before the prompt:
# text padded to 24 tokens. Tokens per sequence: "wide" 24 + 96, "small" 24 + 16, "tall" 24 + 128,
# "edit" 24 + 64 + 256.
KLEIN = "flux2-klein"  # a FAMILY_REQUESTS key: FLUX.2's family, the klein pipeline
KLEIN_TEXT = {"max_sequence_length": 24}
KLEIN_REQUESTS = [
    {"id": "wide", "prompt": "a wide red barn", "height": 32, "width": 48, "steps": 4, "seed": 1, **KLEIN_TEXT},
    {"id": "small", "prompt": "a cat", "height": 16, "width": 16, "steps": 2, "seed": 2, "guidance": 1.0,
     **KLEIN_TEXT},
    {"id": "tall", "prompt": "a tall tower at night", "height": 64, "width": 32, "steps": 3, "seed": 3,
     "guidance": 2.5, **KLEIN_TEXT},
    {"id": "edit", "prompt": "the same cat in red", "image": "ref_a.png", "height": 32, "width": 32, "steps": 3,
     "seed": 9, **KLEIN_TEXT},
]  # fmt: skip
# 2 ranks x 360 = 720 tokens at a time: the first three (584) start, "edit" (688) waits for them to leave.
KLEIN_BUDGET = 360
FAMILY_REQUESTS = {"flux": [*REQUESTS, GUIDED], "flux2": [*REQUESTS, *FLUX2_EDITS], "wan": WAN_REQUESTS,
                   "qwen-image": QWEN_REQUESTS, KLEIN: KLEIN_REQUESTS}  # fmt: skip


def _tiny(family: str):
    """The tiny fp64 generator of a :data:`FAMILY_REQUESTS` key: the family's, or FLUX.2 [klein]'s."""
    from deepspeed_knap.models.flux.generate import Flux2KleinGenerator
    from deepspeed_knap.models.generators import tiny_generator

    if family == KLEIN:
        return Flux2KleinGenerator.tiny(torch.float64, "cpu", seed=0)
    return tiny_generator(family, torch.float64, "cpu", seed=0)


def _write_requests(path, requests) -> str:
    write_reference_images(path.parent, REFERENCE_IMAGES)
    path.write_text("".join(json.dumps({"max_sequence_length": TEXT_TOKENS, **r}) + "\n" for r in requests))
    return str(path)


def _generate(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """One balanced generation per ``runs`` item (``path``, ``budget``, ``reuse``, ``family``, and
    optionally ``split``: a cost model of attention alone and free all-to-alls, under which splitting
    a sequence over a group always pays; ``most_sequences``: the planner refuses a set of more, so
    the batcher backs off; ``plan_ahead``, default on). Counts, per run, the batcher's planner calls
    in this rank (made and refused; the intake's, planning a guided pair alone, apart), the sets it
    submitted to the plan worker process (whose planner the counts do not see), and the routes
    prepared (:meth:`KnapBalancer.route`, which ReusingBalancer calls to prepare)."""
    import deepspeed_knap.generation.runner as runner_module
    import deepspeed_knap.planner.solve as solve_module
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.generation.runner import GenerationError, generate, generation_balancer
    from deepspeed_knap.planner.worker import PlanWorker
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from tests.support.balancing import join_gloo

    counts: dict = {}
    most: dict = {"sequences": None}
    plan_routing, route, submit = solve_module.plan_routing, KnapBalancer.route, PlanWorker.submit

    def counting_plan_routing(seq_lens_per_rank, *args, **kwargs):  # the batcher's solve (runner._solver)
        if most["sequences"] is not None and sum(map(len, seq_lens_per_rank)) > most["sequences"]:
            counts["refused"] += 1
            raise ValueError("max_tokens_per_gpu could not be met (refused by the test)")
        counts["planned"] += 1
        return plan_routing(seq_lens_per_rank, *args, **kwargs)

    def counting_route(self, batch, plan):
        counts["prepared"] += 1
        return route(self, batch, plan)

    def counting_submit(self, *args, **kwargs):
        counts["submitted"] += 1
        return submit(self, *args, **kwargs)

    def counting_take_requests(*args, **kwargs):  # the intake plans some guided pairs alone: counted apart
        before = counts["planned"]
        intake = take_requests(*args, **kwargs)
        counts["intake_planned"], counts["planned"] = counts["planned"] - before, before
        return intake

    solve_module.plan_routing, KnapBalancer.route = counting_plan_routing, counting_route  # this spawned rank's own
    PlanWorker.submit = counting_submit
    take_requests, runner_module.take_requests = runner_module.take_requests, counting_take_requests
    join_gloo(rank)
    results, generator, balancer = [], None, None
    for run in runs:
        counts.update(planned=0, refused=0, prepared=0, submitted=0, intake_planned=0)
        most["sequences"] = run.get("most_sequences")
        family = run["family"]
        if run.get("same_balancer"):  # the run before's generator and balancer (and its plan worker) again
            vars(generator).pop("start", None)  # without the run before's failing start
        else:
            generator = _tiny(family)
        if not run.get("same_balancer"):
            cost_model = CostModel(linear_coef=0.0, quadratic_coef=1.0) if run.get("split") else None
            balancer = generation_balancer(generator.model, max_tokens_per_gpu=run["budget"], reuse=run["reuse"],
                                           cost_model=cost_model)  # fmt: skip
        group_sizes = set()
        begin_step = balancer.begin_step

        def recording_begin_step(request_set, plan, seq_lens_per_rank, begin_step=begin_step, sizes=group_sizes):
            sizes.update(int(size) for size in plan.seq_group_size)
            begin_step(request_set, plan, seq_lens_per_rank)

        balancer.begin_step = recording_begin_step
        if run.get("fail_start"):  # this id's start raises on its rank (an encoder failing after the intake)
            start = generator.start

            def failing_start(request, start=start, failing=run["fail_start"]):
                if request.id == failing:
                    raise OSError(f"the text encoder could not read {request.id}")
                return start(request)

            generator.start = failing_start
        if run.get("break_pack"):  # this id's inputs miss a key the packed model needs (no start fails)
            start = generator.start

            def breaking_start(request, start=start, broken=run["break_pack"]):
                state = start(request)
                if request.id == broken:
                    for branch in state.branches:
                        branch.pop("txt_ids")
                return state

            generator.start = breaking_start
        images = {}
        try:
            report = generate(run["path"], generator, balancer, progress=False,
                              plan_ahead=run.get("plan_ahead", True),
                              on_image=lambda r, image, images=images: images.__setitem__(r.id, image))  # fmt: skip
        except GenerationError as error:
            results.append({"error": str(error)})
            continue
        results.append({"images": images, "report": dataclasses.asdict(report), "group_sizes": sorted(group_sizes),
                        **counts})  # fmt: skip
    return results


@pytest.fixture(scope="module")
def references():
    """``references(family)``: diffusers' pipeline of the family (fp64, the tiny generator's weights)
    on each of the family's requests alone, at the pipeline's default guidance where a request
    gives none; computed once per family."""
    images = {}

    def of(family: str) -> dict:
        if family not in images:
            images[family] = _references(family)
        return images[family]

    return of


def _references(family: str) -> dict:
    from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel, FluxPipeline

    from deepspeed_knap.models.flux.finetune import (
        tiny_flux2_klein_pipeline_components,
        tiny_flux2_pipeline_components,
        tiny_pipeline_components,
    )
    from deepspeed_knap.models.flux.spec import TINY_FLUX, TINY_FLUX2, TINY_FLUX2_KLEIN
    from deepspeed_knap.models.wan.data import tiny_wan_pipeline
    from deepspeed_knap.models.wan.spec import TINY_WAN

    ours = _tiny(family)
    if family == "qwen-image":
        from diffusers import QwenImagePipeline

        transformer = type(ours.model).diffusers_model(ours.model.config, ours.model.state_dict())
        parts = {key: part for key, part in ours.pipeline.components.items() if key != "transformer"}
        pipe = QwenImagePipeline(**parts, transformer=transformer)
    elif family == "wan":
        pipe = tiny_wan_pipeline(TINY_WAN["text_dim"], TINY_WAN["in_channels"], seed=0)
        pipe.transformer = type(ours.model).diffusers_model(TINY_WAN, ours.model.state_dict())
    elif family == "flux":
        transformer = type(ours.model).diffusers_model(TINY_FLUX, ours.model.state_dict())
        pipe = FluxPipeline(**tiny_pipeline_components(TINY_FLUX, 0), transformer=transformer)
    elif family == KLEIN:
        transformer = Flux2Transformer2DModel(**TINY_FLUX2_KLEIN)
        transformer.load_state_dict(ours.model.state_dict())
        pipe = Flux2KleinPipeline(**tiny_flux2_klein_pipeline_components(TINY_FLUX2_KLEIN, 0), transformer=transformer)
    else:
        transformer = Flux2Transformer2DModel(**TINY_FLUX2)
        transformer.load_state_dict(ours.model.state_dict())
        pipe = Flux2Pipeline(**tiny_flux2_pipeline_components(TINY_FLUX2, 0), transformer=transformer)
    pipe = pipe.to(torch.float64)
    pipe.set_progress_bar_config(disable=True)
    images = {}
    for r in FAMILY_REQUESTS[family]:
        options = {"guidance_scale": r["guidance"]} if "guidance" in r else {}
        options.update({key: r[key] for key in ("negative_prompt", "true_cfg_scale") if key in r})
        if "image" in r:
            names = [r["image"]] if isinstance(r["image"], str) else r["image"]
            options["image"] = [reference_image(REFERENCE_IMAGES, name) for name in names]
        if "frames" in r:
            options["num_frames"] = r["frames"]
        output = pipe(prompt=r["prompt"], height=r["height"], width=r["width"], num_inference_steps=r["steps"],
                      max_sequence_length=r.get("max_sequence_length", TEXT_TOKENS),
                      generator=torch.Generator().manual_seed(r["seed"]),
                      output_type="np", **options)  # fmt: skip
        images[r["id"]] = output.frames[0] if family == "wan" else output.images[0]
    return images


def _check_images(results, references, expected_ids):
    check_images(results, references, expected_ids)
    # Same-shaped outputs differ: a request given another's noise or prompt would show.
    first = references[expected_ids[0]]
    assert np.abs(first - first[..., ::-1, :, :]).max() > 1e-2


# Per world size, the runs of one spawn: FLUX.1 (with a true-CFG request) on 2 ranks also under a
# planner that refuses sets of more than 3 sequences (the budget's total admits more), so the
# batcher backs off, each set solved in the step (the refusing planner is this rank's: the plan
# worker process runs the real one); FLUX.2 (its tokens are FLUX.1's), FLUX.2 [klein] (CFG pairs,
# an edit guided) and Wan (videos, CFG pairs) as well, planning each set ahead in the worker.
# FLUX.2's budget is twice FLUX.1's: its edits hold up to 600 tokens a step.
CASES = {
    2: [{"family": "flux", "budget": BUDGET, "most_sequences": 3, "plan_ahead": False},
        {"family": "flux2", "budget": 2 * BUDGET}, {"family": KLEIN, "budget": KLEIN_BUDGET},
        {"family": "wan", "budget": WAN_BUDGET}, {"family": "qwen-image", "budget": QWEN_BUDGET}],
    4: [{"family": "flux", "budget": BUDGET // 2}, {"family": "flux2", "budget": BUDGET},
        {"family": KLEIN, "budget": KLEIN_BUDGET // 2}, {"family": "qwen-image", "budget": QWEN_BUDGET // 2}],
}  # fmt: skip


@pytest.mark.parametrize("world", sorted(CASES))
def test_joins_and_leaves_equal_diffusers_and_the_plan_is_solved_once_per_set(tmp_path, references, world):
    runs = []
    for run in CASES[world]:
        path = _write_requests(tmp_path / f"{run['family']}.jsonl", FAMILY_REQUESTS[run["family"]])
        runs.append({**run, "path": path, "reuse": True, "split": True})
    by_rank = run_distributed(_generate, world, args=(runs,), timeout=300)
    moved = 0
    for position, run in enumerate(runs):
        requests = FAMILY_REQUESTS[run["family"]]
        results = [ranks[position] for ranks in by_rank]
        _check_images(results, references(run["family"]), [r["id"] for r in requests])
        reports = [result["report"] for result in results]
        records = {r["id"]: r for report in reports for r in report["requests"]}
        # Requests ran on their home ranks (line i on rank i % world), each its own steps in a row;
        # some joined after the start, and they left at several steps. Each was decoded where its
        # record is, its home's or another rank's (its state sent there).
        for index, request in enumerate(requests):
            record = records[request["id"]]
            assert record["home"] == index % world
            assert record["last_step"] - record["first_step"] + 1 == request["steps"]
        for rank, report in enumerate(reports):
            assert {r["decoded_on"] for r in report["requests"]} <= {rank}
        moved += sum(r["decoded_on"] != r["home"] for r in records.values())
        assert max(r["first_step"] for r in records.values()) > 0
        assert len({r["last_step"] for r in records.values()}) > 2
        assert max(results[0]["group_sizes"]) > 1  # sequences split over groups: Ulysses ran on reused routes
        if run.get("most_sequences") is not None:
            assert reports[0]["back_offs"] > 0
        for result, report in zip(results, reports, strict=True):
            assert report["steps"] == reports[0]["steps"] and report["refused"] == []
            # One plan per request set: solved at each change, reused at the other steps; the planner
            # called once per set and once per back-off, the route prepared once per set. Planning
            # ahead, every set after the first was solved in the worker during the set before it.
            assert report["solves"] == report["set_changes"] < report["steps"]
            assert result["refused"] == report["back_offs"]
            ahead = report["set_changes"] - 1 if run.get("plan_ahead", True) else 0
            assert result["submitted"] == report["planned_ahead"] == ahead
            assert result["planned"] == report["solved_in_step"] == report["set_changes"] - ahead
            assert result["prepared"] == report["set_changes"]
            assert len(report["plan_s"]) == len(report["route_s"]) == report["steps"]
    assert moved > 0  # some decodes ran away from home, and their outputs are still the pipeline's


def test_bad_lines_are_refused_on_every_rank_and_the_others_generated_without_reuse(tmp_path, references):
    """Refusals agreed on every rank; the other requests generated on the training path (gather,
    solve and prepare the route every step), equal to diffusers too."""
    good = REQUESTS[:3]
    lines = [json.dumps({"max_sequence_length": TEXT_TOKENS, **good[0]}), "{not json",
             json.dumps({"prompt": "x", "height": 30, "width": 32, "max_sequence_length": TEXT_TOKENS}),
             json.dumps({"max_sequence_length": TEXT_TOKENS, **good[1]}),
             json.dumps({"prompt": "huge", "height": 96, "width": 96, "max_sequence_length": TEXT_TOKENS}),
             json.dumps({"max_sequence_length": TEXT_TOKENS, **good[2]}),
             json.dumps({"id": "small", "prompt": "again", "height": 8, "width": 8, "max_sequence_length": 8}),
             json.dumps({"prompt": "y", "negative_prompt": "z", "height": 8, "width": 8, "max_sequence_length": 8})]  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    run = {"path": str(path), "budget": BUDGET, "reuse": False, "family": "flux"}
    # Then (same spawn) a request whose start fails on its rank, after the intake: every rank raises
    # the same error at the step it joins, none waits in the forward.
    failing = {"path": _write_requests(tmp_path / "failing.jsonl", REQUESTS[:4]), "budget": BUDGET // 2,
               "reuse": True, "family": "flux", "fail_start": "tiny"}  # fmt: skip
    # And the same file again on that balancer: its plan worker, left with a plan the failed run never
    # collected, plans this run's sets ahead, and the images are diffusers'.
    # A request whose inputs the packed model refuses (packed alone when it starts): the same, agreed.
    broken = {**failing, "fail_start": None, "break_pack": "wide", "same_balancer": True}
    again = {**failing, "fail_start": None, "same_balancer": True}
    by_rank = run_distributed(_generate, 2, args=([run, failing, broken, again],), timeout=300)
    assert by_rank[0][1] == by_rank[1][1]
    assert "rank 1, line 4 ('tiny'): cannot start the request: OSError: the text encoder could not read tiny" in (
        by_rank[0][1]["error"])  # fmt: skip
    assert by_rank[0][2] == by_rank[1][2]
    assert "rank 0, line 1 ('wide'): its inputs do not fit the packed model: ValueError:" in by_rank[0][2]["error"]
    assert "txt_ids" in by_rank[0][2]["error"]
    rerun = [ranks[3] for ranks in by_rank]
    _check_images(rerun, references("flux"), [r["id"] for r in REQUESTS[:4]])
    assert rerun[0]["report"]["planned_ahead"] == rerun[0]["report"]["set_changes"] - 1 > 0
    results = [ranks[0] for ranks in by_rank]
    _check_images(results, references("flux"), [r["id"] for r in good])
    report = results[0]["report"]
    assert report["solves"] == report["set_changes"] + report["steps"]
    assert results[0]["prepared"] == report["steps"]  # without reuse, every step prepares its route
    assert results[0]["submitted"] == report["planned_ahead"] == 0  # and plans nothing ahead
    refused = results[0]["report"]["refused"]
    assert results[1]["report"]["refused"] == refused
    assert [r["line"] for r in refused] == [2, 3, 5, 7, 8]
    assert "not JSON" in refused[0]["reason"]
    assert "multiples of 4 px" in refused[1]["reason"] and "e.g. 32x32" in refused[1]["reason"]
    assert "584 tokens exceed" in refused[2]["reason"] and "160 per GPU x 2 GPUs" in refused[2]["reason"]
    assert "id 'small' is line 4's too" in refused[3]["reason"]
    assert "needs both 'true_cfg_scale' above 1 and a negative prompt" in refused[4]["reason"]


TIMEOUT_S = 2


def _stopped_rank_generate(rank: int, world: int, requests: str, out: str, signals: str) -> dict:
    """``deepspeed-knap generate --timeout 2`` on 2 ranks; rank 1 stops itself (SIGSTOP, as ``kill
    -STOP`` would) while it decodes its request, after step 0. Rank 0 continues it once its own
    command has returned, so that both ranks end. Returns the exit code, what the rank printed, and
    on rank 0 the seconds from the stop to its command's return."""
    import contextlib
    import io
    import os
    import signal
    import time
    from pathlib import Path

    import deepspeed_knap.commands.generate as command
    from deepspeed_knap.cli import main

    pid_file = Path(signals) / "stopped.pid"
    load = command._load

    def load_and_stop_in_decode(args, dtype):
        generator = load(args, dtype)
        if rank == 1:
            decode = generator.decode

            def stopped_decode(state):
                pid_file.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
                return decode(state)

            generator.decode = stopped_decode
        return generator

    command._load = load_and_stop_in_decode
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        # --decode-at-home: rank 1 decodes its own request (placed, a lone decode goes to the
        # rank least busy so far, which timing decides).
        code = main(["generate", "--requests", requests, "--tiny", "--out", out, "--no-progress",
                     "--timeout", str(TIMEOUT_S), "--decode-at-home"])  # fmt: skip
    # What the command says (DeepSpeed may print that it built its op).
    said = [line for line in printed.getvalue().splitlines() if line.startswith("deepspeed-knap generate")]
    result = {"code": code, "said": said}
    if rank == 0:
        result["after_stop_s"] = time.time() - pid_file.stat().st_mtime
        os.kill(int(pid_file.read_text()), signal.SIGCONT)
    return result


def test_a_stopped_rank_fails_the_others_within_the_timeout_naming_the_step_and_the_rank(tmp_path):
    """A SIGSTOPped rank left the other waiting with no message (DeepSpeed's default: 10 minutes).
    With --timeout 2, rank 0 fails 2 s after rank 1 stopped (plus the 2 s roll call), naming the
    step it waited at and the rank that did not arrive; rank 1, continued, finds rank 0 gone and
    says so; the output rank 1 finished is kept."""
    requests = [{"id": "long", "prompt": "a", "height": 8, "width": 8, "steps": 3, "max_sequence_length": 4},
                {"id": "short", "prompt": "b", "height": 8, "width": 8, "steps": 1, "max_sequence_length": 4}]  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    (tmp_path / "signals").mkdir()
    ranks = run_distributed(_stopped_rank_generate, 2, args=(str(path), str(tmp_path / "out"),
                                                             str(tmp_path / "signals")), timeout=120)  # fmt: skip
    first, second = ranks
    assert first["code"] == second["code"] == 1
    assert first["said"] == [
        "deepspeed-knap generate: error on rank 0: step 1: rank(s) [1] did not arrive within the 2 s timeout "
        "(--timeout): stopped, stuck or slower than that; rank 0 was there"  # and it had finished nothing
    ]
    assert TIMEOUT_S <= first["after_stop_s"] < 3 * TIMEOUT_S + 5  # the timeout, the roll call, slack
    assert second["said"] == [
        "deepspeed-knap generate: error on rank 1: step 1: rank(s) [0] had left the run (failed or killed: see their "
        "output); rank 1 was there; its finished requests' timings are in "
        f"{tmp_path / 'out' / 'timings.rank1.jsonl'}"
    ]
    assert (tmp_path / "out" / "short.png").exists()
    journal = (tmp_path / "out" / "timings.rank1.jsonl").read_text().splitlines()
    assert [json.loads(line)["request"]["id"] for line in journal] == ["short"]


def _node_sizes_differ(rank: int, world: int) -> str:
    """Each rank told another node size by its launcher (a node given other slots): what
    ``generation_balancer`` raises."""
    import os

    from deepspeed_knap.generation.runner import generation_balancer
    from deepspeed_knap.runtime.groups import NODE_SIZE_VARIABLES
    from tests.support.balancing import join_gloo

    join_gloo(rank)  # (DeepSpeed's CPU all-reduce reads LOCAL_SIZE as it joins: told after)
    for name in NODE_SIZE_VARIABLES:
        os.environ.pop(name, None)
    os.environ["LOCAL_SIZE"] = str(2 - rank)
    try:
        generation_balancer(_tiny("flux").model)
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_told_other_node_sizes_raise_together_before_any_group_is_made():
    """Read on each rank, a node size that differs laid out other groups on each (and took other
    requests at the intake); now every rank raises, naming the setting and the ranks."""
    messages = run_distributed(_node_sizes_differ, 2)
    assert messages[0] == messages[1] and "gpus per node from the launcher" in messages[0], messages


def _roll_call_worker(rank: int, world: int) -> dict:
    """Two roll calls: every rank there; then rank 2 absent (busy past the roll call's grace)."""
    import time

    from deepspeed_knap.generation.deadline import Deadline
    from tests.support.balancing import join_gloo

    join_gloo(rank)
    said = {}
    for case, absent in (("all there", None), ("rank 2 absent", 2)):
        deadline = Deadline(5.0, grace_s=1.5)  # collective: every rank makes its group
        deadline.at(case)
        if rank == absent:
            time.sleep(3.0)
            continue
        said[case] = deadline.roll_call(RuntimeError("Timed out waiting for rank 2"))
    return said


def test_the_roll_call_names_the_rank_that_did_not_arrive_and_no_other():
    """With three ranks, the pings of the roll call were dropped unsent (gloo; their work was not
    kept), and after one peer timed out the others' closed pairs read as ranks that had left: rank
    0 said ranks 1 and 2 had left, where rank 2 alone was missing."""
    results = run_distributed(_roll_call_worker, 3, timeout=120)
    for rank in (0, 1, 2):
        assert "every rank answered the roll call" in results[rank]["all there"], results[rank]
    for rank in (0, 1):
        said = results[rank]["rank 2 absent"]
        assert said.startswith("rank 2 absent: rank(s) [2] did not arrive within the 5 s timeout"), said
        assert "had left" not in said and said.endswith(f"rank {rank} was there"), said
