"""Generation without ranks: the request format, step-level batching (joins, leaves, the budget, one
solve per set, the next set planned ahead), the forward-only cost model, and ``deepspeed-knap
generate`` in one process against diffusers' FluxPipeline, Flux2Pipeline and Flux2KleinPipeline."""

from __future__ import annotations

import contextlib
import functools
import json
import re

import numpy as np
import pytest
import torch

from deepspeed_knap.generation.requests import RequestError, parse_request
from deepspeed_knap.generation.schedule import Job, StepBatcher

# ---- requests ----


def test_a_request_line_with_defaults_and_a_relative_embeddings_path(tmp_path):
    request = parse_request(
        3, 7, '{"embeddings": "e.safetensors", "height": 64, "width": 32}', tmp_path, default_steps=13
    )
    assert (request.index, request.line, request.id) == (3, 7, "line7")
    assert request.embeddings == str(tmp_path / "e.safetensors") and request.prompt is None
    # steps: the caller's (the family's pipeline's); guidance and max_sequence_length: the family's
    assert (request.steps, request.guidance, request.seed, request.max_sequence_length) == (13, None, 0, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "a", "height": 64', "line 5: not JSON"),
        ('["prompt"]', "line 5: a request is a JSON object"),
        ('{"prompt": "a", "height": 64, "width": 64, "step": 4}', "unknown key(s) ['step']"),
        ('{"height": 64, "width": 64}', "exactly one of 'prompt'"),
        ('{"prompt": "a", "embeddings": "e", "height": 64, "width": 64}', "exactly one of 'prompt'"),
        ('{"prompt": "a", "width": 64}', "'height' is required"),
        ('{"prompt": "a", "height": 64, "width": 64, "steps": 0}', "'steps' must be a whole number from 1 to"),
        ('{"prompt": "a", "height": 64.0, "width": 64}', "'height' must be a whole number"),
        ('{"prompt": "a", "height": 64, "width": 64, "seed": true}', "'seed' must be a whole number from 0 to"),
        ('{"prompt": "a", "height": 64, "width": 64, "guidance": "high"}', "'guidance' must be a finite number"),
        ('{"prompt": "a", "height": 64, "width": 64, "guidance_2": NaN}', "'guidance_2' must be a finite number"),
        ('{"prompt": "a", "height": 64, "width": 64, "image": ""}', "'image' must be a path (a non-empty string) or"),
        ('{"prompt": "a", "height": 64, "width": 64, "image": []}', "a list of 1 to 16 of them; got []"),
        ('{"prompt": "a", "height": 64, "width": 64, "image": ["a", 3]}', "got ['a', 3]"),
        ('{"prompt": "a", "height": 64, "width": 64, "id": "x/y"}', "no '/' in it"),
        ('{"prompt": "a", "height": 64, "width": 64, "id": "x\\u0000y"}', "no control characters"),
        ('{"prompt": "a", "height": 64, "width": 64, "id": "' + "x" * 252 + '"}', "at most 255 bytes"),
        ('{"prompt": "a", "height": 64, "width": 64, "id": "' + "\u00e9" * 126 + '"}', "it has 256"),
        ('{"prompt": "a", "height": 64, "width": 64, "id": "\\ud800"}', "'id' must be valid Unicode"),
        ('{"prompt": "\\udfff", "height": 64, "width": 64}', "'prompt' must be valid Unicode"),
        ('{"prompt": "a", "height": 64, "width": 64, "seed": 18446744073709551616}', "from 0 to 18446744073709551615"),
        ('{"prompt": "a", "height": 64, "width": 64, "seed": -1}', "'seed' must be a whole number from 0"),
        ('{"prompt": "a", "height": 64, "width": 64, "steps": 2147483648}', "'steps' must be a whole number from 1"),
        ('{"prompt": "a", "height": 64, "width": 64, "steps": 1000000000}', "from 1 to 10000; got 1000000000"),
        ('{"prompt": "a", "height": 64, "width": 64, "seed": 1' + "0" * 5000 + "}", "not JSON that can be read"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_a_bad_request_line_is_named_by_its_line_number(text, message):
    with pytest.raises(RequestError) as error:
        parse_request(0, 5, text, default_steps=28)
    assert str(error.value).startswith("line 5: ") and message in str(error.value)


def test_the_largest_seed_and_a_255_byte_file_name_are_taken():
    request = parse_request(0, 1, json.dumps({"prompt": "a", "height": 8, "width": 8, "seed": 2**64 - 1,
                                              "id": "x" * 251}), default_steps=28)  # fmt: skip
    assert request.seed == 2**64 - 1 and len(f"{request.id}.png") == 255
    torch.Generator().manual_seed(request.seed)


class _Tokens:
    """A generator's ``request_seq_lens`` that fails as the family's checks are not meant to."""

    default_steps = 28

    def request_seq_lens(self, request):
        if request.id == "boom":
            raise RuntimeError("an unexpected failure")
        return (request.height,)


def test_the_intake_refuses_a_line_whatever_its_check_raises(tmp_path):
    """One process (no group): an unexpected error in a rank's checks is that line's refusal, so in
    a group the rank still reaches the all-gather."""
    from deepspeed_knap.generation.runner import take_requests

    lines = [{"prompt": "a", "height": 8, "width": 8}, {"id": "boom", "prompt": "b", "height": 8, "width": 8}]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "[" * 100_000 + "\n")
    intake = take_requests(path, _Tokens())
    assert [job.index for job in intake.jobs] == [0] and intake.count == 3
    assert [r["line"] for r in intake.refused] == [2, 3]
    assert intake.refused[0]["reason"] == "line 2: cannot take this request: RuntimeError: an unexpected failure"
    assert "nested too deeply" in intake.refused[1]["reason"]


@pytest.mark.parametrize(
    ("family", "steps"), [("flux", 28), ("flux2", 50), ("flux3", 50), ("wan", 50), ("qwen-image", 50)]
)
def test_a_request_without_steps_takes_its_familys_pipeline_default(tmp_path, family, steps):
    """FLUX.1's pipeline defaults to 28 steps, every other family's to 50: a request that gave none
    took 28 in every family, a different image from the pipeline's for the same request."""
    from deepspeed_knap.generation.runner import take_requests

    (tmp_path / "requests.jsonl").write_text('{"prompt": "a", "height": 16, "width": 16}\n{"prompt": "b", '
                                             '"height": 16, "width": 16, "steps": 3}\n')  # fmt: skip
    intake = take_requests(tmp_path / "requests.jsonl", _tiny_generator(family))
    assert [job.steps for job in intake.jobs] == [steps, 3] and intake.refused == []


def test_without_a_budget_one_request_over_the_ceiling_is_refused_and_the_others_taken(tmp_path):
    """No --max-tokens-per-gpu: every request runs at once, but one request of more tokens than
    the ceiling (2**18 a GPU, one GPU here) is refused at the intake with the reason (such a request
    aborted every rank and lost every other request's outputs)."""
    from deepspeed_knap.generation.runner import DEFAULT_MAX_TOKENS_PER_GPU, take_requests

    lines = [{"prompt": "a", "height": 8, "width": 8}, {"id": "huge", "prompt": "b", "height": 2**18 + 1, "width": 8},
             {"prompt": "c", "height": 2**18, "width": 8}]  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    intake = take_requests(path, _Tokens())
    assert DEFAULT_MAX_TOKENS_PER_GPU == 2**18
    assert [job.index for job in intake.jobs] == [0, 2]
    assert intake.refused == [{"line": 2, "id": "huge", "reason": "line 2: 262145 tokens exceed what the largest "
                               "group holds under the ceiling without --max-tokens-per-gpu, 262144 per GPU x 1 GPUs "
                               "= 262144; make the image smaller, or give --max-tokens-per-gpu"}]  # fmt: skip


# ---- step-level batching ----


def _record_solves():
    solved = []

    def solve(seq_lens_per_rank):
        solved.append(seq_lens_per_rank)
        return ("plan", len(solved))

    return solved, solve


def _run(batcher: StepBatcher) -> list:
    steps = []
    while (step := batcher.next_step()) is not None:
        steps.append(step)
    return steps


def test_requests_join_under_the_budget_leave_when_done_and_each_set_is_solved_once():
    jobs = [Job(0, 0, (100,), 4), Job(1, 1, (50,), 1), Job(2, 0, (40,), 2), Job(3, 1, (120,), 3)]
    solved, solve = _record_solves()
    steps = _run(StepBatcher(jobs, 2, 110, solve))  # 220 tokens at a time over 2 GPUs
    assert [step.active for step in steps] == [(0, 1, 2), (0, 2), (0, 3), (0, 3), (3,)]
    assert [step.joined for step in steps] == [(0, 1, 2), (), (3,), (), ()]  # 3 waits for room
    assert [step.left for step in steps] == [(), (1,), (2,), (), (0,)]
    # Every request ran its own steps, in a row.
    ran = {job.index: [s.number for s in steps if job.index in s.active] for job in jobs}
    assert all(ran[j.index] == list(range(ran[j.index][0], ran[j.index][0] + j.steps)) for j in jobs)
    # One solve per set change, its plan reused until the next; each rank's tokens in index order.
    assert [step.changed for step in steps] == [True, True, True, False, True]
    assert solved == [[[100, 40], [50]], [[100, 40], []], [[100], [120]], [[], [120]]]
    assert [step.plan for step in steps] == [("plan", 1), ("plan", 2), ("plan", 3), ("plan", 3), ("plan", 4)]


def test_a_waiting_request_is_not_overtaken_by_a_smaller_one_behind_it():
    _, solve = _record_solves()
    steps = _run(StepBatcher([Job(0, 0, (100,), 2), Job(1, 1, (150,), 1), Job(2, 0, (10,), 1)], 2, 100, solve))
    assert [step.active for step in steps] == [(0,), (0,), (1, 2)]


def test_without_a_budget_every_request_starts_at_once():
    solved, solve = _record_solves()
    steps = _run(StepBatcher([Job(0, 0, (500,), 2), Job(1, 1, (900,), 1)], 2, None, solve))
    assert [step.active for step in steps] == [(0, 1), (0,)] and len(solved) == 2


def test_a_request_over_the_budget_runs_alone_when_nothing_else_runs():
    """The batcher alone (no intake: in a run the intake refuses a request over what the largest group
    holds): a request over the world's total is not held back for ever; it runs by itself once
    nothing else runs."""
    _, solve = _record_solves()
    steps = _run(StepBatcher([Job(0, 0, (10,), 1), Job(1, 1, (500,), 1), Job(2, 0, (10,), 1)], 2, 100, solve))
    assert [step.active for step in steps] == [(0,), (1,), (2,)]


def test_a_set_the_planner_refuses_gives_back_its_newest_joiners():
    def solve(seq_lens_per_rank):
        if sum(map(len, seq_lens_per_rank)) > 2:  # say, no plan packs three requests under the cap
            raise ValueError("max_tokens_per_gpu could not be met")
        return "plan"

    batcher = StepBatcher([Job(i, i % 2, (10,), 1) for i in range(4)], 2, 100, solve)
    steps = _run(batcher)
    assert [step.active for step in steps] == [(0, 1), (2, 3)]
    assert (batcher.solves, batcher.back_offs) == (2, 2)  # two plans, two refused sets


def test_after_a_back_off_nothing_joins_until_a_request_leaves_and_an_unchanged_set_keeps_its_plan():
    """Multi-step requests under a budget whose token total admits three, and a planner that packs
    two at most: the refused joiner waits for a leave instead of being tried (and the running set
    re-planned) every step; one plan per set, the same plan object over the set's steps (what
    ReusingBalancer keys its prepared route on)."""
    planned = []

    def solve(seq_lens_per_rank):
        if sum(map(len, seq_lens_per_rank)) > 2:
            raise ValueError("max_tokens_per_gpu could not be met")
        planned.append(seq_lens_per_rank)
        return object()

    jobs = [Job(0, 0, (10,), 3), Job(1, 1, (10,), 6), Job(2, 0, (10,), 2), Job(3, 1, (10,), 2)]
    batcher = StepBatcher(jobs, 2, 15, solve)  # 30 tokens: three requests fit the budget
    steps = _run(batcher)
    assert [step.active for step in steps] == [(0, 1), (0, 1), (0, 1), (1, 2), (1, 2), (1, 3), (3,)]
    assert [step.changed for step in steps] == [True, False, False, True, False, True, True]
    changes = sum(step.changed for step in steps)
    assert batcher.solves == len(planned) == changes == 4
    # Each refused join was tried once, at a step where a request had just left (or the first).
    assert batcher.back_offs == 2
    plans = [step.plan for step in steps]
    assert all((plans[i] is plans[i - 1]) != steps[i].changed for i in range(1, len(steps)))


def test_unbalanced_an_unchanged_set_is_not_a_change_and_no_rank_exceeds_its_budget():
    """Unbalanced there is no plan (``None``), yet a set is a change only when it changes; each rank
    runs its own requests, so a set over one rank's budget backs off though the world's total fits."""
    from deepspeed_knap.generation.runner import _solver

    jobs = [Job(0, 0, (60,), 2), Job(1, 1, (10,), 2), Job(2, 0, (60,), 1), Job(3, 1, (10,), 1)]
    batcher = StepBatcher(jobs, 2, 100, _solver(None, 100))  # 200 tokens in all, 100 per rank
    steps = _run(batcher)
    assert [step.active for step in steps] == [(0, 1), (0, 1), (2, 3)]  # 2 waits: rank 0 would hold 120
    assert [step.changed for step in steps] == [True, False, True]
    assert batcher.back_offs == 2 and all(step.plan is None for step in steps)  # 3, then 2
    with pytest.raises(ValueError, match="could not be met"):
        _solver(None, 100)([[60, 60], [10]])
    assert _solver(None, None)([[600], []]) is None


def test_a_guided_request_gives_the_planner_two_sequences_which_it_may_place_apart():
    """Classifier-free guidance's branches are sequences of their own: with only rank 0's guided
    request running, the planner sends one branch to the idle rank (the only plan of step 1,000 puts
    one 1,000-token sequence on each GPU)."""
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.planner.solve import plan_routing
    from deepspeed_knap.planner.topology import build_topology

    batcher = StepBatcher([Job(0, 0, (1000, 1000), 2), Job(1, 1, (10,), 1)], 2, None, lambda lengths: lengths)
    assert batcher.jobs[0].tokens == 2000
    assert [step.plan for step in _run(batcher)] == [[[1000, 1000], [10]], [[1000, 1000], []]]
    plan = plan_routing([[1000, 1000], []], build_topology("g1n2", 2), CostModel(linear_coef=1.0, quadratic_coef=0.0))
    assert sorted(plan.seq_group_start.tolist()) == [0, 1] and plan.gpu_loads.tolist() == [1000, 1000]


# ---- planning the next set ahead ----


class _FakePlanAhead:
    """A plan ahead that plans with the batcher's ``solve`` when collected (the worker runs the same
    planner): the plan, or ``None`` for a set the planner refuses and for the submissions numbered
    in ``lost`` (a worker that died). Records the number of the step each submit and collect is
    part of (a submit comes as its step is given, a collect as its step is formed)."""

    def __init__(self, solve, lost=()) -> None:
        self.solve, self.lost = solve, set(lost)
        self.batcher: StepBatcher | None = None
        self.submitted: list[tuple[int, list[list[int]]]] = []  # (step, lengths)
        self.collected: list[int] = []  # steps
        self._pending = None

    def submit(self, seq_lens_per_rank):
        assert self._pending is None, "a set submitted before the last one was collected"
        self.submitted.append((self.batcher.steps_taken - 1, seq_lens_per_rank))
        self._pending = seq_lens_per_rank

    def collect(self):
        lengths, self._pending = self._pending, None
        self.collected.append(self.batcher.steps_taken)
        if len(self.collected) - 1 in self.lost:
            return None
        try:
            return self.solve(lengths)
        except ValueError:
            return None


def _refuse_more_than(most: int):
    """A planner whose plan is its input, refusing a set of more than ``most`` sequences."""

    def solve(seq_lens_per_rank):
        if sum(map(len, seq_lens_per_rank)) > most:
            raise ValueError("max_tokens_per_gpu could not be met")
        return ("plan", seq_lens_per_rank)

    return solve


def _the_plan_is_its_input(seq_lens_per_rank):
    return ("plan", seq_lens_per_rank)


# The batcher scenarios above, with planners whose plan is a function of the set (the real planner
# is deterministic): budgets, waits, a request over the budget, none, back-offs, guidance pairs.
SCENARIOS = {
    "joins_and_leaves": ([Job(0, 0, (100,), 4), Job(1, 1, (50,), 1), Job(2, 0, (40,), 2), Job(3, 1, (120,), 3)],
                         110, _the_plan_is_its_input),
    "no_overtaking": ([Job(0, 0, (100,), 2), Job(1, 1, (150,), 1), Job(2, 0, (10,), 1)], 100, _the_plan_is_its_input),
    "no_budget": ([Job(0, 0, (500,), 2), Job(1, 1, (900,), 1)], None, _the_plan_is_its_input),
    "over_the_budget_alone": ([Job(0, 0, (10,), 1), Job(1, 1, (500,), 1), Job(2, 0, (10,), 1)], 100,
                              _the_plan_is_its_input),
    "back_offs": ([Job(i, i % 2, (10,), 1) for i in range(4)], 100, _refuse_more_than(2)),
    "blocked_after_a_back_off": ([Job(0, 0, (10,), 3), Job(1, 1, (10,), 6), Job(2, 0, (10,), 2), Job(3, 1, (10,), 2)],
                                 15, _refuse_more_than(2)),
    "guided_pairs": ([Job(0, 0, (1000, 1000), 2), Job(1, 1, (10,), 1)], None, _the_plan_is_its_input),
}  # fmt: skip


def _with_and_without_plan_ahead(jobs, budget, solve, lost=()):
    """Both batchers' steps, asserted equal (sets, joins, leaves, changes, plans, solves, back-offs);
    returns the planning-ahead batcher, its plan ahead and the steps."""
    alone = StepBatcher(jobs, 2, budget, solve)
    expected = _run(alone)
    ahead = _FakePlanAhead(solve, lost)
    batcher = ahead.batcher = StepBatcher(jobs, 2, budget, solve, ahead)
    steps = _run(batcher)
    assert steps == expected
    assert (batcher.solves, batcher.back_offs) == (alone.solves, alone.back_offs)
    assert alone.planned_ahead == 0
    return batcher, ahead, steps


def _refuses(solve, seq_lens_per_rank) -> bool:
    try:
        solve(seq_lens_per_rank)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_next_set_is_submitted_when_a_set_starts_and_collected_at_its_change_with_the_same_steps(scenario):
    jobs, budget, solve = SCENARIOS[scenario]
    batcher, ahead, steps = _with_and_without_plan_ahead(jobs, budget, solve)
    # Each set but the last submits the next at its first step; the next is collected at the first
    # leave, at least one step (the submitting step's forward) later.
    assert [number for number, _ in ahead.submitted] == [step.number for step in steps if step.changed][:-1]
    changes = [step for step in steps if step.left]
    assert ahead.collected == [step.number for step in changes]
    for (submitted_at, lengths), step in zip(ahead.submitted, changes, strict=True):
        assert submitted_at < step.number
        # The set submitted is the set that starts there, unless the planner refused it (a back-off).
        assert (batcher.seq_lens_per_rank(step.active) == lengths) != _refuses(solve, lengths)
    refused = sum(_refuses(solve, lengths) for _, lengths in ahead.submitted)
    assert batcher.planned_ahead == len(ahead.submitted) - refused
    # "back_offs" backs off at its first set (solved in the step); here a set planned ahead is refused.
    assert refused == (scenario == "blocked_after_a_back_off")


def test_a_plan_that_does_not_come_is_solved_in_the_step_with_the_same_steps():
    """A worker that died (any rank's: the plan ahead gives ``None`` on every rank) costs that set
    its plan ahead, nothing else."""
    jobs, budget, solve = SCENARIOS["joins_and_leaves"]
    batcher, ahead, _ = _with_and_without_plan_ahead(jobs, budget, solve, lost={0, 2})
    assert len(ahead.submitted) == 3 and batcher.planned_ahead == 1
    jobs, budget, solve = SCENARIOS["blocked_after_a_back_off"]
    _with_and_without_plan_ahead(jobs, budget, solve, lost={1})


def test_random_runs_plan_ahead_the_sets_they_run_and_step_alike():
    """Random requests (one or two sequences, 1 to 5 steps), budgets and planners that refuse sets of
    many sequences: the batcher's claim that a set changes only when a request leaves, and so is
    known a set ahead, holds wherever the steps are the same."""
    rng = np.random.default_rng(0)
    backed_off = planned_ahead = 0
    for _ in range(200):
        count = int(rng.integers(1, 9))
        jobs = [Job(i, i % 2, tuple(int(n) for n in rng.integers(1, 60, rng.integers(1, 3))), int(rng.integers(1, 6)))
                for i in range(count)]  # fmt: skip
        budget = None if rng.random() < 0.2 else int(rng.integers(60, 160))
        batcher, _, _ = _with_and_without_plan_ahead(jobs, budget, _refuse_more_than(int(rng.integers(2, 8))))
        backed_off += batcher.back_offs > 0
        planned_ahead += batcher.planned_ahead
    assert backed_off > 50 and planned_ahead > 300  # (105 and 358)


def test_the_worker_plans_ahead_what_the_planner_plans_in_the_step_and_ranks_agree_on_a_failure(monkeypatch):
    """WorkerPlanAhead with a real plan worker: the plans bit for bit ``plan_routing``'s in the step;
    when another rank's worker gave no plan (the agreement's gather says so), this rank solves the
    set in the step too."""
    import dataclasses
    from types import SimpleNamespace

    import deepspeed_knap.generation.balancer as generation_balancer_module
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.generation.balancer import WorkerPlanAhead
    from deepspeed_knap.generation.runner import _solver
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.planner.worker import PlanWorker

    topology = build_topology("auto", 2, max_degree=2)
    worker = PlanWorker()
    balancer = SimpleNamespace(groups=SimpleNamespace(topology=topology, rank=0, group_rank=0),
                               cost_model=CostModel(linear_coef=1.0, quadratic_coef=1e-3), solver="refine",
                               max_tokens_per_gpu=200, _worker_timeout_s=60.0, plan_worker=lambda: worker)  # fmt: skip
    solve = _solver(balancer)  # generate's in-step solve

    def fields(plan) -> list:  # bit for bit: values, dtypes and shapes
        values = [getattr(plan, field.name) for field in dataclasses.fields(plan)]
        return [(v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v for v in values]

    # Sets (0, 1), (0,), (2, 3), (2,): three planned ahead.
    jobs = [Job(0, 0, (150, 150), 3), Job(1, 1, (40,), 1), Job(2, 0, (120,), 3), Job(3, 1, (30, 30), 2)]
    expected = [fields(step.plan) for step in _run(StepBatcher(jobs, 2, 200, solve))]
    try:  # the worker is the balancer's: both runs use it
        for other_rank_ready in (1, 0):
            sent = []  # this rank's part of each agreement: 1, its worker gave the plan

            def gather_ints(value, device, groups, sent=sent, other=other_rank_ready):
                sent.append(value)
                return [value, other]

            monkeypatch.setattr(generation_balancer_module, "gather_ints", gather_ints)
            planner = WorkerPlanAhead(balancer, "cpu")
            try:
                batcher = StepBatcher(jobs, 2, 200, solve, planner)
                assert [fields(step.plan) for step in _run(batcher)] == expected
            finally:
                planner.close()  # the worker stays the balancer's: the second run reuses it
            assert sent == [1, 1, 1]  # this rank's worker gave every plan
            assert batcher.planned_ahead == (3 if other_rank_ready else 0) and batcher.solves == 4
    finally:
        worker.close()


@functools.cache
def _tiny_generator(family: str):
    """The tiny generator of ``family`` in float32, or of ``"{family}-bf16"`` in bfloat16;
    ``"flux2-klein"``: FLUX.2 [klein]'s (its base checkpoint), ``"flux2-klein-distilled"`` its
    step-distilled one; ``"flux-schnell"``: FLUX.1's without a guidance embedding."""
    from deepspeed_knap.models.flux.generate import Flux2KleinGenerator
    from deepspeed_knap.models.flux.spec import TINY_FLUX
    from deepspeed_knap.models.generators import tiny_generator

    if family == "flux-schnell":
        return tiny_generator("flux", torch.float32, "cpu", config={**TINY_FLUX, "guidance_embeds": False})

    if family.startswith("flux2-klein"):
        generator = Flux2KleinGenerator.tiny(torch.float32, "cpu")
        generator.pipeline.register_to_config(is_distilled=family.endswith("-distilled"))
        return generator
    bf16 = family.endswith("-bf16")
    return tiny_generator(family.removesuffix("-bf16"), torch.bfloat16 if bf16 else torch.float32, "cpu")


@pytest.mark.parametrize(("family", "fields", "expected"), [
    ("wan", {"height": 32, "width": 48, "frames": 9}, (18, 18)),  # 3 latent frames x 2 x 3; guidance 5.0: a pair
    ("wan", {"height": 32, "width": 48, "guidance": 1.0}, (126,)),  # 81 frames (the default): 21 latent frames
    ("wan", {"height": 32, "width": 48, "frames": 8}, "1 + a multiple of 4 frames (e.g. 5 or 9)"),
    ("wan", {"height": 24, "width": 48, "frames": 5}, "multiples of 16 px"),
    ("wan", {"height": 32, "width": 48, "frames": 5, "true_cfg_scale": 2.0}, "drop 'true_cfg_scale'"),
    ("wan", {"height": 32, "width": 2048, "frames": 5}, "exceeds the model's rope_max_seq_len 64"),
    ("wan", {"height": 32, "width": 48, "frames": 5, "guidance": 1.0, "negative_prompt": "x"}, "does nothing at guidance"),
    ("flux", {"height": 32, "width": 48, "true_cfg_scale": 2.0, "negative_prompt": ""}, (104, 104)),
    ("flux", {"height": 32, "width": 48, "true_cfg_scale": 2.0}, "needs both 'true_cfg_scale' above 1"),
    ("flux", {"height": 32, "width": 48, "true_cfg_scale": 1.0}, (104,)),  # off, as in FluxPipeline
    ("flux", {"height": 32, "width": 48, "frames": 1}, "FLUX.1 makes images: drop 'frames'"),
    ("flux", {"height": 32, "width": 48, "image": "cat.png"}, "FLUX.1 generates from text alone here: drop 'image'"),
    ("flux2", {"height": 32, "width": 48, "guidance_2": 2.0}, "FLUX.2 takes 'guidance': drop 'guidance_2'"),
    ("flux-schnell", {"height": 32, "width": 48}, (104,)),
    ("flux-schnell", {"height": 32, "width": 48, "guidance": 3.5}, "this FLUX.1 transformer has no guidance "
     "embedding (as FLUX.1 [schnell]): FluxPipeline ignores 'guidance'; drop it"),
    ("wan", {"height": 32, "width": 48, "frames": 5, "max_sequence_length": 513}, "max_sequence_length 513 is over "
     "the 512 text tokens Wan's pipelines pad prompts to; give at most 512"),
    ("wan", {"height": 32, "width": 48, "frames": 5, "image": "cat.png"}, "makes videos from text alone: drop 'image'"),
    ("wan", {"height": 32, "width": 48, "frames": 5, "guidance_2": 2.0}, "one transformer: drop 'guidance_2'"),
    ("flux2", {"height": 32, "width": 48, "negative_prompt": "x"}, "FLUX.2 is guidance-distilled"),
    # FLUX.2 [klein]: classifier-free guidance above guidance 1 (4.0 unless given), "" padded like the prompt.
    ("flux2-klein", {"height": 32, "width": 48}, (8 + 96, 8 + 96)),
    ("flux2-klein", {"height": 32, "width": 48, "guidance": 1.0}, (8 + 96,)),
    ("flux2-klein", {"height": 32, "width": 48, "negative_prompt": "x"}, "Flux2KleinPipeline guides by 'guidance' "
     "alone, its unconditional text \"\" (it takes no negative prompt): drop 'negative_prompt' and 'true_cfg_scale'"),
    ("flux2-klein", {"height": 32, "width": 48, "true_cfg_scale": 2.0}, "drop 'negative_prompt' and 'true_cfg_scale'"),
    ("flux2-klein", {"height": 32, "width": 48, "max_sequence_length": 600},
     "max_sequence_length 600 is over the text encoder's 512 that Flux2KleinPipeline takes"),
    ("flux2-klein", {"height": 32, "width": 48, "frames": 1}, "FLUX.2 makes images: drop 'frames'"),
    ("flux2-klein-distilled", {"height": 32, "width": 48}, (8 + 96,)),
    ("flux2-klein-distilled", {"height": 32, "width": 48, "guidance": 1.0}, (8 + 96,)),
    ("flux2-klein-distilled", {"height": 32, "width": 48, "guidance": 2.0}, "line 1: guidance 2.0: this "
     "Flux2KleinPipeline is step-distilled (is_distilled in model_index.json) and runs without guidance, ignoring "
     "it; drop 'guidance'"),
    # Tiny Qwen-Image: 8 px a token; text rows capped by max_sequence_length (8); true CFG with a negative.
    ("qwen-image", {"height": 32, "width": 48}, (8 + 24,)),
    ("qwen-image", {"height": 32, "width": 48, "negative_prompt": " "}, (8 + 24, 8 + 24)),
    ("qwen-image", {"height": 32, "width": 48, "guidance": 3.0}, "not guidance-distilled"),
    ("qwen-image", {"height": 32, "width": 48, "true_cfg_scale": 2.0}, "needs both 'true_cfg_scale' above 1"),
    ("qwen-image", {"height": 32, "width": 48, "negative_prompt": "x", "true_cfg_scale": 1.0}, "would ignore"),
    ("qwen-image", {"height": 30, "width": 48}, "multiples of 8 px"),
    ("qwen-image", {"height": 32, "width": 48, "steps": 1}, "1 step(s): the scheduler's timesteps are not finite"),
    ("qwen-image", {"height": 32, "width": 48, "image": "cat.png"}, "edits take a QwenImageEditPlusPipeline"),
    # Refused before the text is read: with a prompt, and with embeddings (whose rows the pipeline would cut).
    ("qwen-image", {"height": 32, "width": 48, "max_sequence_length": 1500},
     "line 1: max_sequence_length 1500 is over QwenImagePipeline's 1024"),
    # 8,180 tokens wide: the text's 8 rows from RoPE position 4,090 on pass the tables' 4,096.
    ("qwen-image", {"height": 8, "width": 8 * 8180}, "8 text rows from RoPE position 4090 on"),
    # Tiny FLUX.1 in bfloat16: 4 px a patch, positions exact up to 256 patches a side (1,024 px).
    ("flux-bf16", {"height": 1024, "width": 8, "steps": 1}, (8 + 256 * 2,)),
    ("flux-bf16", {"height": 8, "width": 1028}, "image positions are bfloat16 (as FluxPipeline makes them), exact "
     "up to 256 a side; make it at most 1024 px a side"),
    ("flux2-bf16", {"height": 1028, "width": 8, "steps": 1}, (8 + 257 * 2,)),  # FLUX.2's ids are int64
])  # fmt: skip
def test_each_family_counts_a_requests_sequences_and_refuses_what_it_cannot_take(family, fields, expected):
    generator = _tiny_generator(family)
    request = parse_request(0, 1, json.dumps({"prompt": "a cat", "max_sequence_length": 8, **fields}), default_steps=28)
    if isinstance(expected, tuple):
        assert generator.request_seq_lens(request) == expected
        state = generator.start(request)  # packs the sequences the intake counted, no more
        assert tuple(generator.model.pack(state.samples()).seq_lens) == expected
        assert (state.guidance_scale is None) == (len(expected) == 1)
    else:
        with pytest.raises(RequestError, match=re.escape(expected)):
            generator.request_seq_lens(request)


@functools.cache
def _image_to_video_generator(two_experts: bool):
    """A tiny ``WanImageToVideoPipeline`` generator: Wan 2.1 I2V's (CLIP context), or two experts
    without it (I2V-A14B's), in float32."""
    from deepspeed_knap.models.wan import PackedWanTransformer
    from deepspeed_knap.models.wan.data import tiny_wan_pipeline
    from deepspeed_knap.models.wan.experts import PackedWanExperts
    from deepspeed_knap.models.wan.generate import WanGenerator
    from deepspeed_knap.models.wan.spec import TINY_WAN
    from tests.support.wan_cases import WAN22_KINDS

    kind = WAN22_KINDS["i2v_a14b" if two_experts else "i2v21"]
    pipe = tiny_wan_pipeline(image_to_video=True, image_dim=kind.get("clip"))
    if two_experts:
        pipe.register_to_config(boundary_ratio=kind["boundary"])
        model = PackedWanExperts(*(PackedWanTransformer(**{**TINY_WAN, **kind["config"]}) for _ in range(2)),
                                 boundary_ratio=kind["boundary"])  # fmt: skip
    else:
        model = PackedWanTransformer(**{**TINY_WAN, **kind["config"]})
    return WanGenerator(pipe, model.eval())


def test_a_ti2v_video_is_written_at_24_frames_per_second(tmp_path, monkeypatch):
    """Wan 2.2 TI2V-5B's clips play at 24 fps (its 121 frames: 5 s); they were written at the other
    Wan models' 16, 1.5x too slow. A GIF's delays are hundredths: frame i ends at (i + 1) / 24 s."""
    from PIL import Image

    import deepspeed_knap.commands.generate as command
    from deepspeed_knap.cli import main
    from deepspeed_knap.models.wan.generate import WanGenerator, tiny_wan_generator

    def load(args, dtype):
        tiny = tiny_wan_generator(dtype, "cpu")
        tiny.pipeline.register_to_config(expand_timesteps=True)  # TI2V-5B's WanPipeline
        return WanGenerator(tiny.pipeline, tiny.model)

    monkeypatch.setattr(command, "_load", load)
    (tmp_path / "requests.jsonl").write_text(
        '{"id": "clip", "prompt": "a cat", "height": 16, "width": 16, "frames": 5, "steps": 1}\n'
    )
    code = main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--tiny", "--family", "wan", "--out",
                 str(tmp_path / "out"), "--no-progress"])  # fmt: skip
    assert code == 0
    with Image.open(tmp_path / "out" / "clip.gif") as gif:
        durations = []
        for index in range(gif.n_frames):
            gif.seek(index)
            durations.append(gif.info["duration"])
    assert durations == [40, 40, 40, 50, 40]  # ends at 4, 8, 12, 17, 21 hundredths
    assert tiny_wan_generator(torch.float32, "cpu").frames_per_second == 16  # Wan 2.1 and 2.2 A14B


