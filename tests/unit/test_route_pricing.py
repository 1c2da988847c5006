"""The planner prices the tokens a plan moves (deepspeed_knap/planner/route.py), checked against an
independent reference of the modeled step (compute of every GPU plus the route phase, from the
plan's chunks) and brute force over every sequence's alternative of staying home."""

import dataclasses
import itertools

import numpy as np
import pytest

from deepspeed_knap import build_topology, plan_routing
from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.planner.solve import plan_route_s
from tests.support.plans import check_plan_covers_every_token

BASE = CostModel(linear_coef=1e-4, quadratic_coef=2e-8, alltoall_coef=2e-6)
# Tiny balance groups: fixed topologies of 2 and 4 GPUs, and auto on 4 (2 nodes of 2 for the links).
TOPOLOGIES = [("g2n1", 2, None), ("g1n2+g2n1", 4, None), ("g2n2", 4, 2), ("g4n1", 4, None), ("auto", 4, 2),
              ("auto", 4, None)]  # fmt: skip


def reference_step(lengths, src, groups, model: CostModel, gpus_per_node, num_gpus):
    """Modeled step of sequences ``lengths`` (home GPUs ``src``) run in ``groups`` [(start, size)],
    computed chunk by chunk: every GPU's compute plus overhead, the busiest; and the route phase,
    the largest of any GPU's seconds sending or receiving (intra- and inter-node tokens priced apart),
    plus the route latency if any token moved."""
    speed = list(model.gpu_speed or [1.0] * num_gpus)
    loads = [model.overhead_s / v for v in speed]
    send, receive, moved = [0.0] * num_gpus, [0.0] * num_gpus, False
    for s, home, (start, size) in zip(lengths, src, groups, strict=True):
        group_speed = min(speed[start : start + size])
        per_gpu = float(model.per_gpu_time(np.array([s]), size, group_speed)[0])
        for position in range(size):
            gpu = start + position
            loads[gpu] += per_gpu
            tokens = s // size + (1 if position < s % size else 0)
            if gpu != home and tokens:
                moved = True
                across = gpus_per_node is not None and gpu // gpus_per_node != home // gpus_per_node
                seconds = tokens * (model.inter_node_route if across else model.route_coef)
                send[home] += seconds
                receive[gpu] += seconds
    latency = model.route_latency_s if moved else 0.0
    return max(loads) + latency + max(max(a, b) for a, b in zip(send, receive, strict=True))


def random_case(rng, num_gpus):
    lengths = [[int(rng.choice([rng.integers(1, 64), rng.integers(200, 3000), rng.integers(4000, 12000)]))
                for _ in range(rng.integers(0, 3))] for _ in range(num_gpus)]  # fmt: skip
    speeds = None if rng.random() < 0.6 else tuple(float(v) for v in rng.choice([1.0, 0.5, 0.75], num_gpus))
    # Route coefficients from a hundredth to a few times the linear cost of a token.
    route = float(BASE.linear_coef * 10 ** rng.uniform(-2, 0.5))
    inter = None if rng.random() < 0.5 else float(route * rng.uniform(1, 4))
    overhead = 0.0 if rng.random() < 0.7 else 0.05
    # A latency from a hundredth to about what balancing a step saves (its sequences cost 0.01-2 s).
    latency = 0.0 if rng.random() < 0.5 else float(10 ** rng.uniform(-2, 0))
    return lengths, dataclasses.replace(BASE, gpu_speed=speeds, route_coef=route, inter_node_route_coef=inter,
                                        overhead_s=overhead, route_latency_s=latency)  # fmt: skip


# The model without its route terms: the compute-only planner's.
def route_free(model: CostModel) -> CostModel:
    return dataclasses.replace(model, route_coef=0.0, inter_node_route_coef=None, route_latency_s=0.0)


def flat(plan):
    groups = list(zip(plan.seq_group_start.tolist(), plan.seq_group_size.tolist(), strict=True))
    return plan.seq_lens.tolist(), plan.seq_src_rank.tolist(), groups, plan.num_gpus


