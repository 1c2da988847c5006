"""Balanced generation on gloo ranks: every image equals diffusers' FluxPipeline (FLUX.1) or
Flux2Pipeline (FLUX.2) run alone for that request with the same seed (fp64), with requests of mixed sizes and step counts joining and leaving
mid-run under a token budget; the plan is solved once per change of the request set; bad lines are
refused on every rank alike while the others are generated.

One spawn per case (spawning costs most of the time); the ranks return their images and reports.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from tests.support.distributed import run_distributed

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
TEXT_TOKENS = 8
# 2 ranks x 160 = 320 tokens at a time: the first three requests (128 + 40 + 136 with text) start,
# the others wait and join as those leave.
BUDGET = 160


def _write_requests(path, requests) -> str:
    path.write_text("".join(json.dumps({"max_sequence_length": TEXT_TOKENS, **r}) + "\n" for r in requests))
    return str(path)


def _generate(rank: int, world: int, path: str, budget: int | None, reuse: bool, split: bool = False,
              most_requests: int | None = None, family: str = "flux") -> dict:  # fmt: skip
    """Generate ``path`` balanced; ``split``: with a cost model of attention alone and free all-to-alls,
    under which splitting a request over a group always pays; ``most_requests``: the planner refuses
    a set of more (so the batcher backs off). Counts the batcher's planner calls (made and refused)
    and the routes prepared (:meth:`KnapBalancer.route`, which ReusingBalancer calls to prepare)."""
    import deepspeed_knap.planner.solve as solve_module
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.generation.runner import generate, generation_balancer
    from deepspeed_knap.models.flux.generate import tiny_flux_generator
    from deepspeed_knap.runtime.balancer import KnapBalancer
    from tests.support.balancing import join_gloo

    counts = {"planned": 0, "refused": 0, "prepared": 0}
    plan_routing, route = solve_module.plan_routing, KnapBalancer.route

    def counting_plan_routing(seq_lens_per_rank, *args, **kwargs):  # the batcher's solve (runner._solver)
        if most_requests is not None and sum(map(len, seq_lens_per_rank)) > most_requests:
            counts["refused"] += 1
            raise ValueError("max_tokens_per_gpu could not be met (refused by the test)")
        counts["planned"] += 1
        return plan_routing(seq_lens_per_rank, *args, **kwargs)

    def counting_route(self, batch, plan):
        counts["prepared"] += 1
        return route(self, batch, plan)

    solve_module.plan_routing, KnapBalancer.route = counting_plan_routing, counting_route  # this spawned rank's own
    join_gloo(rank)
    generator = tiny_flux_generator(torch.float64, "cpu", seed=0, family=family)
    cost_model = CostModel(linear_coef=0.0, quadratic_coef=1.0) if split else None
    balancer = generation_balancer(generator.model, max_tokens_per_gpu=budget, reuse=reuse, cost_model=cost_model)
    group_sizes = set()
    begin_step = balancer.begin_step

    def recording_begin_step(request_set, plan, seq_lens_per_rank):
        group_sizes.update(int(size) for size in plan.seq_group_size)
        begin_step(request_set, plan, seq_lens_per_rank)

    balancer.begin_step = recording_begin_step
    images = {}
    report = generate(path, generator, balancer, on_image=lambda r, image: images.__setitem__(r.id, image),
                      progress=False)  # fmt: skip
    return {"images": images, "report": dataclasses.asdict(report), "group_sizes": sorted(group_sizes), **counts}


@pytest.fixture(scope="module")
def references():
    """``references(family)``: diffusers' pipeline of the family (fp64, the tiny generator's weights)
    on each request alone, at the pipeline's default guidance where a request gives none; computed
    once per family."""
    images = {}

    def of(family: str) -> dict:
        if family not in images:
            images[family] = _references(family)
        return images[family]

    return of


def _references(family: str) -> dict:
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel, FluxPipeline

    from deepspeed_knap.models.flux.finetune import (
        TINY_FLUX,
        diffusers_transformer,
        tiny_flux2_pipeline_components,
        tiny_pipeline_components,
    )
    from deepspeed_knap.models.flux.flux2 import TINY_FLUX2
    from deepspeed_knap.models.flux.generate import tiny_flux_generator

    ours = tiny_flux_generator(torch.float64, "cpu", seed=0, family=family)
    if family == "flux":
        transformer = diffusers_transformer(TINY_FLUX, ours.model.state_dict())
        pipe = FluxPipeline(**tiny_pipeline_components(TINY_FLUX, 0), transformer=transformer)
    else:
        transformer = Flux2Transformer2DModel(**TINY_FLUX2)
        transformer.load_state_dict(ours.model.state_dict())
        pipe = Flux2Pipeline(**tiny_flux2_pipeline_components(TINY_FLUX2, 0), transformer=transformer)
    pipe = pipe.to(torch.float64)
    pipe.set_progress_bar_config(disable=True)
    images = {}
    for r in REQUESTS:
        guidance = {"guidance_scale": r["guidance"]} if "guidance" in r else {}
        images[r["id"]] = pipe(prompt=r["prompt"], height=r["height"], width=r["width"], num_inference_steps=r["steps"],
                               max_sequence_length=TEXT_TOKENS, generator=torch.Generator().manual_seed(r["seed"]),
                               output_type="np", **guidance).images[0]  # fmt: skip
    return images


def _check_images(results, references, expected_ids):
    images = {name: image for result in results for name, image in result["images"].items()}
    assert sorted(images) == sorted(expected_ids)
    for name in expected_ids:
        assert images[name].shape == references[name].shape, name
        assert np.abs(images[name] - references[name]).max() < 1e-6, name
    # Same-shaped images differ: a request given another's noise or prompt would show.
    assert np.abs(references["wide"] - references["wide"][::-1]).max() > 1e-2


@pytest.mark.parametrize(("world", "budget", "most_requests", "family"),
                         [(2, BUDGET, 3, "flux"), (4, BUDGET // 2, None, "flux"), (2, BUDGET, 3, "flux2")])  # fmt: skip
def test_joins_and_leaves_equal_diffusers_and_the_plan_is_solved_once_per_set(tmp_path, references, world, budget,
                                                                              most_requests, family):  # fmt: skip
    """On 2 ranks the planner also refuses sets of more than 3 requests (the budget's total admits 4):
    the batcher backs off, and neither re-plans nor re-routes the running set while the refused
    request waits. FLUX.2 on 2 ranks: its tokens are FLUX.1's, so the run's sets are the same."""
    path = _write_requests(tmp_path / "requests.jsonl", REQUESTS)
    results = run_distributed(_generate, world, args=(path, budget, True, True, most_requests, family), timeout=300)
    _check_images(results, references(family), [r["id"] for r in REQUESTS])
    reports = [result["report"] for result in results]
    records = {r["id"]: r for report in reports for r in report["requests"]}
    # Requests ran on their home ranks (line i on rank i % world), each its own steps in a row; some
    # joined after the start, and they left at several steps.
    for index, request in enumerate(REQUESTS):
        assert request["id"] in {r["id"] for r in reports[index % world]["requests"]}
        assert records[request["id"]]["last_step"] - records[request["id"]]["first_step"] + 1 == request["steps"]
    assert max(r["first_step"] for r in records.values()) > 0
    assert len({r["last_step"] for r in records.values()}) > 2
    assert max(results[0]["group_sizes"]) > 1  # requests split over groups: Ulysses ran on reused routes
    if most_requests is not None:
        assert reports[0]["back_offs"] > 0
    for result, report in zip(results, reports, strict=True):
        assert report["steps"] == reports[0]["steps"] and report["refused"] == []
        # One plan per request set: solved at each change, reused at the other steps; the planner
        # called once per set and once per back-off, the route prepared once per set.
        assert report["solves"] == report["set_changes"] < report["steps"]
        assert result["planned"] == report["set_changes"] and result["refused"] == report["back_offs"]
        assert result["prepared"] == report["set_changes"]
        assert len(report["plan_s"]) == len(report["route_s"]) == report["steps"]


def test_bad_lines_are_refused_on_every_rank_and_the_others_generated_without_reuse(tmp_path, references):
    """Refusals agreed on every rank; the other requests generated on the training path (gather,
    solve and prepare the route every step), equal to diffusers too."""
    good = REQUESTS[:3]
    lines = [json.dumps({"max_sequence_length": TEXT_TOKENS, **good[0]}), "{not json",
             json.dumps({"prompt": "x", "height": 30, "width": 32, "max_sequence_length": TEXT_TOKENS}),
             json.dumps({"max_sequence_length": TEXT_TOKENS, **good[1]}),
             json.dumps({"prompt": "huge", "height": 96, "width": 96, "max_sequence_length": TEXT_TOKENS}),
             json.dumps({"max_sequence_length": TEXT_TOKENS, **good[2]}),
             json.dumps({"id": "small", "prompt": "again", "height": 8, "width": 8, "max_sequence_length": 8})]  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    results = run_distributed(_generate, 2, args=(str(path), BUDGET, False), timeout=300)
    _check_images(results, references("flux"), [r["id"] for r in good])
    report = results[0]["report"]
    assert report["solves"] == report["set_changes"] + report["steps"]
    assert results[0]["prepared"] == report["steps"]  # without reuse, every step prepares its route
    refused = results[0]["report"]["refused"]
    assert results[1]["report"]["refused"] == refused
    assert [r["line"] for r in refused] == [2, 3, 5, 7]
    assert "not JSON" in refused[0]["reason"]
    assert "multiples of 4 px" in refused[1]["reason"] and "e.g. 32x32" in refused[1]["reason"]
    assert "584 tokens exceed" in refused[2]["reason"] and "160 per GPU x 2 GPUs" in refused[2]["reason"]
    assert "id 'small' is line 4's too" in refused[3]["reason"]