def test_an_image_to_video_pipeline_with_expand_timesteps_still_needs_an_image():
    """``WanImageToVideoPipeline(expand_timesteps=True)`` refuses a request without an image (its
    check_inputs); only TI2V-5B's ``WanPipeline`` takes one or none. Refused at the intake, not a
    TypeError at the start on every rank."""
    from deepspeed_knap.models.wan import PackedWanTransformer
    from deepspeed_knap.models.wan.data import tiny_wan_pipeline
    from deepspeed_knap.models.wan.generate import WanGenerator
    from deepspeed_knap.models.wan.spec import TINY_WAN
    from tests.support.wan_cases import WAN22_KINDS

    kind = WAN22_KINDS["i2v21"]
    pipe = tiny_wan_pipeline(image_to_video=True, image_dim=kind.get("clip"))
    pipe.register_to_config(expand_timesteps=True)
    generator = WanGenerator(pipe, PackedWanTransformer(**{**TINY_WAN, **kind["config"]}).eval())
    request = parse_request(
        0, 1, json.dumps({"prompt": "a cat", "height": 32, "width": 48, "frames": 9, "steps": 3}), default_steps=28
    )
    with pytest.raises(RequestError, match="this WanImageToVideoPipeline makes a video from an image: give 'image'"):
        generator.request_seq_lens(request)