@pytest.mark.parametrize("spec, num_gpus, gpus_per_node", TOPOLOGIES)
def test_no_moved_sequence_costs_more_than_it_saves(spec, num_gpus, gpus_per_node):
    """For every sequence the plan moves, bringing it home alone (brute force: each in turn) would
    lengthen the modeled step: the move saves more compute than its route costs. And the plan is no
    slower than keeping everything home, nor than the compute-only plan with its routes priced."""
    rng = np.random.default_rng(num_gpus * 100 + len(spec))
    topology = build_topology(spec, num_gpus, gpus_per_node)
    moved_somewhere = kept_home = 0
    for _ in range(60):
        lengths, model = random_case(rng, num_gpus)
        plan = plan_routing(lengths, topology, model)
        check_plan_covers_every_token(plan, lengths, topology)
        seq_lens, src, groups, gpus = flat(plan)
        step = reference_step(seq_lens, src, groups, model, gpus_per_node, gpus)
        assert step == pytest.approx(plan.max_load + plan_route_s(plan, model, gpus_per_node), rel=1e-9, abs=1e-12)
        tolerance = 1e-9 * step  # the planner compares in quantised units (2**-32 of the largest cost)
        for i, (home, group) in enumerate(zip(src, groups, strict=True)):
            if group == (home, 1):
                continue
            moved_somewhere += 1
            alone = [*groups[:i], (home, 1), *groups[i + 1 :]]
            alone_step = reference_step(seq_lens, src, alone, model, gpus_per_node, gpus)
            assert alone_step > step - tolerance, (lengths, model, i)
        home_step = reference_step(seq_lens, src, [(h, 1) for h in src], model, gpus_per_node, gpus)
        assert step <= home_step + tolerance
        free = plan_routing(lengths, topology, route_free(model))
        assert step <= reference_step(*flat(free)[:3], model, gpus_per_node, gpus) + tolerance
        kept_home += free.tokens_moved > plan.tokens_moved
    # The cases exercise both outcomes: moves that pay, and moves the route price sent home.
    assert moved_somewhere > 10 and kept_home > 3


def test_a_route_term_changes_plans_only_by_the_sequences_it_keeps_home():
    """A positive route term is the compute-only planner's plan (route_coef 0: the planner of before,
    whose default-model plans tests/unit/test_plan_digests.py pins) with route.keep_home applied to its
    groups, then the same check against keeping everything home: it changes plans only by what it
    prices. The cases are drawn so that some moves pay and some do not."""
    from deepspeed_knap.planner.problem import Problem
    from deepspeed_knap.planner.solve import _keep_home

    rng = np.random.default_rng(3)
    changed = 0
    for spec, num_gpus, gpus_per_node in TOPOLOGIES:
        topology = build_topology(spec, num_gpus, gpus_per_node)
        for _ in range(20):
            lengths, model = random_case(rng, num_gpus)
            free = route_free(model)
            zero, priced = plan_routing(lengths, topology, free), plan_routing(lengths, topology, model)
            problem = Problem.build(lengths, topology, model, None)
            if zero.tokens_moved == 0:  # nothing to keep home; the priced plan is no slower than home
                seq_lens, src, _, gpus = flat(priced)
                home_step = reference_step(seq_lens, src, [(h, 1) for h in src], model, gpus_per_node, gpus)
                assert priced.max_load + plan_route_s(priced, model, topology.gpus_per_node) <= home_step + 1e-12
                continue
            start, size = _keep_home(problem, zero.seq_group_start, zero.seq_group_size)
            expected = problem.make_plan("refine", start, size)
            if problem.fits_cap_at_home() and problem.home_max_load_s <= expected.max_load + plan_route_s(
                expected, model, topology.gpus_per_node
            ):
                expected = problem.make_home_plan("refine")
            assert priced == expected, (spec, lengths, model)
            changed += priced != zero
    assert changed > 5  # the route term did change plans: the check compares two different planners


def test_a_route_latency_moves_tokens_only_where_balancing_saves_more():
    """Two sequences of 4,000 tokens on rank 0 of four single GPUs: moving one saves its compute,
    0.72 s. A route latency above that keeps both home; below it, one moves. The modeled step
    (compute, route latency, per-token price) is the reference's, whatever the solver."""
    lengths, saving = [[4000, 4000], [], [], []], float(BASE.per_gpu_time(np.array([4000]), 1)[0])
    for spec in ("g1n4", "auto"):
        topology = build_topology(spec, 4)
        for latency, moves in ((1.5 * saving, False), (0.5 * saving, True)):
            model = dataclasses.replace(BASE, route_latency_s=latency, route_coef=1e-7)
            plan = plan_routing(lengths, topology, model)
            assert (plan.tokens_moved > 0) == moves, (spec, latency)
            step = reference_step(*flat(plan)[:3], model, None, 4)
            assert step == pytest.approx(plan.max_load + plan_route_s(plan, model), rel=1e-12)
            assert step <= reference_step([4000, 4000], [0, 0], [(0, 1), (0, 1)], model, None, 4) * (1 + 1e-9)