@pytest.mark.parametrize(("two_experts", "fields", "expected"), [
    (False, {"image": "cat.png"}, (18, 18)),
    (True, {"image": "cat.png", "guidance_2": 2.0, "max_sequence_length": 8}, (18, 18)),
    (False, {}, "this WanImageToVideoPipeline makes a video from an image: give 'image'"),
    (False, {"image": "missing.png"}, "cannot read image"),
    (False, {"image": "not_an_image.png"}, "cannot read image"),
    (False, {"image": "cat.png", "max_sequence_length": 8}, "takes its text as 512 rows"),
    (False, {"image": ["cat.png", "cat.png"]}, "2 images: Wan's image to video starts from one"),
    (True, {"image": "cat.png", "guidance": 1.0, "guidance_2": 2.0, "max_sequence_length": 8}, "'guidance_2' does "
     "nothing at guidance 1.0"),
])  # fmt: skip
def test_image_to_video_requests_are_checked_at_the_intake(tmp_path, two_experts, fields, expected):
    """An image-to-video pipeline needs a readable image (the path is the request file's directory's);
    Wan 2.1 I2V's text is 512 rows (diffusers splits its context there); a two-expert pipeline takes
    ``guidance_2`` with guidance on. What the intake counts is what the start packs."""
    from PIL import Image

    Image.fromarray(np.zeros((20, 30, 3), dtype=np.uint8)).save(tmp_path / "cat.png")
    (tmp_path / "not_an_image.png").write_bytes(b"no image here")
    generator = _image_to_video_generator(two_experts)
    # 3 steps: timesteps 999, 666, 333.
    fields = {"prompt": "a cat", "height": 32, "width": 48, "frames": 9, "steps": 3, **fields}
    request = parse_request(0, 1, json.dumps(fields), tmp_path, default_steps=28)
    if isinstance(expected, tuple):
        assert request.image == (str(tmp_path / "cat.png"),)
        assert generator.request_seq_lens(request) == expected
        state = generator.start(request)
        samples = state.samples()
        assert samples[0]["hidden_states"].shape[0] == generator.model.config["in_channels"]  # noise | mask | latents
        assert tuple(generator.model.pack(samples).seq_lens) == expected
        assert ("encoder_hidden_states_image" in samples[0]) == (not two_experts)
        if two_experts:  # the low-noise expert's steps take guidance_2
            assert state.guidance_at(state.timesteps[0]) == 5.0 and state.guidance_at(state.timesteps[-1]) == 2.0
    else:
        with pytest.raises(RequestError, match=re.escape(expected)):
            generator.request_seq_lens(request)


def test_the_reference_pipeline_keeps_the_pipeline_s_settings_and_runs_both_experts(tmp_path):
    """``bench generate``'s pipeline mode runs the generator's parts with diffusers' transformers of
    the packed model's weights and the pipeline's settings that are no part: I2V-A14B's
    ``boundary_ratio``, without which diffusers runs the high-noise expert throughout. With 3 steps
    (timesteps 999, 666, 333) and a boundary at 500, the low-noise expert runs the last."""
    from PIL import Image

    Image.fromarray(np.zeros((20, 30, 3), dtype=np.uint8)).save(tmp_path / "cat.png")
    generator = _image_to_video_generator(two_experts=True)
    model = generator.model
    transformers = type(model).pipeline_transformers(model.config, model.state_dict())
    pipe = generator.reference_pipeline(transformers)
    assert type(pipe) is type(generator.pipeline) and pipe.vae is generator.pipeline.vae
    assert pipe.config.boundary_ratio == generator.pipeline.config.boundary_ratio == 0.5
    calls = {name: 0 for name in transformers}
    for name, transformer in transformers.items():
        transformer.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    fields = {"prompt": "a cat", "image": "cat.png", "height": 32, "width": 48, "frames": 5, "steps": 3,
              "max_sequence_length": 8}  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    generator.run_pipeline(pipe, parse_request(0, 1, json.dumps(fields), tmp_path, default_steps=28))
    assert calls == {"transformer": 4, "transformer_2": 2}  # two guidance branches a step


@pytest.mark.parametrize(("family", "missing"), [("flux2", "'height' and 'width'"), ("wan", "'width'")])
def test_a_request_with_an_image_may_leave_out_its_size_only_where_the_pipeline_sizes_by_it(tmp_path, family,
                                                                                            missing):  # fmt: skip
    """The intake lets a request with ``image`` leave out ``height`` and ``width`` (FLUX.3's pipeline
    takes the first reference's size); FLUX.2 and Wan here need them, and say which is missing."""
    from PIL import Image

    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(tmp_path / "cat.png")
    fields = {"prompt": "a cat", "image": "cat.png", **({"height": 32} if family == "wan" else {})}
    request = parse_request(0, 3, json.dumps(fields), tmp_path, default_steps=28)
    assert (request.width, request.max_sequence_length) == (None, None)
    # Wan: an image-to-video pipeline (it takes the image, and still needs the size)
    generator = _image_to_video_generator(two_experts=False) if family == "wan" else _tiny_generator(family)
    with pytest.raises(RequestError, match=re.escape(f"line 3: {generator.name} needs {missing} (pixels) with an "
                                                     "image too")):  # fmt: skip
        generator.request_seq_lens(request)
    with pytest.raises(RequestError, match="'height' is required"):  # without an image, as before
        parse_request(0, 3, json.dumps({"prompt": "a cat", "width": 32}), default_steps=28)


def test_flux2_references_are_counted_and_checked_as_the_pipeline_prepares_them(tmp_path):
    """A FLUX.2 request's reference images add their tokens as ``Flux2Pipeline`` prepares them (each
    side floored to 4 px for the tiny 2x VAE); an image the pipeline refuses (under 64 px a side) is
    refused at the intake, naming it."""
    from PIL import Image

    Image.fromarray(np.zeros((66, 81, 3), dtype=np.uint8)).save(tmp_path / "ref.png")  # 64 x 80 px used
    Image.fromarray(np.zeros((40, 90, 3), dtype=np.uint8)).save(tmp_path / "small.png")
    generator = _tiny_generator("flux2")
    fields = {"prompt": "a cat", "height": 32, "width": 48, "max_sequence_length": 8}
    request = parse_request(0, 1, json.dumps({**fields, "image": ["ref.png", "ref.png"]}), tmp_path, default_steps=28)
    assert generator.request_seq_lens(request) == (8 + 8 * 12 + 2 * 16 * 20,)
    state = generator.start(request)
    assert tuple(generator.model.pack(state.samples()).seq_lens) == (8 + 8 * 12 + 2 * 16 * 20,)
    assert state.target_rows(torch.zeros(8 * 12 + 2 * 16 * 20, 1)).shape[0] == 8 * 12  # the noise's rows
    small = parse_request(0, 2, json.dumps({**fields, "image": "small.png"}), tmp_path, default_steps=28)
    with pytest.raises(RequestError, match=re.escape(f"line 2: image {tmp_path / 'small.png'}: Image too small")):
        generator.request_seq_lens(small)


def test_load_wan_generator_refuses_other_wan_pipelines(tmp_path):
    from deepspeed_knap.models.wan.generate import load_wan_generator

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanVACEPipeline"}))
    with pytest.raises(ValueError, match="is a WanVACEPipeline; deepspeed-knap generate runs WanPipeline and "
                                         "WanImageToVideoPipeline checkpoints"):  # fmt: skip
        load_wan_generator(tmp_path, torch.float32, "cpu")


def test_a_wan_video_in_bfloat16_is_diffusers_own_loaded_in_bfloat16(tmp_path):
    """diffusers loads ``WanTransformer3DModel`` in bfloat16 with its ``_keep_in_fp32_modules``
    (modulation tables, time embedder, norms) in float32; the packed experts load so too, and the
    video of a request is the pipeline's, bit for bit (every parameter in bfloat16, it was 4/255 off
    on the tiny Wan 2.2 A14B)."""
    import diffusers

    from deepspeed_knap.generation.runner import generate
    from deepspeed_knap.models.wan.generate import load_wan_generator
    from tests.support.wan_cases import WAN22_KINDS, save_wan22_pipeline

    save_wan22_pipeline(tmp_path, WAN22_KINDS["a14b"])
    generator = load_wan_generator(tmp_path, torch.bfloat16, "cpu")
    kept = {name for name, p in generator.model.named_parameters() if p.dtype == torch.float32}
    assert any("scale_shift_table" in name for name in kept) and any("time_embedder" in name for name in kept)
    assert generator.dtype == torch.bfloat16
    request = {"id": "a", "prompt": "a red cat", "height": 32, "width": 48, "frames": 9, "steps": 3, "seed": 1,
               "max_sequence_length": 8}  # fmt: skip
    (tmp_path / "requests.jsonl").write_text(json.dumps(request) + "\n")
    videos = {}
    generate(str(tmp_path / "requests.jsonl"), generator, None, on_image=lambda r, video: videos.update({r.id: video}),
             progress=False)  # fmt: skip
    vae = diffusers.AutoencoderKLWan.from_pretrained(tmp_path, subfolder="vae", torch_dtype=torch.float32)
    pipe = diffusers.WanPipeline.from_pretrained(tmp_path, vae=vae, torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(prompt="a red cat", height=32, width=48, num_frames=9, num_inference_steps=3, max_sequence_length=8,
                  generator=torch.Generator().manual_seed(1), output_type="np").frames[0]  # fmt: skip
    assert np.array_equal(videos["a"], theirs)


def test_generators_name_a_model_index_that_holds_no_object(tmp_path):
    """A ``model_index.json`` of a list, or of no JSON, is refused naming the file by the Wan and
    Qwen-Image loaders before anything loads (a list's ``.get`` raised AttributeError)."""
    from deepspeed_knap.models.qwenimage.generate import QwenImageGenerator
    from deepspeed_knap.models.wan.generate import load_wan_generator

    index = tmp_path / "model_index.json"
    for text, says in (("[]", f"{index} holds a JSON list, not an object"), ("{", f"cannot read {index}")):
        index.write_text(text)
        for load in (load_wan_generator, QwenImageGenerator.load):
            with pytest.raises(ValueError, match=re.escape(says)):
                load(tmp_path, torch.float32, "cpu")


def test_a_set_without_joiners_that_cannot_be_planned_raises():
    def solve(seq_lens_per_rank):
        raise ValueError("max_tokens_per_gpu could not be met")

    with pytest.raises(ValueError, match="could not be met"):
        StepBatcher([Job(0, 0, (10,), 1)], 2, 100, solve).next_step()


def test_the_forward_cost_model_prices_a_forward_not_a_training_step():
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.generation.balancer import forward_cost_model
    from deepspeed_knap.models.flux.spec import TINY_FLUX, TINY_FLUX2
    from deepspeed_knap.models.wan.spec import from_wan_dims

    config = {**TINY_FLUX, "num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 19,
              "num_single_layers": 38}  # fmt: skip
    forward = forward_cost_model("flux", config)
    training = CostModel.from_model_dims(hidden=3072, double_blocks=19, single_blocks=38)
    assert forward.linear_coef == pytest.approx(training.linear_coef / 3)
    assert forward.quadratic_coef == pytest.approx(training.quadratic_coef / 3.5)
    assert forward.alltoall_coef == pytest.approx(training.alltoall_coef / 2)
    assert forward.num_heads == 24
    # FLUX.2's SwiGLU MLP (mlp_ratio 3.0 in its config) is three matrices: priced as a plain MLP 4.5x wide.
    flux2 = forward_cost_model("flux2", {**TINY_FLUX2, "num_attention_heads": 48, "attention_head_dim": 128})
    assert flux2.linear_coef == pytest.approx(2 * (4 + 2 * 4.5) * 6144**2 * 4 / 400e12)
    # Wan 2.1 14B's diffusers config: the same factors, and the per-sequence text term a forward's.
    wan = forward_cost_model("wan", {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824,
                              "num_layers": 40})  # fmt: skip
    wan_training = from_wan_dims(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)
    assert wan.quadratic_coef == pytest.approx(wan_training.quadratic_coef / 3.5)
    assert wan.sequence_coef == pytest.approx(wan_training.sequence_coef / 3)
    assert wan.alltoall_coef == pytest.approx(wan_training.alltoall_coef / 2)
    macs = (6 * 5120**2 + 2 * 5120 * 13824 + 2 * 512 * 5120) * 40
    assert wan.linear_coef == pytest.approx(2 * macs / 400e12)


# ---- the command, one process ----


def test_generate_command_in_one_process_writes_what_flux_pipeline_draws_and_refuses_bad_lines(tmp_path):
    from diffusers import FluxPipeline
    from PIL import Image
    from safetensors.torch import save_file

    from deepspeed_knap.cli import main
    from deepspeed_knap.models.flux.finetune import tiny_pipeline_components
    from deepspeed_knap.models.flux.generate import tiny_flux_generator
    from deepspeed_knap.models.flux.spec import TINY_FLUX

    ours = tiny_flux_generator(torch.float64, "cpu", seed=3)
    pipe = FluxPipeline(**tiny_pipeline_components(TINY_FLUX, 3),
                        transformer=type(ours.model).diffusers_model(TINY_FLUX, ours.model.state_dict())).to(torch.float64)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    text, pooled, _ = pipe.encode_prompt("precomputed", prompt_2=None, max_sequence_length=6)
    save_file({"prompt_embeds": text[0].contiguous(), "pooled_prompt_embeds": pooled[0].contiguous()},
              tmp_path / "emb.safetensors")  # fmt: skip
    save_file({"prompt_embeds": torch.zeros(6, 5)}, tmp_path / "wrong.safetensors")
    lines = [
        {"id": "prompted", "prompt": "a boat", "height": 24, "width": 16, "steps": 3, "seed": 9,
         "max_sequence_length": 8},
        {"id": "embedded", "embeddings": "emb.safetensors", "height": 16, "width": 28, "steps": 2, "seed": 4},
        {"embeddings": "wrong.safetensors", "height": 16, "width": 16},
        {"embeddings": "missing.safetensors", "height": 16, "width": 16},
        {"id": "too-long", "prompt": "x", "height": 16, "width": 16, "max_sequence_length": 600},
    ]  # fmt: skip
    (tmp_path / "requests.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code = main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--tiny", "--seed", "3",
                 "--dtype", "float64", "--out", str(tmp_path / "out"), "--no-progress"])  # fmt: skip
    assert code == 1  # some lines refused
    expected = {
        "prompted": pipe("a boat", height=24, width=16, num_inference_steps=3, max_sequence_length=8,
                         generator=torch.Generator().manual_seed(9)).images[0],
        "embedded": pipe(prompt_embeds=text, pooled_prompt_embeds=pooled, height=16, width=28, num_inference_steps=2,
                         generator=torch.Generator().manual_seed(4)).images[0],
    }  # fmt: skip
    for name, image in expected.items():
        assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / f"{name}.png")), np.asarray(image)), name
    timings = json.loads((tmp_path / "out" / "timings.json").read_text())
    assert [r["id"] for r in timings["requests"]] == ["prompted", "embedded"]
    assert [r["tokens"] for r in timings["requests"]] == [8 + 6 * 4, 6 + 4 * 7]
    reasons = [r["reason"] for r in timings["refused"]]
    assert reasons[0].startswith("line 3: embeddings") and "[Tt, 32]" in reasons[0]
    assert reasons[1].startswith("line 4: cannot read embeddings")
    assert reasons[2].startswith("line 5: max_sequence_length 600")
    assert timings["refused"][2]["id"] == "too-long"  # a line the family refuses, under its own id
    assert timings["ranks"][0]["images"] == 2 and timings["images_per_s"] > 0


def test_generate_command_with_a_tiny_flux2_writes_what_flux2_pipeline_draws_and_refuses_bad_lines(tmp_path):
    """FLUX.2: the Mistral text encoder's embeddings and ids, its own shift (``compute_empirical_mu``
    of image tokens and steps), patchified noise and ids, the guidance scale embedded, and the VAE's
    batch-norm statistics undone before decoding: each image equals Flux2Pipeline's for the request
    alone, to 1e-6 at fp64 (through the Python API) and to the byte as PNG (through the command)."""
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel
    from PIL import Image
    from safetensors.torch import save_file

    from deepspeed_knap.cli import main
    from deepspeed_knap.generation.runner import generate
    from deepspeed_knap.models.flux.finetune import tiny_flux2_pipeline_components
    from deepspeed_knap.models.flux.generate import Flux2Generator, tiny_flux_generator
    from deepspeed_knap.models.flux.spec import TINY_FLUX2

    ours = tiny_flux_generator(torch.float64, "cpu", seed=3, family="flux2")
    assert isinstance(ours, Flux2Generator)
    transformer = Flux2Transformer2DModel(**TINY_FLUX2)
    transformer.load_state_dict(ours.model.state_dict())
    pipe = Flux2Pipeline(**tiny_flux2_pipeline_components(TINY_FLUX2, 3), transformer=transformer).to(torch.float64)
    pipe.set_progress_bar_config(disable=True)
    assert not torch.allclose(pipe.vae.bn.running_var, torch.ones(1, dtype=torch.float64))  # normalisation shows
    text, _ = pipe.encode_prompt("precomputed", max_sequence_length=6)
    save_file({"prompt_embeds": text[0].contiguous()}, tmp_path / "emb.safetensors")
    save_file({"prompt_embeds": text[0, :, :5].contiguous()}, tmp_path / "wrong.safetensors")
    lines = [
        {"id": "prompted", "prompt": "a boat", "height": 24, "width": 16, "steps": 3, "seed": 9, "guidance": 2.0,
         "max_sequence_length": 8},
        {"id": "embedded", "embeddings": "emb.safetensors", "height": 16, "width": 28, "steps": 2, "seed": 4},
        {"embeddings": "wrong.safetensors", "height": 16, "width": 16},
        {"prompt": "x", "height": 18, "width": 16},
        {"prompt": "x", "height": 16, "width": 16, "max_sequence_length": 600},
    ]  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    expected = {
        "prompted": pipe(prompt="a boat", height=24, width=16, num_inference_steps=3, guidance_scale=2.0,
                         max_sequence_length=8, generator=torch.Generator().manual_seed(9), output_type="np"),
        "embedded": pipe(prompt_embeds=text, height=16, width=28, num_inference_steps=2,  # its 4.0 guidance
                         generator=torch.Generator().manual_seed(4), output_type="np"),
    }  # fmt: skip
    expected = {name: output.images[0] for name, output in expected.items()}
    images = {}
    report = generate(path, ours, on_image=lambda request, image: images.update({request.id: image}), progress=False)
    assert sorted(images) == sorted(expected)
    for name, image in expected.items():
        assert image.std() > 0.01 and np.abs(images[name] - image).max() < 1e-6, name
    code = main(["generate", "--requests", str(path), "--tiny", "--family", "flux2", "--seed", "3",
                 "--dtype", "float64", "--out", str(tmp_path / "out"), "--no-progress"])  # fmt: skip
    assert code == 1  # some lines refused
    for name, image in expected.items():
        png = np.asarray(pipe.numpy_to_pil(image[None])[0])
        assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / f"{name}.png")), png), name
    timings = json.loads((tmp_path / "out" / "timings.json").read_text())
    assert [r["tokens"] for r in timings["requests"]] == [8 + 6 * 4, 6 + 4 * 7]  # 2x VAE, 2x2 patches
    reasons = [r["reason"] for r in timings["refused"]]
    assert reasons == [r["reason"] for r in report.refused]
    assert reasons[0].startswith("line 3: embeddings") and "{'prompt_embeds': '[Tt, 48]'}" in reasons[0]
    assert reasons[1].startswith("line 4: 18x16 px: FLUX.2's VAE (2x)") and "e.g. 16x16" in reasons[1]
    assert reasons[2] == "line 5: max_sequence_length 600 is over the text encoder's 512 that Flux2Pipeline takes"