def test_a_route_dearer_than_any_saving_keeps_every_sequence_home():
    lengths = [[8000, 300], [200], [50, 60, 70], []]
    model = dataclasses.replace(BASE, route_coef=1.0)
    for spec in ("auto", "g4n1", "g2n2"):
        plan = plan_routing(lengths, build_topology(spec, 4), model)
        assert plan.tokens_moved == 0 and np.array_equal(plan.seq_group_size, np.ones(6, dtype=np.int64))


def test_brought_home_sequences_respect_the_memory_cap():
    rng = np.random.default_rng(5)
    topology = build_topology("g2n2", 4)
    for _ in range(40):
        lengths = [rng.integers(100, 3000, rng.integers(1, 3)).tolist() for _ in range(4)]
        cap = int(max(sum(r) for r in lengths) * 0.8)
        model = dataclasses.replace(BASE, route_coef=float(BASE.linear_coef * rng.uniform(0.1, 3)))
        try:
            plan = plan_routing(lengths, topology, model, max_tokens_per_gpu=cap)
        except ValueError:
            continue
        assert plan.gpu_tokens.max() <= cap


@pytest.mark.parametrize("field", ["route_coef", "inter_node_route_coef", "route_latency_s"])
def test_negative_route_coefficients_are_refused(field):
    with pytest.raises(ValueError, match=f"{field} must be a finite number >= 0"):
        dataclasses.replace(BASE, **{field: -1e-6})


def test_brute_force_gap_on_tiny_steps_is_small():
    """Against brute force over every group of every sequence (topology auto, 4 GPUs, 2-4
    sequences, half the cases with a route latency): the route-priced plan's median modeled step is
    within 2% of the optimum, and it is never worse than keeping every sequence home."""
    rng = np.random.default_rng(11)
    topology = build_topology("auto", 4)
    options = [(0, 1), (1, 1), (2, 1), (3, 1), (0, 2), (2, 2), (0, 4)]
    gaps = []
    for _ in range(40):
        lengths = [[int(rng.integers(500, 9000))] if rng.random() < 0.8 else [] for _ in range(4)]
        if not any(lengths):
            continue
        latency = 0.0 if rng.random() < 0.5 else float(10 ** rng.uniform(-2, -0.5))
        model = dataclasses.replace(BASE, route_coef=float(BASE.linear_coef * 10 ** rng.uniform(-2, 0)),
                                    route_latency_s=latency)  # fmt: skip
        plan = plan_routing(lengths, topology, model)
        seq_lens, src, groups, gpus = flat(plan)
        step = reference_step(seq_lens, src, groups, model, None, gpus)
        best = min(reference_step(seq_lens, src, list(choice), model, None, gpus)
                   for choice in itertools.product(options, repeat=len(seq_lens)))  # fmt: skip
        assert best <= step * (1 + 1e-9)
        gaps.append(step / best - 1)
    assert np.median(gaps) <= 0.02, sorted(gaps)


def test_a_fixed_topologys_bound_holds_for_plans_that_keep_some_sequences_home():
    """With moving priced, refine brings home what moving does not pay, so its plans on a fixed
    topology mix home and bags: the plan's lower bound stays below the best such plan (brute force,
    home or the bag for every sequence), where it was the bags' or all-home bound alone (11% above
    the plan refine found on [[100, 10000, 4096], [4096]])."""
    rng = np.random.default_rng(5)
    topology = build_topology("g2n1")
    cases = [([[100, 10000, 4096], [4096]], CostModel(1e-5, 1e-11, 1e-5, route_coef=1e-6))]
    cases += [random_case(rng, 2) for _ in range(60)]
    for lengths, model in cases:
        if not any(lengths):
            continue
        plan = plan_routing(lengths, topology, model)
        seq_lens, src, _, gpus = flat(plan)
        choices = itertools.product((True, False), repeat=len(seq_lens))  # alone at home, or in the bag
        best = min(reference_step(seq_lens, src, [(home, 1) if alone else (0, 2)
                                                  for home, alone in zip(src, choice, strict=True)], model, None, gpus)
                   for choice in choices)  # fmt: skip
        assert plan.lower_bound <= best * (1 + 1e-9), (lengths, model)
        assert plan.max_load + plan_route_s(plan, model) <= reference_step(seq_lens, src, [(h, 1) for h in src],
                                                                            model, None, gpus) * (1 + 1e-9)  # fmt: skip