def _command_equals_saved_pipeline(tmp_path, pipeline_class, **options) -> None:
    """``generate --model-path tmp_path/model`` (float64) of one request writes the PNG the saved
    pipeline, loaded as ``pipeline_class``, gives for it alone (with ``options``)."""
    from PIL import Image

    from deepspeed_knap.cli import main

    pipe = pipeline_class.from_pretrained(tmp_path / "model", torch_dtype=torch.float64)
    pipe.set_progress_bar_config(disable=True)
    request = {"id": "a", "prompt": "a boat", "height": 24, "width": 16, "steps": 3, "seed": 9, "max_sequence_length": 8}  # fmt: skip
    (tmp_path / "requests.jsonl").write_text(json.dumps(request) + "\n")
    code = main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--model-path", str(tmp_path / "model"),
                 "--dtype", "float64", "--out", str(tmp_path / "out"), "--no-progress"])  # fmt: skip
    assert code == 0
    expected = pipe(prompt="a boat", height=24, width=16, num_inference_steps=3, max_sequence_length=8,
                    generator=torch.Generator().manual_seed(9), **options).images[0]  # fmt: skip
    assert np.array_equal(np.asarray(Image.open(tmp_path / "out" / "a.png")), np.asarray(expected))


def test_generate_command_loads_a_flux2_pipeline_directory_by_its_transformer_family(tmp_path):
    """``--model-path`` of a saved Flux2Pipeline: the checkpoint's family picks Flux2Pipeline and the
    packed FLUX.2 transformer, and the image equals the loaded pipeline's."""
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel

    from deepspeed_knap.models.flux.finetune import tiny_flux2_pipeline_components
    from deepspeed_knap.models.flux.spec import TINY_FLUX2

    torch.manual_seed(1)
    saved = Flux2Pipeline(**tiny_flux2_pipeline_components(TINY_FLUX2, 5),
                          transformer=Flux2Transformer2DModel(**TINY_FLUX2))  # fmt: skip
    saved.save_pretrained(tmp_path / "model")
    _command_equals_saved_pipeline(tmp_path, Flux2Pipeline)


def _klein_parts(seed: int, ours):
    """``Flux2KleinPipeline`` (fp64) of tiny FLUX.2 [klein]'s parts built anew for ``seed`` and the
    diffusers transformer of ``ours``' weights."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    from deepspeed_knap.models.flux.finetune import tiny_flux2_klein_pipeline_components
    from deepspeed_knap.models.flux.spec import TINY_FLUX2_KLEIN

    transformer = Flux2Transformer2DModel(**TINY_FLUX2_KLEIN)
    transformer.load_state_dict(ours.model.state_dict())
    pipe = Flux2KleinPipeline(**tiny_flux2_klein_pipeline_components(TINY_FLUX2_KLEIN, seed), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(torch.float64)


def test_flux2_klein_in_one_process_draws_what_its_pipeline_draws_guided_edited_embedded_and_distilled(tmp_path):
    """FLUX.2 [klein]: Flux2KleinPipeline's Qwen3 text, no guidance embedding, classifier-free guidance
    above guidance 1 with the unconditional text "" (or an embeddings file's negative_prompt_embeds,
    of its own length), an edit's references in both branches; a step-distilled checkpoint runs one
    branch. Each image equals the pipeline's for the request alone, to 1e-6 at fp64, and so does the
    pipeline call ``bench generate`` times (``reference_pipeline``, distilled as the generator is)."""
    from PIL import Image
    from safetensors.torch import save_file

    from deepspeed_knap.generation.runner import generate
    from deepspeed_knap.models.flux.generate import Flux2KleinGenerator

    ours = Flux2KleinGenerator.tiny(torch.float64, "cpu", seed=3)
    pipe = _klein_parts(3, ours)
    text, _ = pipe.encode_prompt("precomputed", max_sequence_length=6)
    negative, _ = pipe.encode_prompt("blurry", max_sequence_length=10)
    save_file({"prompt_embeds": text[0].contiguous(), "negative_prompt_embeds": negative[0].contiguous()},
              tmp_path / "both.safetensors")  # fmt: skip
    save_file({"prompt_embeds": text[0].contiguous()}, tmp_path / "prompt.safetensors")
    save_file({"prompt_embeds": text[0].contiguous(), "negative_prompt_embeds": negative[0, :, :5].contiguous()},
              tmp_path / "wrong.safetensors")  # fmt: skip
    reference = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 72, 3), dtype=np.uint8))
    reference.save(tmp_path / "ref.png")
    lines = [
        {"id": "both", "embeddings": "both.safetensors", "height": 16, "width": 28, "steps": 2, "seed": 4},
        {"id": "prompt", "embeddings": "prompt.safetensors", "height": 16, "width": 16, "steps": 2, "seed": 5,
         "max_sequence_length": 12, "guidance": 3.0},
        {"id": "edit", "prompt": "a boat", "image": "ref.png", "height": 24, "width": 16, "steps": 3, "seed": 9,
         "max_sequence_length": 8},
        {"embeddings": "wrong.safetensors", "height": 16, "width": 16},
    ]  # fmt: skip
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    common = {"output_type": "np", "return_dict": False}
    expected = {
        "both": pipe(prompt_embeds=text, negative_prompt_embeds=negative, height=16, width=28, num_inference_steps=2,
                     generator=torch.Generator().manual_seed(4), **common),
        "prompt": pipe(prompt_embeds=text, height=16, width=16, num_inference_steps=2, max_sequence_length=12,
                       guidance_scale=3.0, generator=torch.Generator().manual_seed(5), **common),
        "edit": pipe(prompt="a boat", image=[reference], height=24, width=16, num_inference_steps=3,
                     max_sequence_length=8, generator=torch.Generator().manual_seed(9), **common),
    }  # fmt: skip
    images = {}
    report = generate(path, ours, on_image=lambda request, image: images.update({request.id: image}), progress=False)
    assert sorted(images) == sorted(expected)
    for name, (image,) in expected.items():
        assert image[0].std() > 0.01 and np.abs(images[name] - image[0]).max() < 1e-6, name
    # Two sequences each: the file's 6 and 10 rows, 6 and "" at 12; the edit's references (64 x 72 px)
    # in both.
    tokens = {r["id"]: r["tokens"] for r in report.requests}
    assert tokens == {"both": 6 + 28 + 10 + 28, "prompt": 6 + 16 + 12 + 16, "edit": 2 * (8 + 24 + 16 * 18)}
    [refused] = report.refused
    assert refused["reason"].startswith("line 4: embeddings") and (
        "this model takes {'prompt_embeds': '[Tt, 48]', 'negative_prompt_embeds': '[Tn, 48]'}, Tt >= 1, Tn >= 1"
        in refused["reason"])  # fmt: skip
    # Step-distilled: one branch, the guidance ignored as the pipeline ignores it.
    ours.pipeline.register_to_config(is_distilled=True)
    request = parse_request(0, 1, json.dumps(lines[2]), tmp_path, default_steps=28)
    assert ours.request_seq_lens(request) == (8 + 24 + 16 * 18,)
    pipe.register_to_config(is_distilled=True)
    distilled = pipe(prompt="a boat", image=[reference], height=24, width=16, num_inference_steps=3,
                     max_sequence_length=8, generator=torch.Generator().manual_seed(9), **common)[0][0]  # fmt: skip
    assert np.abs(distilled - expected["edit"][0][0]).max() > 1e-4  # the guidance made a difference
    path.write_text(json.dumps(lines[2]) + "\n")
    generate(path, ours, on_image=lambda request, image: images.update({request.id: image}), progress=False)
    assert np.abs(images["edit"] - distilled).max() < 1e-6
    bench = ours.run_pipeline(ours.reference_pipeline({"transformer": pipe.transformer}), request).images[0]
    assert np.abs(np.asarray(bench, dtype=np.float64) / 255 - distilled).max() < 1 / 255


def test_generate_command_loads_a_flux2_klein_pipeline_directory_as_its_generator(tmp_path):
    """``--model-path`` of a saved (step-distilled) Flux2KleinPipeline: model_index.json's pipeline
    picks the klein generator for the FLUX.2 transformer, and the image equals the loaded pipeline's."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    from deepspeed_knap.models.flux.finetune import tiny_flux2_klein_pipeline_components
    from deepspeed_knap.models.flux.generate import Flux2KleinGenerator, load_flux_generator
    from deepspeed_knap.models.flux.spec import TINY_FLUX2_KLEIN

    torch.manual_seed(1)
    saved = Flux2KleinPipeline(**tiny_flux2_klein_pipeline_components(TINY_FLUX2_KLEIN, 5),
                               transformer=Flux2Transformer2DModel(**TINY_FLUX2_KLEIN), is_distilled=True)  # fmt: skip
    saved.save_pretrained(tmp_path / "model")
    loaded = load_flux_generator(tmp_path / "model", torch.float32, "cpu")
    assert type(loaded) is Flux2KleinGenerator and loaded.distilled
    _command_equals_saved_pipeline(tmp_path, Flux2KleinPipeline, guidance_scale=1.0)


def test_generate_command_takes_family_with_tiny_only(tmp_path, capsys):
    from deepspeed_knap.cli import main

    (tmp_path / "requests.jsonl").write_text('{"prompt": "a", "height": 16, "width": 16}\n')
    code = main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--model-path", str(tmp_path),
                 "--family", "flux2", "--out", str(tmp_path / "out")])  # fmt: skip
    assert code == 1
    assert "--family flux2 picks the --tiny model's family" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_generate_command_refuses_a_missing_model_path(tmp_path, capsys):
    from deepspeed_knap.cli import main

    (tmp_path / "requests.jsonl").write_text('{"prompt": "a", "height": 16, "width": 16}\n')
    code = main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--model-path", str(tmp_path / "none"),
                 "--out", str(tmp_path / "out")])  # fmt: skip
    assert code == 1
    assert "no model_index.json there" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_generate_command_stops_every_rank_on_any_load_error_and_an_out_it_cannot_make(tmp_path, capsys, monkeypatch):
    import deepspeed_knap.commands.generate as command
    from deepspeed_knap.cli import main

    (tmp_path / "requests.jsonl").write_text('{"prompt": "a", "height": 16, "width": 16}\n')
    args = ["generate", "--requests", str(tmp_path / "requests.jsonl"), "--tiny", "--no-progress"]

    def broken(args, dtype):
        raise ImportError("no module named 'damaged'")

    monkeypatch.setattr(command, "_load", broken)
    assert main([*args, "--out", str(tmp_path / "out")]) == 1
    assert "cannot load the --tiny model: ImportError: no module named 'damaged'" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main([*args, "--out", str(tmp_path / "file" / "out")]) == 1
    assert "cannot make --out" in capsys.readouterr().err


def test_generate_command_goes_on_past_an_image_it_cannot_write(tmp_path, capsys, monkeypatch):
    from PIL import Image

    from deepspeed_knap.cli import main

    kept = "kept" + "x" * 245  # the longest an id may be (its file name: 253 bytes), written aside too
    lines = [{"id": "lost", "prompt": "a", "height": 8, "width": 8, "steps": 1, "max_sequence_length": 4},
             {"id": kept, "prompt": "b", "height": 8, "width": 8, "steps": 1, "max_sequence_length": 4}]  # fmt: skip
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    save = Image.Image.save

    def failing_save(image, path, *args, **kwargs):
        if str(path).endswith("line1.png"):  # line 1's fails part way: what it wrote is not left anywhere
            with open(path, "wb") as file:
                file.write(b"\x89PNG, cut short")
            raise OSError(28, "No space left on device")
        return save(image, path, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", failing_save)
    code = main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--tiny", "--out", str(tmp_path / "out"),
                 "--no-progress"])  # fmt: skip
    assert code == 1
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [f"{kept}.png", "timings.json"]
    timings = json.loads((tmp_path / "out" / "timings.json").read_text())
    assert [u["id"] for u in timings["unwritten"]] == ["lost"] and timings["refused"] == []
    assert "No space left on device" in timings["unwritten"][0]["reason"]
    # Timed (it was generated), but not an image: the one written is.
    assert [r["id"] for r in timings["requests"]] == ["lost", kept]
    assert timings["images"] == 1 and [rank["images"] for rank in timings["ranks"]] == [1]
    printed = capsys.readouterr().out
    assert "could not write 1 output(s)" in printed and "generated 1 of 2 requests" in printed


def test_a_decode_that_fails_is_reported_and_the_run_goes_on(tmp_path):
    """A request whose decode (or hand-over) raises is the rank's own failure: reported under
    ``failed``, the other requests still generated (the rank leaves no collective behind)."""
    from deepspeed_knap.generation.runner import generate

    generator = _tiny_generator("flux")
    lines = [{"id": "lost", "prompt": "a", "height": 8, "width": 8, "steps": 2, "max_sequence_length": 4},
             {"id": "kept", "prompt": "b", "height": 8, "width": 8, "steps": 1, "max_sequence_length": 4}]  # fmt: skip
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    decode = generator.decode

    def failing_decode(state):
        if state.request.id == "lost":
            raise RuntimeError("CUDA out of memory (simulated)")
        return decode(state)

    generator.decode = failing_decode
    try:
        report = generate(tmp_path / "requests.jsonl", generator, progress=False)
    finally:
        del generator.decode  # the cached generator's own method again
    assert [r["id"] for r in report.requests] == ["kept"]
    assert [(f["id"], f["line"]) for f in report.failed] == [("lost", 1)]
    assert "cannot decode or hand over the output: RuntimeError: CUDA out of memory" in report.failed[0]["reason"]


def test_a_scheduler_that_gives_another_count_of_timesteps_stops_the_run_as_it_starts(tmp_path):
    """The batcher runs a request ``steps`` steps and its state ends at its timesteps' end: a
    scheduler giving one more left the request undecoded (one fewer: an IndexError on its rank
    alone). Refused where the request starts, agreed as any start failure is."""
    import dataclasses

    import torch

    from deepspeed_knap.generation.runner import GenerationError, generate

    generator = _tiny_generator("flux")
    line = {"id": "odd", "prompt": "a", "height": 8, "width": 8, "steps": 2, "max_sequence_length": 4}
    (tmp_path / "requests.jsonl").write_text(json.dumps(line) + "\n")
    start = generator.start

    def one_more_timestep(request):
        state = start(request)
        return dataclasses.replace(state, timesteps=torch.cat([state.timesteps, state.timesteps[-1:]]))

    generator.start = one_more_timestep
    try:
        with pytest.raises(
            GenerationError,
            match=re.escape("its scheduler's timesteps are not its steps: ValueError: 3 timesteps for 2 steps"),
        ):
            generate(tmp_path / "requests.jsonl", generator, progress=False)
    finally:
        del generator.start  # the cached generator's own method again


def test_the_intake_refuses_a_guided_pair_that_no_plan_can_place(tmp_path, monkeypatch):
    """3 ranks (auto: one group of 2 and three single GPUs), 1,000 tokens per GPU: a pair of 1,200
    tokens fits neither one group (2,400 over 2,000) nor two (only one group holds 1,200), so the real
    planner refuses it alone, at rank 0 and at rank 2, and the intake refuses both lines; a pair of
    600 fits one group: accepted without the planner."""
    import deepspeed_knap.generation.runner as runner
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.planner.solve import plan_routing
    from deepspeed_knap.planner.topology import build_topology

    class Pairs:
        default_steps = 28

        def request_seq_lens(self, request):
            return (request.height, request.height)

    lines = [{"prompt": "x", "height": n, "width": 8} for n in (1200, 600, 1200)]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.setattr(runner, "rank_and_world", lambda: (0, 3))

    def others(index: int) -> dict:  # rank index's entry for the line it owns, as its own intake made it
        n = lines[index]["height"]
        return {"index": index, "line": index + 1, "id": f"line{index + 1}", "seq_lens": [n, n], "steps": 28,
                "reason": None}  # fmt: skip

    monkeypatch.setattr(runner, "all_gather_json",
                        lambda view: [view] + [{**view, "entries": [others(index)]} for index in (1, 2)])  # fmt: skip
    topology = build_topology("auto", 3, max_degree=2)
    assert sorted(size for _, size in topology.groups) == [1, 1, 1, 2]
    calls = []

    def solve(seq_lens_per_rank):
        calls.append(seq_lens_per_rank)
        return plan_routing(seq_lens_per_rank, topology, CostModel(1e-5, 1e-8), "refine", 1000)

    intake = runner.take_requests(path, Pairs(), 1000, max_degree=2, solve=solve)
    assert [(job.index, job.home, job.seq_lens) for job in intake.jobs] == [(1, 1, (600, 600))]
    assert [r["line"] for r in intake.refused] == [1, 3]
    assert "its 2 sequences (classifier-free guidance) of [1200, 1200] tokens cannot be placed even alone" in (
        intake.refused[0]["reason"])  # fmt: skip
    assert calls == [[[1200, 1200], [], []], [[], [], [1200, 1200]]]  # 600 and 600 each fit a GPU: no planner


def test_a_pair_within_one_groups_budget_that_the_planner_cannot_place_is_refused_at_the_intake(tmp_path,
                                                                                             monkeypatch):  # fmt: skip
    """169 + 165 tokens at 167 a GPU on 2 GPUs is the budget of the pair exactly, but the pair's
    first GPU carries both sequences' odd tokens (85 + 83): the planner refuses it. Refused at the
    intake (line 1), not a ValueError of the batcher that ends the run with every queued request."""
    import deepspeed_knap.generation.runner as runner
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.planner.solve import plan_routing
    from deepspeed_knap.planner.topology import build_topology

    class Pairs:
        default_steps = 28

        def request_seq_lens(self, request):
            return (request.height, request.width)

    lines = [{"prompt": "x", "height": 169, "width": 165}, {"prompt": "x", "height": 100, "width": 60}]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.setattr(runner, "rank_and_world", lambda: (0, 2))
    other = {"index": 1, "line": 2, "id": "line2", "seq_lens": [100, 60], "steps": 28, "reason": None}
    monkeypatch.setattr(runner, "all_gather_json", lambda view: [view, {**view, "entries": [other]}])
    topology = build_topology("auto", 2, max_degree=2)

    def solve(seq_lens_per_rank):
        return plan_routing(seq_lens_per_rank, topology, CostModel(1e-5, 1e-8), "refine", 167)

    with pytest.raises(ValueError, match="could not be met"):
        solve([[169, 165], []])
    intake = runner.take_requests(path, Pairs(), 167, max_degree=2, solve=solve)
    assert [job.index for job in intake.jobs] == [1] and [r["line"] for r in intake.refused] == [1]
    assert "of [169, 165] tokens cannot be placed even alone" in intake.refused[0]["reason"]


def test_flux_embeddings_take_true_cfg_scale_1_as_off_and_above_1_need_the_negative_ones(tmp_path):
    from safetensors.torch import save_file

    generator = _tiny_generator("flux")
    config = generator.model.config
    path = tmp_path / "emb.safetensors"
    save_file({"prompt_embeds": torch.zeros(5, config["joint_attention_dim"]),
               "pooled_prompt_embeds": torch.zeros(config["pooled_projection_dim"])}, str(path))  # fmt: skip

    def request(scale):
        return parse_request(
            0,
            1,
            json.dumps({"embeddings": str(path), "height": 16, "width": 16, "true_cfg_scale": scale}),
            default_steps=28,
        )

    assert generator.request_seq_lens(request(1.0)) == (5 + 16,)  # off, as with a prompt
    with pytest.raises(RequestError, match="negative_prompt_embeds"):
        generator.request_seq_lens(request(2.0))  # on: the file must hold the negative branch


def _flux_embeddings(path, text=None, pooled=None) -> str:
    """A tiny FLUX.1 embeddings file (``prompt_embeds [5, 32]`` and ``pooled_prompt_embeds [16]``
    of ones unless given) at ``path``."""
    from safetensors.torch import save_file

    config = _tiny_generator("flux").model.config
    text = torch.ones(5, config["joint_attention_dim"]) if text is None else text
    pooled = torch.ones(config["pooled_projection_dim"]) if pooled is None else pooled
    save_file({"prompt_embeds": text, "pooled_prompt_embeds": pooled}, str(path))
    return str(path)


@pytest.mark.parametrize(("make", "message"), [
    (lambda path: _flux_embeddings(path, text=torch.full((5, 32), float("nan"))),
     "prompt_embeds holds 160 NaN or infinite value(s) of 160; give the text encoder's output"),
    (lambda path: _flux_embeddings(path, pooled=torch.tensor([float("inf")] + [0.0] * 15)),
     "pooled_prompt_embeds holds 1 NaN or infinite value(s) of 16"),
    (lambda path: _flux_embeddings(path, text=torch.ones(5, 32, dtype=torch.int64)),
     "prompt_embeds is int64; text embeddings are floating point"),
    (lambda path: _flux_embeddings(path, pooled=torch.ones(16, dtype=torch.bool)),
     "pooled_prompt_embeds is bool; text embeddings are floating point"),
    (lambda path: _flux_embeddings(path, text=torch.ones(0, 32)), "Tt >= 1"),
])  # fmt: skip
def test_embeddings_no_text_encoder_gives_are_refused_at_the_intake_naming_the_line_and_the_file(tmp_path, make,
                                                                                                   message):  # fmt: skip
    """All-NaN embeddings drew a black PNG with exit code 0; whole-number, boolean and empty ones
    were taken too. Each is the request's refusal, naming its line and file."""
    path = make(tmp_path / "emb.safetensors")
    request = parse_request(0, 3, json.dumps({"embeddings": path, "height": 16, "width": 16}), default_steps=28)
    with pytest.raises(RequestError) as error:
        _tiny_generator("flux").request_seq_lens(request)
    assert str(error.value).startswith(f"line 3: embeddings {path}") and message in str(error.value)


def test_wan_embeddings_without_the_negative_ones_under_guidance_encode_the_empty_prompt_as_diffusers_does(tmp_path):
    """diffusers' WanPipeline given prompt_embeds alone under guidance encodes the negative prompt "";
    such a request was refused, and now draws the pipeline's video (fp64 transformers)."""
    import diffusers
    from safetensors.torch import save_file

    from deepspeed_knap.generation.runner import generate
    from deepspeed_knap.models.wan.generate import load_wan_generator
    from tests.support.wan_cases import WAN22_KINDS, save_wan22_pipeline

    save_wan22_pipeline(tmp_path, WAN22_KINDS["ti2v"])
    vae = diffusers.AutoencoderKLWan.from_pretrained(tmp_path, subfolder="vae", torch_dtype=torch.float32)
    pipe = diffusers.WanPipeline.from_pretrained(tmp_path, vae=vae, torch_dtype=torch.float64)
    pipe.set_progress_bar_config(disable=True)
    text, _ = pipe.encode_prompt("a red cat", do_classifier_free_guidance=False, max_sequence_length=8)
    save_file({"prompt_embeds": text[0].contiguous()}, tmp_path / "emb.safetensors")
    request = {"id": "a", "embeddings": "emb.safetensors", "height": 32, "width": 48, "frames": 5, "steps": 2,
               "seed": 1, "max_sequence_length": 16}  # fmt: skip
    (tmp_path / "requests.jsonl").write_text(json.dumps(request) + "\n")
    videos = {}
    generator = load_wan_generator(tmp_path, torch.float64, "cpu")
    report = generate(str(tmp_path / "requests.jsonl"), generator, None,
                      on_image=lambda r, video: videos.update({r.id: video}), progress=False)  # fmt: skip
    assert (
        report.refused == []
        and generator.guidance_scale(parse_request(0, 1, json.dumps(request), default_steps=28)) > 1
    )
    theirs = pipe(prompt_embeds=text, height=32, width=48, num_frames=5, num_inference_steps=2, max_sequence_length=16,
                  generator=torch.Generator().manual_seed(1), output_type="np").frames[0]  # fmt: skip
    assert videos["a"].std() > 0.01 and np.abs(videos["a"] - theirs).max() < 1e-6


def test_wan_embeddings_with_nan_are_refused_at_the_intake(tmp_path):
    from safetensors.torch import save_file

    width = _tiny_generator("wan").model.config["text_dim"]
    text = torch.ones(4, width)
    text[2, 1] = float("nan")
    save_file({"prompt_embeds": text, "negative_prompt_embeds": torch.ones(3, width)}, tmp_path / "emb.safetensors")
    request = parse_request(0, 2, json.dumps({"embeddings": "emb.safetensors", "height": 16, "width": 16,
                                              "frames": 1}), tmp_path, default_steps=28)  # fmt: skip
    with pytest.raises(RequestError, match=r"^line 2: embeddings .*emb.safetensors: prompt_embeds holds 1 NaN"):
        _tiny_generator("wan").request_seq_lens(request)


@contextlib.contextmanager
def _fifo_unblocked_after(path, seconds: float):
    """From ``seconds`` on, until the block ends, open the FIFO ``path`` for reading and writing
    (which never blocks) and close it, every 0.1 s, in a process of its own (a reader blocked in
    ``open`` may hold this one's GIL): such a reader then goes on, and reads the end of the file.
    Without it, a test of code that opens a FIFO would hang instead of failing."""
    import subprocess

    loop = 'sleep "$1"; while :; do : <> "$2"; sleep 0.1; done'
    helper = subprocess.Popen(["sh", "-c", loop, "sh", str(seconds), str(path)])
    try:
        yield
    finally:
        helper.kill()
        helper.wait()


@pytest.mark.parametrize("which", ["embeddings", "requests"])
def test_a_fifo_is_refused_at_once_not_opened(tmp_path, which):
    """A FIFO as an embeddings file, or as the request file, hung every rank in ``open`` with no
    message. It is refused before it is opened; the other requests of the file run (the request
    file's refusal is the same error on every rank). Here a timer lets a reader blocked in ``open``
    go on after 5 s, so that a regression fails instead of hanging."""
    import os
    import time

    from deepspeed_knap.generation.requests import RequestFileError
    from deepspeed_knap.generation.runner import take_requests

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"id": "kept", "embeddings": _flux_embeddings(tmp_path / "e.safetensors"),
                                "height": 16, "width": 16}) + "\n"
                    + json.dumps({"embeddings": "fifo", "height": 16, "width": 16}) + "\n")  # fmt: skip
    start = time.monotonic()
    with _fifo_unblocked_after(fifo, 5.0):
        if which == "embeddings":
            intake = take_requests(path, _tiny_generator("flux"))
            assert [job.index for job in intake.jobs] == [0]
            assert intake.refused == [{"line": 2, "id": "line2", "reason": f"line 2: cannot read embeddings {fifo}: "
                                       "it is a FIFO (named pipe), not a regular file; give a file"}]  # fmt: skip
        else:
            with pytest.raises(RequestFileError, match=r"cannot read the request file .*fifo: it is a FIFO"):
                take_requests(fifo, _tiny_generator("flux"))
    assert time.monotonic() - start < 4.0


def test_only_regular_files_of_at_most_the_limit_are_read(tmp_path):
    import os

    from deepspeed_knap.generation.requests import read_regular_file

    (tmp_path / "ten").write_bytes(b"0123456789")
    assert read_regular_file(tmp_path / "ten", 10) == b"0123456789"
    os.symlink(tmp_path / "ten", tmp_path / "link")
    assert read_regular_file(tmp_path / "link", 10) == b"0123456789"  # a link to a regular file
    with pytest.raises(ValueError, match="it holds 10 bytes, over the 9 read at most"):
        read_regular_file(tmp_path / "ten", 9)
    with pytest.raises(ValueError, match="it is a character device, not a regular file"):
        read_regular_file("/dev/zero", 2**20)  # it would never end
    with pytest.raises(ValueError, match="it is a directory"):
        read_regular_file(tmp_path, 2**20)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing", 10)


def test_generate_command_refuses_an_out_it_cannot_write_in_before_any_work(tmp_path, capsys, monkeypatch):
    """A read-only --out lost timings.json and the summary of unwritten images after all the work;
    now a file is written and removed there first. ``/proc/self/fdinfo`` is a directory in which
    nobody, root included, can make a file."""
    import os

    import deepspeed_knap.commands.generate as command
    from deepspeed_knap.cli import main

    if not os.path.isdir("/proc/self/fdinfo"):
        pytest.skip("no /proc/self/fdinfo here")
    loads = []
    monkeypatch.setattr(command, "_load", lambda args, dtype: loads.append(args))
    (tmp_path / "requests.jsonl").write_text('{"prompt": "a", "height": 8, "width": 8}\n')
    code = main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--tiny", "--out", "/proc/self/fdinfo",
                 "--no-progress"])  # fmt: skip
    assert code == 1 and loads == []
    printed = capsys.readouterr()
    output = printed.err.strip().splitlines()
    assert printed.out == ""  # errors go to stderr, as every other command's
    assert output == ["deepspeed-knap generate: error checking --out: cannot write in --out /proc/self/fdinfo: No "
                      "such file or directory; give a directory this user can write in"]  # fmt: skip
    # A request file that cannot be read is found before the model loads too (it was after).
    code = main(["generate", "--requests", str(tmp_path / "missing.jsonl"), "--tiny", "--out", str(tmp_path / "out"),
                 "--no-progress"])  # fmt: skip
    assert code == 1 and loads == []
    assert capsys.readouterr().err.startswith("deepspeed-knap generate: error reading the requests: cannot read the "
                                              f"request file {tmp_path / 'missing.jsonl'}")  # fmt: skip


def test_generate_command_keeps_each_output_and_its_timings_as_it_finishes_when_the_run_fails_later(
    tmp_path, capsys, monkeypatch
):
    """One request finishes, then the next one's start fails on its rank (the run stops, on every
    rank alike): the first's image and its timings, in this rank's timings.rank0.jsonl, are kept
    (before, the timings went only into timings.json at the end, which a late failure never wrote).
    A run that ends removes the journal: timings.json holds it all."""
    import deepspeed_knap.commands.generate as command
    from deepspeed_knap.cli import main

    load = command._load

    def failing_second_start(args, dtype):
        generator = load(args, dtype)
        start = generator.start

        def start_or_fail(request):
            if request.id == "late":
                raise OSError("the text encoder's shard is gone (simulated)")
            return start(request)

        generator.start = start_or_fail
        return generator

    monkeypatch.setattr(command, "_load", failing_second_start)
    lines = [{"id": "done", "prompt": "a", "height": 8, "width": 8, "steps": 2, "max_sequence_length": 4},
             {"id": "late", "prompt": "b", "height": 8, "width": 8, "steps": 1, "max_sequence_length": 4},
             {"id": "refused", "prompt": "c", "height": 9, "width": 8}]  # fmt: skip
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    # 8 text + 4 image tokens each: one request at a time, so "late" joins after "done" has finished.
    args = ["generate", "--requests", str(tmp_path / "requests.jsonl"), "--tiny", "--no-progress",
            "--max-tokens-per-gpu", "12"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "out")]) == 1
    assert "cannot start the request: OSError: the text encoder's shard is gone" in capsys.readouterr().err
    out = tmp_path / "out"
    assert sorted(path.name for path in out.iterdir()) == ["done.png", "timings.rank0.jsonl"]
    journal = [json.loads(line) for line in (out / "timings.rank0.jsonl").read_text().splitlines()]
    assert [next(iter(entry)) for entry in journal] == ["refused", "request"]
    assert journal[0]["refused"]["line"] == 3 and journal[1]["request"]["id"] == "done"
    assert journal[1]["request"]["last_step"] == 1 and journal[1]["request"]["denoise_s"] > 0
    monkeypatch.setattr(command, "_load", load)
    (out / "timings.rank3.jsonl").write_text("{}\n")  # an earlier run's of 4 ranks: this one has 1
    assert main([*args, "--out", str(out)]) == 1  # the refused line
    assert sorted(path.name for path in out.iterdir()) == ["done.png", "late.png", "timings.json"]


def test_generate_command_refuses_a_flux1_pipeline_directory_holding_a_flux2_transformer(tmp_path, capsys):
    """It loaded, and then every request failed with an AttributeError inside Flux2Pipeline's
    parts (the directory's text encoders are FLUX.1's); now it is refused at load, in one line."""
    from diffusers import Flux2Transformer2DModel, FluxPipeline

    from deepspeed_knap.cli import main
    from deepspeed_knap.models.flux.finetune import tiny_pipeline_components
    from deepspeed_knap.models.flux.spec import TINY_FLUX, TINY_FLUX2

    FluxPipeline(**tiny_pipeline_components(TINY_FLUX, 0),
                 transformer=Flux2Transformer2DModel(**TINY_FLUX2)).save_pretrained(tmp_path / "model")  # fmt: skip
    (tmp_path / "requests.jsonl").write_text('{"prompt": "a", "height": 16, "width": 16, "steps": 1}\n')
    code = main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--model-path", str(tmp_path / "model"),
                 "--out", str(tmp_path / "out"), "--no-progress"])  # fmt: skip
    assert code == 1
    # (stderr also has what the libraries warn of)
    output = [line for line in capsys.readouterr().err.splitlines() if line.startswith("deepspeed-knap")]
    assert output == [f"deepspeed-knap generate: error loading the model: cannot load {tmp_path / 'model'}: "
                      f"ValueError: {tmp_path / 'model'}: its transformer is a Flux2Transformer2DModel but "
                      "model_index.json names a FluxPipeline, which takes a FluxTransformer2DModel; give a "
                      "Flux2Pipeline or Flux2KleinPipeline directory (its transformer of the same family)"]  # fmt: skip


def test_generate_timeout_is_trainings_timeout_s_and_out_of_range_is_a_usage_error(tmp_path, capsys):
    from deepspeed_knap.cli import main
    from deepspeed_knap.commands.generate import DEFAULT_TIMEOUT_S, TIMEOUT_RANGE_S
    from deepspeed_knap.runtime.config import KnapFormerConfig

    field = KnapFormerConfig.model_fields["timeout_s"]
    bounds = {type(rule).__name__: rule for rule in field.metadata}
    assert (field.default, (bounds["Ge"].ge, bounds["Le"].le)) == (DEFAULT_TIMEOUT_S, TIMEOUT_RANGE_S)
    for bad in ("0.5", "86401", "nan", "soon"):
        with pytest.raises(SystemExit) as exit_:
            main(["generate", "--requests", "r.jsonl", "--tiny", "--out", str(tmp_path), "--timeout", bad])
        assert exit_.value.code == 2 and "--timeout" in capsys.readouterr().err


def test_only_a_collectives_failure_calls_the_roll():
    """gloo raises a plain RuntimeError (the balancer wraps it, naming the step); a rank's own
    error, or one every rank raised together (GenerationError), is not a missing rank."""
    from deepspeed_knap.generation.deadline import collective_failure
    from deepspeed_knap.generation.runner import GenerationError

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for "
                        "recv operation to complete")  # fmt: skip
    try:
        try:
            raise gloo
        except RuntimeError as error:
            raise RuntimeError("knapformer step 3 failed on rank 0: ...") from error
    except RuntimeError as wrapped:
        assert collective_failure(wrapped)
    assert collective_failure(gloo)
    assert not collective_failure(RuntimeError("CUDA out of memory"))
    assert not collective_failure(GenerationError("rank 1, line 4: cannot start the request: Timed out (gloo)"))


def test_qwen_image_intake_counts_each_branchs_text_cuts_embeddings_and_refuses_far_positions(tmp_path):
    """The two CFG branches are their own texts' lengths; an embeddings file's rows are cut to
    ``max_sequence_length`` as ``encode_prompt`` cuts them (and what start packs); a request whose
    RoPE positions fall outside diffusers' tables is refused at the intake, before any rank starts it."""
    from safetensors.torch import save_file

    generator = _tiny_generator("qwen-image")
    fields = {"prompt": "a cat", "negative_prompt": "blurry and dark", "height": 32, "width": 48, "steps": 2}
    request = parse_request(0, 1, json.dumps(fields), default_steps=28)
    rows = [generator._text_rows(request, text, None) for text in ("a cat", "blurry and dark")]
    assert rows[0] != rows[1]
    assert generator.request_seq_lens(request) == (rows[0] + 24, rows[1] + 24)
    assert tuple(generator.model.pack(generator.start(request).samples()).seq_lens) == (rows[0] + 24, rows[1] + 24)
    width = generator.model.config["joint_attention_dim"]
    save_file({"prompt_embeds": torch.randn(40, width)}, str(tmp_path / "long.safetensors"))
    cut = parse_request(0, 2, json.dumps({"embeddings": "long.safetensors", "max_sequence_length": 30, "height": 32,
                                          "width": 48, "steps": 2}), tmp_path, default_steps=28)  # fmt: skip
    assert generator.request_seq_lens(cut) == (30 + 24,)
    assert tuple(generator.model.pack(generator.start(cut).samples()).seq_lens) == (30 + 24,)
    save_file({"prompt_embeds": torch.randn(1500, width)}, str(tmp_path / "longer.safetensors"))
    over = parse_request(0, 2, json.dumps({"embeddings": "longer.safetensors", "max_sequence_length": 1500,
                                           "height": 32, "width": 48, "steps": 2}), tmp_path, default_steps=28)  # fmt: skip
    with pytest.raises(RequestError, match="max_sequence_length 1500 is over QwenImagePipeline's 1024"):
        generator.request_seq_lens(over)  # as the pipeline's check_inputs refuses it
    save_file({"prompt_embeds": torch.randn(4, width), "prompt_embeds_mask": torch.ones(4)},
              str(tmp_path / "mask.safetensors"))  # fmt: skip
    masked = parse_request(
        0, 3, json.dumps({"embeddings": "mask.safetensors", "height": 32, "width": 48}), tmp_path, default_steps=28
    )
    with pytest.raises(RequestError, match="nothing else"):
        generator.request_seq_lens(masked)
    wide = parse_request(0, 4, json.dumps({"prompt": "a cat", "height": 8, "width": 65600}), default_steps=28)
    with pytest.raises(RequestError, match=re.escape("positions of Qwen-Image's RoPE tables")):
        generator.request_seq_lens(wide)


def test_qwen_image_counts_a_prompts_own_rows_without_a_max_sequence_length():
    """Without ``max_sequence_length`` a Qwen-Image prompt is its chat-templated tokens less the
    template's dropped prefix (the pipeline pads nothing), what the start packs."""
    generator = _tiny_generator("qwen-image")
    request = parse_request(
        0, 1, json.dumps({"prompt": "a cat", "height": 32, "width": 48, "steps": 2}), default_steps=28
    )
    pipe = generator.pipeline
    rows = len(pipe.tokenizer(pipe.prompt_template_encode.format("a cat"))["input_ids"]) - 34
    assert generator.request_seq_lens(request) == (rows + 24,)
    assert tuple(generator.model.pack(generator.start(request).samples()).seq_lens) == (rows + 24,)


# ---- Qwen-Image edits ----

# Edit pictures (height, width px) and what the tiny edit pipelines make of them with the sizes of
# _shrink_edit_sizes: the vision-language encoder sees square.png at 128 x 128 px (Qwen2-VL's 28 px
# grid at most 112 x 112: 16 vision tokens) and wide.png at 64 x 192 (56 x 196: 14); the VAE encodes
# them at 64 x 64 (8 px a token: 64 tokens) and 32 x 96 (48). thin.png is too narrow for the VAE's area
# (its width rounds to 0).
EDIT_IMAGES = {"square.png": (64, 64), "wide.png": (40, 120), "thin.png": (320, 16)}


@pytest.fixture
def edit_images(tmp_path, monkeypatch):
    """:data:`EDIT_IMAGES` in ``tmp_path``, and ``QwenImageEditPlusPipeline``'s module sizes shrunk
    (the generator reads them at each call, as the pipeline does): the vision-language encoder's
    images to ~112 x 112 px of area, the VAE's to ~48 x 48."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
    from PIL import Image

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", 112 * 112)
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 48 * 48)
    for index, (name, (height, width)) in enumerate(EDIT_IMAGES.items()):
        pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / name)
    return tmp_path


@functools.cache
def _tiny_edit_generator(pipeline: str):
    """The tiny generator around ``pipeline`` (``QwenImageEditPlusPipeline`` or
    ``QwenImageEditPipeline``), in float32."""
    from deepspeed_knap.models.qwenimage.generate import QWEN_IMAGE_GENERATORS

    return QWEN_IMAGE_GENERATORS[pipeline].tiny(torch.float32, "cpu")


def test_a_qwen_image_edit_counts_its_text_with_the_vision_tokens_then_the_target_and_references(edit_images):
    """Each branch: the processor's rows of the templated text (a "Picture i:" block per reference,
    each image pad expanded to the reference's vision tokens) less the 64 dropped, the target's tokens
    and each reference's at its VAE size; the unconditional branch the negative prompt's with the same
    images. Without a size, the last reference's: ``calculate_dimensions(1024 * 1024, 3)`` is 1,760 x
    576 px. What the intake counts is what the start packs."""
    generator = _tiny_edit_generator("QwenImageEditPlusPipeline")
    pipe = generator.pipeline

    def rows(prompt: str, vision: list[int]) -> int:  # the character tokenizer: one token per pad before expansion
        pictures = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(len(vision)))
        tokens = pipe.tokenizer(pipe.prompt_template_encode.format(pictures + prompt))["input_ids"]
        return len(tokens) - len(vision) + sum(vision) - 64

    cases = [
        ({"image": "square.png", "height": 32, "width": 48}, (rows("a cat", [16]) + 24 + 64,)),
        ({"image": ["square.png", "wide.png"], "negative_prompt": "dark", "height": 32, "width": 48},
         (rows("a cat", [16, 14]) + 24 + 64 + 48, rows("dark", [16, 14]) + 24 + 64 + 48)),
        ({"image": ["square.png", "wide.png"], "height": 64},  # the width the last reference's
         (rows("a cat", [16, 14]) + 8 * 220 + 64 + 48,)),
        ({"image": "wide.png"}, (rows("a cat", [14]) + 72 * 220 + 48,)),
    ]  # fmt: skip
    for fields, expected in cases:
        request = parse_request(
            0, 1, json.dumps({"prompt": "a cat", "steps": 2, **fields}), edit_images, default_steps=28
        )
        assert generator.request_seq_lens(request) == expected, fields
        state = generator.start(request)
        assert tuple(generator.model.pack(state.samples()).seq_lens) == expected, fields
        assert (state.height, state.width) == (request.height or 576, request.width or 1760)


@pytest.mark.parametrize(("pipeline", "fields", "expected"), [
    ("QwenImageEditPlusPipeline", {}, "it edits reference images; give 'image'"),
    ("QwenImageEditPlusPipeline", {"image": "square.png", "max_sequence_length": 8}, "ignores max_sequence_length: "
     "drop 'max_sequence_length'"),
    ("QwenImageEditPlusPipeline", {"image": "square.png", "height": 36}, "36x48 px: Qwen-Image's VAE (4x) and 2x2 "
     "patches need height and width in multiples of 8 px"),
    ("QwenImageEditPlusPipeline", {"image": "square.png", "guidance": 3.0}, "not guidance-distilled"),
    ("QwenImageEditPlusPipeline", {"image": "square.png", "true_cfg_scale": 2.0}, "needs both 'true_cfg_scale' "
     "above 1"),
    ("QwenImageEditPlusPipeline", {"image": ["square.png", "thin.png"]}, "thin.png is 16x320 px: "
     "QwenImageEditPlusPipeline would size it 0x224 px at 2,304 px of area"),
    ("QwenImageEditPlusPipeline", {"image": "missing.png"}, "cannot read image"),
    ("QwenImageEditPipeline", {"image": ["square.png", "square.png"]}, "2 images: QwenImageEditPipeline "
     "(Qwen-Image-Edit) edits one"),
])  # fmt: skip
def test_qwen_image_edits_refuse_what_the_pipelines_would_refuse_or_change(edit_images, pipeline, fields, expected):
    generator = _tiny_edit_generator(pipeline)
    request = parse_request(
        0, 3, json.dumps({"prompt": "a cat", "height": 32, "width": 48, **fields}), edit_images, default_steps=28
    )
    with pytest.raises(RequestError, match=re.escape(expected)) as error:
        generator.request_seq_lens(request)
    assert str(error.value).startswith("line 3: ")


def test_qwen_image_edits_in_one_process_draw_what_the_edit_pipelines_draw_sized_as_they_size(tmp_path, monkeypatch):
    """``QwenImageEditPlusPipeline`` (a default size from the last of two references, and an
    embeddings file of ``encode_prompt(prompt, image=...)`` with its negative, true CFG) and
    ``QwenImageEditPipeline`` (one reference, at the pipeline's default size with true CFG, and a
    height given): each image equals the pipeline's for the request alone (fp64, 1e-6). Both
    pipelines' ``calculate_dimensions`` shrink every area 256-fold here (1 megapixel: 64 x 64 px)."""
    import diffusers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
    from PIL import Image
    from safetensors.torch import save_file

    from deepspeed_knap.generation.runner import generate
    from deepspeed_knap.models.qwenimage.generate import QWEN_IMAGE_GENERATORS

    for module in (pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus):
        monkeypatch.setattr(module, "calculate_dimensions",
                            functools.partial(lambda original, area, ratio: original(area // 256, ratio),
                                              module.calculate_dimensions))  # fmt: skip
    references = {"a.png": (64, 64), "b.png": (72, 50)}
    for index, (name, (height, width)) in enumerate(references.items()):
        pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / name)
    images = {name: Image.open(tmp_path / name).convert("RGB") for name in references}
    for pipeline in ("QwenImageEditPlusPipeline", "QwenImageEditPipeline"):
        ours = QWEN_IMAGE_GENERATORS[pipeline].tiny(torch.float64, "cpu", seed=1)
        transformer = type(ours.model).diffusers_model(ours.model.config, ours.model.state_dict())
        parts = {key: part for key, part in ours.pipeline.components.items() if key != "transformer"}
        pipe = getattr(diffusers, pipeline)(**parts, transformer=transformer).to(torch.float64)
        pipe.set_progress_bar_config(disable=True)
        if pipeline == "QwenImageEditPlusPipeline":
            image = [images["a.png"], images["b.png"]]
            text = pipe.encode_prompt("precomputed", image=[images["a.png"]])[0]
            negative = pipe.encode_prompt(" ", image=[images["a.png"]])[0]
            save_file({"prompt_embeds": text[0].contiguous(), "negative_prompt_embeds": negative[0].contiguous()},
                      tmp_path / "emb.safetensors")  # fmt: skip
            lines = [{"id": "sized", "prompt": "make it red", "image": ["a.png", "b.png"], "steps": 3, "seed": 2},
                     {"id": "embedded", "embeddings": "emb.safetensors", "image": "a.png", "height": 24, "width": 40,
                      "true_cfg_scale": 3.0, "steps": 2, "seed": 3}]  # fmt: skip
            expected = {"sized": pipe(image=image, prompt="make it red", num_inference_steps=3, output_type="np",
                                      generator=torch.Generator().manual_seed(2)),
                        "embedded": pipe(image=[images["a.png"]], prompt_embeds=text, negative_prompt_embeds=negative,
                                         true_cfg_scale=3.0, height=24, width=40, num_inference_steps=2,
                                         output_type="np", generator=torch.Generator().manual_seed(3))}  # fmt: skip
        else:
            lines = [{"id": "sized", "prompt": "make it red", "image": "b.png", "negative_prompt": " ", "steps": 3,
                      "seed": 2},
                     {"id": "tall", "prompt": "in blue", "image": "a.png", "height": 40, "steps": 2, "seed": 3}]  # fmt: skip
            expected = {"sized": pipe(image=images["b.png"], prompt="make it red", negative_prompt=" ",
                                      num_inference_steps=3, output_type="np", generator=torch.Generator().manual_seed(2)),
                        "tall": pipe(image=images["a.png"], prompt="in blue", height=40, num_inference_steps=2,
                                     output_type="np", generator=torch.Generator().manual_seed(3))}  # fmt: skip
        path = tmp_path / f"{pipeline}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        drawn = {}
        report = generate(path, ours, on_image=lambda request, image, drawn=drawn: drawn.update({request.id: image}),
                          progress=False)  # fmt: skip
        assert report.refused == [] and sorted(drawn) == sorted(expected)
        for name, output in expected.items():
            image = output.images[0]
            assert drawn[name].shape == image.shape, (pipeline, name)
            assert image.std() > 0.01 and np.abs(drawn[name] - image).max() < 1e-6, (pipeline, name)
        # The last (Edit-Plus) or only (Edit) reference sizes the image: b.png's 50:72 is 64 x 64 px.
        assert drawn["sized"].shape == (64, 64, 3)


def test_qwen_image_load_follows_the_folders_pipeline_and_refuses_others(tmp_path, monkeypatch):
    """``QwenImageGenerator.load`` (the family's) gives the generator of the folder's pipeline
    class: an edit folder the edit generator; another Qwen-Image pipeline is refused, naming those
    taken."""
    import diffusers

    from deepspeed_knap.models.qwenimage.generate import QwenImageEditPlusGenerator, QwenImageGenerator
    from deepspeed_knap.models.qwenimage.qwenimage import PackedQwenImageTransformer

    tiny = _tiny_edit_generator("QwenImageEditPlusPipeline")
    loaded = []
    monkeypatch.setattr(diffusers.QwenImageEditPlusPipeline, "from_pretrained",
                        lambda path, **kwargs: loaded.append(kwargs) or tiny.pipeline)  # fmt: skip
    monkeypatch.setattr(PackedQwenImageTransformer, "from_pretrained", lambda path, **kwargs: tiny.model)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPlusPipeline"}))
    generator = QwenImageGenerator.load(tmp_path, torch.float32, "cpu")
    assert type(generator) is QwenImageEditPlusGenerator and loaded == [{"transformer": None,
                                                                         "torch_dtype": torch.float32}]  # fmt: skip
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageLayeredPipeline"}))
    with pytest.raises(ValueError, match="is a QwenImageLayeredPipeline; deepspeed-knap generate runs Qwen-Image "
                                         "checkpoints of QwenImagePipeline, QwenImageEditPlusPipeline, "
                                         "QwenImageEditPipeline"):  # fmt: skip
        QwenImageGenerator.load(tmp_path, torch.float32, "cpu")


def test_a_request_file_is_split_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028 or U+0085 (``json.dumps(..., ensure_ascii=False)`` writes them):
    the line stays one request, and the next lines keep their numbers; CRLF files read alike."""
    from deepspeed_knap.generation.requests import request_lines

    prompts = ["a cat\u2028on a mat", "a dog\x85in fog", "a bird"]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "height": 32, "width": 32}, ensure_ascii=False) + "\r\n"
                            for p in prompts) + "\n",
                    encoding="utf-8")  # fmt: skip
    lines = request_lines(path)
    assert [number for number, _ in lines] == [1, 2, 3]
    assert [json.loads(text)["prompt"] for _, text in lines] == prompts
    assert parse_request(2, 3, lines[2][1], default_steps=28).id == "line3"


def test_srun_tasks_without_rank_are_refused_before_each_runs_the_whole_job_alone(monkeypatch, tmp_path):
    """srun sets SLURM_STEP_NUM_TASKS but not RANK: DeepSpeed would make every task rank 0 of a world
    of one, each generating (or training) everything. generate and the DeepSpeed start-up refuse it
    on every task alike, naming the launch script; under mpirun (an MPI world size) the ranks are
    found through mpi4py."""
    from deepspeed_knap.cli import main
    from deepspeed_knap.runtime.config import read_ds_config
    from deepspeed_knap.runtime.groups import MPI_WORLD_SIZE_VARIABLES, launched_by_mpi, unjoinable_launch

    for name in ("RANK", "PMI_RANK", "PMIX_RANK", *MPI_WORLD_SIZE_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    (tmp_path / "requests.jsonl").write_text('{"prompt": "a boat"}\n')
    with pytest.raises(SystemExit, match=r"srun started 2 tasks but none has RANK set.*launch/slurm\.sbatch"):
        main(["generate", "--requests", str(tmp_path / "requests.jsonl"), "--tiny", "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="srun started 2 tasks"):
        read_ds_config({"train_micro_batch_size_per_gpu": 1})
    for name, value in (("PMI_SIZE", "2"), ("PMIX_RANK", "0"), ("PMI_RANK", "1")):  # srun with an MPI plugin
        monkeypatch.setenv(name, value)
        assert unjoinable_launch() is None and launched_by_mpi(), name
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # one task: a single process, as without srun
    assert unjoinable_launch() is None
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")  # mpirun -n 1: one rank, no group to join
    assert not launched_by_mpi()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert launched_by_mpi()


def test_a_wan_request_of_one_frame_is_written_as_a_png(tmp_path):
    """``frames`` 1 is an image: written as ``{id}.png`` (a one-frame GIF lost colour to its palette);
    more frames are a GIF. The request file may begin with a byte-order mark (editors write one)."""
    from PIL import Image

    from deepspeed_knap.cli import main

    lines = [
        {"id": "still", "prompt": "a cat", "height": 32, "width": 32, "frames": 1, "steps": 2, "guidance": 1.0},
        {"id": "clip", "prompt": "a cat", "height": 32, "width": 32, "frames": 5, "steps": 2, "guidance": 1.0},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (tmp_path / "clips.jsonl").write_bytes(b"\xef\xbb\xbf" + text.encode())
    code = main(["generate", "--requests", str(tmp_path / "clips.jsonl"), "--tiny", "--family", "wan",
                 "--out", str(tmp_path / "out"), "--no-progress"])  # fmt: skip
    assert code == 0
    written = sorted(path.name for path in (tmp_path / "out").iterdir() if path.suffix != ".json")
    assert written == ["clip.gif", "still.png"]
    assert np.asarray(Image.open(tmp_path / "out" / "still.png")).shape == (32, 32, 3)


def test_a_huge_whole_number_guidance_is_refused_naming_the_line():
    """A JSON integer past a float's range is a request error naming the key, not an OverflowError."""
    for key in ("guidance", "true_cfg_scale", "guidance_2"):
        with pytest.raises(RequestError, match=f"line 3: '{key}' must be a finite number; got a larger number"):
            parse_request(0, 3, f'{{"prompt": "a", "height": 16, "width": 16, "{key}": {"9" * 400}}}', default_steps=28)


def test_a_16_bit_grayscale_image_is_scaled_to_8_bits_not_clipped(tmp_path):
    """PIL opens a 16-bit grayscale PNG in mode I;16 and its RGB conversion clips: mid-grey (32768)
    read as white. The prepare scripts and edit requests read images through read_image."""
    from PIL import Image

    from deepspeed_knap.generation.requests import read_image

    levels = np.array([[0, 100, 32768, 65535]], dtype=np.uint16)
    Image.fromarray(levels).save(tmp_path / "grey16.png")
    assert Image.open(tmp_path / "grey16.png").mode.startswith("I")
    assert np.asarray(read_image(tmp_path / "grey16.png"))[0, :, 0].tolist() == [0, 0, 128, 255]
    Image.fromarray(np.array([[0, 100, 128, 255]], dtype=np.int32)).save(tmp_path / "grey8_as_i.tiff")
    assert Image.open(tmp_path / "grey8_as_i.tiff").mode == "I"  # 32-bit integers holding 8-bit values stay
    assert np.asarray(read_image(tmp_path / "grey8_as_i.tiff"))[0, :, 0].tolist() == [0, 100, 128, 255]


def test_captions_drop_a_byte_order_mark_and_one_not_utf8_is_named(tmp_path):
    from PIL import Image

    from deepspeed_knap.models.latents import targets_and_references

    for name in ("a", "b"):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{name}.png")
    (tmp_path / "a.txt").write_bytes("\ufeffa red cat\n".encode())
    (tmp_path / "b.txt").write_bytes("a café".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"caption {re.escape(str(tmp_path / 'b.txt'))} cannot be read as UTF-8"):
        targets_and_references(tmp_path)
    (tmp_path / "b.txt").write_text("a dog")
    assert [caption for _, caption, _ in targets_and_references(tmp_path)] == ["a red cat", "a dog"]
