"""Planner properties (hypothesis), brute-force optimality, determinism across processes, errors."""

import dataclasses
import itertools
import multiprocessing as mp
import re
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.models.registry import MIXES, default_cost_model, sample_mix
from deepspeed_knap.planner import SOLVERS, lower_bound, plan_loads, plan_routing
from deepspeed_knap.planner.topology import build_topology
from tests.support.plans import check_plan_covers_every_token, per_rank_lengths

FLUX = default_cost_model("flux-dev")
TOPOLOGIES_4 = ["g1n4", "g2n2", "g4n1", "g1n2+g2n1"]
TOPOLOGIES_8 = ["g1n8", "g8n1", "g1n2+g2n1+g4n1", "g2n2+g4n1", "g1n4+g2n2"]


@st.composite
def instances(draw):
    spec = draw(st.sampled_from(TOPOLOGIES_4 + TOPOLOGIES_8))
    topology = build_topology(spec)
    return topology, draw(per_rank_lengths(topology.group_size))


def check_group_is_a_bag_or_home(plan, topology):
    bags = set(zip(topology.bag_first_rank, topology.bag_sizes, strict=True))
    for start, size, src in zip(plan.seq_group_start, plan.seq_group_size, plan.seq_src_rank, strict=True):
        assert (int(start), int(size)) in bags or (size == 1 and start == src)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=instances(), solver=st.sampled_from(SOLVERS))
def test_every_token_lands_on_exactly_one_gpu(instance, solver):
    topology, lengths = instance
    plan = plan_routing(lengths, topology, FLUX, solver)
    check_plan_covers_every_token(plan, lengths, topology)
    check_group_is_a_bag_or_home(plan, topology)
    assert plan.lower_bound <= plan.max_load * (1 + 1e-9)
    assert plan_routing(lengths, topology, FLUX, solver) == plan  # deterministic within a process


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=instances())
def test_refine_is_never_worse_than_knapformer_or_none(instance):
    topology, lengths = instance
    ours = plan_routing(lengths, topology, FLUX, "refine")
    for baseline in ("knapformer", "none"):
        # Exact in the planner's integer units; in seconds within one unit (2**-32 of the largest
        # cost) per sequence, well under 1e-7 of the max load here.
        assert ours.max_load <= plan_routing(lengths, topology, FLUX, baseline).max_load * (1 + 1e-7)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=instances(), cap_scale=st.floats(0.3, 3.0))
def test_memory_cap_holds_or_the_error_says_why(instance, cap_scale):
    topology, lengths = instance
    total = sum(map(sum, lengths))
    cap = max(1, int(cap_scale * total / topology.group_size))
    try:
        plan = plan_routing(lengths, topology, FLUX, "refine", max_tokens_per_gpu=cap)
    except ValueError as error:
        assert f"max_tokens_per_gpu={cap}" in str(error)
        return
    check_plan_covers_every_token(plan, lengths, topology)
    assert plan.gpu_tokens.max(initial=0) <= cap


def brute_force_optimum(lengths, topology, cost_model, cap=None):
    """Best max load over every assignment of sequences to bags, and over keeping all at home.

    With ``cap``, only assignments whose busiest GPU holds at most ``cap`` tokens count; ``inf`` if none.
    A bag runs at its slowest GPU's speed, and every GPU ``g`` also spends ``overhead_s / speed[g]``.
    """
    flat = [s for rank in lengths for s in rank]
    num_gpus = topology.group_size
    speed = np.asarray(cost_model.gpu_speed or [1.0] * num_gpus)
    overhead = cost_model.overhead_s / speed  # [S]
    home_loads, home_tokens = overhead.copy(), np.zeros(num_gpus)
    for rank, rank_lengths in enumerate(lengths):
        for s in rank_lengths:
            home_loads[rank] += cost_model.per_gpu_time(s, 1, speed[rank])
            home_tokens[rank] += s
    best = home_loads.max(initial=0.0) if cap is None or home_tokens.max(initial=0) <= cap else np.inf
    bags = list(zip(topology.bag_first_rank, topology.bag_sizes, strict=True))
    cost = np.array([[cost_model.per_gpu_time(s, g, speed[f : f + g].min()) for f, g in bags] for s in flat])  # [N, B]
    tokens = np.array([[-(-s // g) for g in topology.bag_sizes] for s in flat])  # busiest GPU's share
    bag_overhead = np.array([overhead[f : f + g].max() for f, g in bags])
    for assignment in itertools.product(range(topology.num_bags), repeat=len(flat)):
        picked = list(assignment)
        loads, bag_tokens = bag_overhead.copy(), np.zeros(topology.num_bags)
        np.add.at(loads, picked, cost[np.arange(len(flat)), picked])
        np.add.at(bag_tokens, picked, tokens[np.arange(len(flat)), picked])
        if cap is None or bag_tokens.max() <= cap:
            best = min(best, loads.max())
    return best


@st.composite
def tiny_instances(draw):
    spec = draw(st.sampled_from(["g1n4", "g2n2", "g1n2+g2n1", "g1n3", "g1n1+g2n1", "g2n1+g1n2"]))
    topology = build_topology(spec)
    lengths = draw(per_rank_lengths(topology.group_size, max_per_rank=2))
    n = sum(map(len, lengths))
    if n > 7:  # keep B**N small for the brute force
        lengths = [rank[:1] for rank in lengths]
    return topology, lengths


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=tiny_instances())
def test_refine_is_near_the_brute_force_optimum_and_the_bound_is_valid(instance):
    topology, lengths = instance
    if not any(lengths):
        return
    optimum = brute_force_optimum(lengths, topology, FLUX)
    plan = plan_routing(lengths, topology, FLUX, "refine")
    assert plan.lower_bound <= optimum * (1 + 1e-9)
    assert plan.max_load <= optimum * 1.03


def test_refine_is_exact_on_small_steps():
    """Steps of few sequences go through the exact branch and bound: the optimum, not just near it."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        topology = build_topology(["g1n4", "g2n2", "g1n2+g2n1"][trial % 3])
        lengths = [rng.choice([300, 1_500, 4_600, 17_000, 33_000], size=rng.integers(0, 3)).tolist() for _ in range(4)]
        if not any(lengths):
            lengths[0] = [4_600]
        optimum = brute_force_optimum(lengths, topology, FLUX)
        assert plan_routing(lengths, topology, FLUX, "refine").max_load <= optimum * (1 + 1e-9), lengths


@pytest.mark.parametrize(
    "spec, lengths",
    [
        # Local optimum of moves and swaps: needs a two-step chain (move into a bag, swap out of it).
        ("g1n2+g2n1", [[], [200], [200, 200], [200, 329]]),
        # Needs a one-for-two swap: only the exact search finds it (local search stops 3.0% above).
        ("g1n1+g2n1", [[10_000, 10_000], [10_000, 10_000], [10_000, 17_077]]),
    ],
)
def test_adversarial_small_steps_found_by_hypothesis_are_solved_exactly(spec, lengths):
    topology = build_topology(spec)
    optimum = brute_force_optimum(lengths, topology, FLUX)
    assert plan_routing(lengths, topology, FLUX, "refine").max_load <= optimum * (1 + 1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instance=tiny_instances(), cap_scale=st.floats(0.3, 2.0))
def test_cap_is_reported_unmeetable_only_when_brute_force_agrees(instance, cap_scale):
    topology, lengths = instance
    total = sum(map(sum, lengths))
    if not total:
        return
    cap = max(1, int(cap_scale * total / topology.group_size))
    optimum = brute_force_optimum(lengths, topology, FLUX, cap)
    try:
        plan = plan_routing(lengths, topology, FLUX, "refine", max_tokens_per_gpu=cap)
    except ValueError:
        assert optimum == np.inf, "a feasible assignment exists but the planner gave up"
        return
    assert plan.gpu_tokens.max() <= cap and plan.max_load <= optimum * (1 + 1e-9)


def test_regressions_found_in_review():
    # The cap defeats every load-driven start; bin packing finds {6, 6} | {5, 4, 4}.
    plan = plan_routing([[5], [4, 4, 6, 6]], build_topology("g1n2"), CostModel(1e-6, 0.0), max_tokens_per_gpu=13)
    assert sorted(plan.gpu_tokens.tolist()) == [12, 13]
    # The bound must not round above the optimum when an all-to-all-heavy class sets the cost scale.
    topology, lengths = build_topology("g1n2+g2n1"), [[], [], [1, 1], []]
    cost_model = CostModel(1e-9, 0.0, 0.01)
    assert plan_routing(lengths, topology, cost_model).lower_bound <= brute_force_optimum(lengths, topology, cost_model)


def _plan_in_subprocess(spec: str, mix: str, seed: int):
    topology = build_topology(spec)
    return plan_routing(sample_mix(mix, topology.group_size, seed), topology, FLUX, "refine")


def test_plans_are_bit_identical_across_processes():
    spec = "g1n16+g2n8+g4n4+g8n2"
    jobs = [(spec, name, seed) for name in MIXES for seed in range(2)]
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        remote = list(pool.map(_plan_in_subprocess, *zip(*jobs, strict=True)))
    for job, theirs in zip(jobs, remote, strict=True):
        assert _plan_in_subprocess(*job) == theirs, job


def test_balancing_helps_where_it_should():
    topology = build_topology("g8n4")
    lengths = sample_mix("kf_image_video", 32, 0)
    none, ours = (plan_routing(lengths, topology, FLUX, s) for s in ("none", "refine"))
    assert none.imbalance > 2.0 and ours.imbalance < 1.01
    assert none.tokens_moved_fraction == 0.0 and ours.tokens_moved_fraction > 0.5


def test_tiny_sequences_stay_home_when_bags_only_add_alltoall():
    topology = build_topology("g4n1")
    lengths = [[300, 300], [300, 300], [300, 300], [300, 300]]
    plan = plan_routing(lengths, topology, FLUX, "refine")
    assert plan.seq_group_size.tolist() == [1] * 8 and plan.tokens_moved_fraction == 0.0
    assert plan.max_load < plan_routing(lengths, topology, FLUX, "knapformer").max_load


def test_slow_gpu_gets_less_work():
    topology = build_topology("g1n4")
    slow = CostModel(FLUX.linear_coef, FLUX.quadratic_coef, FLUX.alltoall_coef, gpu_speed=(1.0, 1.0, 1.0, 0.5))
    lengths = [[4_096] * 3 for _ in range(4)]
    plan = plan_routing(lengths, topology, slow, "refine")
    per_gpu_sequences = np.bincount(plan.seq_group_start, minlength=4)
    assert per_gpu_sequences[3] < per_gpu_sequences[:3].min()
    assert plan.max_load < plan_routing(lengths, topology, slow, "none").max_load


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    instance=tiny_instances(),
    speeds=st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5]), min_size=4, max_size=4),
    overhead_share=st.sampled_from([0.0, 0.1, 0.5, 2.0]),
)
def test_refine_gives_a_slow_gpu_less_work_for_its_larger_fixed_overhead(instance, speeds, overhead_share):
    """Every GPU pays ``overhead_s / speed`` per step whatever its tokens: optimal against brute force."""
    topology, lengths = instance
    if not any(lengths):
        return
    mean_work = sum(float(FLUX.per_gpu_time(s, 1)) for rank in lengths for s in rank) / topology.group_size
    cost_model = dataclasses.replace(FLUX, gpu_speed=tuple(speeds[: topology.group_size]),
                                   overhead_s=overhead_share * mean_work)  # fmt: skip
    optimum = brute_force_optimum(lengths, topology, cost_model)
    plan = plan_routing(lengths, topology, cost_model, "refine")
    np.testing.assert_allclose(plan_loads(plan, cost_model), plan.gpu_loads, rtol=1e-12)
    assert plan.lower_bound <= optimum * (1 + 1e-9)
    assert plan.max_load <= optimum * (1 + 1e-6)  # small steps are solved exactly


def test_a_slow_gpus_overhead_moves_work_off_it():
    """Rank 1 runs at a third of the speed (0.1 s a sequence on rank 0, 0.3 s on rank 1): balancing
    work alone gives it 4 of 16 sequences, but its overhead, three times rank 0's, leaves room for 3."""
    lengths = [[1_000] * 8, [1_000] * 8]
    cost_model = CostModel(1e-4, 0.0, gpu_speed=(1.0, 1 / 3), overhead_s=0.2)
    plan = plan_routing(lengths, build_topology("g1n2"), cost_model, "refine")
    assert np.bincount(plan.seq_group_start, minlength=2).tolist() == [13, 3]
    np.testing.assert_allclose(plan.gpu_loads, [0.2 + 1.3, 0.6 + 0.9])
    unaware = plan_routing(lengths, build_topology("g1n2"), dataclasses.replace(cost_model, overhead_s=0.0), "refine")
    assert np.bincount(unaware.seq_group_start, minlength=2).tolist() == [12, 4]
    np.testing.assert_allclose(plan_loads(unaware, cost_model), [0.2 + 1.2, 0.6 + 1.2])


def test_overhead_review_regressions():
    # Overheads are a fixed topology's base loads: the knapformer start must stay (it was dropped,
    # and refine came out 1.4% above knapformer here).
    lengths = [[8], [87523, 3044, 35714], [599, 25833, 3], [30032], [57207, 6, 60408, 2242], [1, 3768], [],
               [10, 4675, 6]]  # fmt: skip
    cost_model = dataclasses.replace(FLUX, gpu_speed=(1,) * 7 + (0.97,), overhead_s=0.86)
    topology = build_topology("g4n2")
    refine, knapformer = (plan_routing(lengths, topology, cost_model, solver) for solver in ("refine", "knapformer"))
    assert refine.max_load <= knapformer.max_load * (1 + 1e-12)
    # A slow GPU's overhead worth more than 256 sequences is still planned in full (a fixed cap of
    # 2**40 units gave it 229 sequences: 165.8 s against the optimum's 200 and 160 s).
    cost_model = CostModel(1e-4, 0.0, gpu_speed=(1.0, 0.5), overhead_s=60.0)
    for topology in (build_topology("g1n2"), build_topology("auto", 2, None, 1)):
        plan = plan_routing([[1000] * 1200, []], topology, cost_model)
        assert np.bincount(plan.seq_group_start, minlength=2).tolist() == [1000, 200]
        assert plan.max_load == pytest.approx(160.0)
    # Two equally slow GPUs whose overhead outweighs the step's work: the overheads were held in
    # ascending order to the one before plus the step's work, so the second got a step of work more
    # than the first, which then took a sequence "for free" and became the busiest (0.112 s, 12% over).
    cost_model = CostModel(1e-5, 1e-10, 1e-7, gpu_speed=(1.0, 1.0, 0.5, 0.5), overhead_s=0.05)
    for lengths in ([[], [], [64], [64]], [[], [], [], [100]]):
        optimum = brute_force_optimum(lengths, build_topology("g1n4"), cost_model)
        for topology in (build_topology("g1n4"), build_topology("auto", 4)):
            assert plan_routing(lengths, topology, cost_model).max_load <= optimum * (1 + 1e-9), (lengths, topology)


def test_plan_loads_reprices_a_plan_under_another_model():
    """Against a per-sequence loop over the module docstring's formula, with a slow GPU and the
    fixed overhead every GPU pays at its own speed, and with every GPU at one speed other than 1
    (which skips the per-group minimum)."""
    topology = build_topology("g1n2+g2n1")
    solved_with = CostModel(FLUX.linear_coef, FLUX.quadratic_coef, FLUX.alltoall_coef, gpu_speed=(1, 1, 0.5, 1))
    others = [CostModel(2 * FLUX.linear_coef, 0.8 * FLUX.quadratic_coef, 3 * FLUX.alltoall_coef, speeds,
                        overhead_s=0.01) for speeds in [(1, 0.7, 1, 1), (0.8,) * 4]]  # fmt: skip
    lengths = [[9_000, 300], [40_000], [], [2_000, 2_000, 60_000]]
    for solver, other in itertools.product(SOLVERS, others):
        plan = plan_routing(lengths, topology, solved_with, solver)
        np.testing.assert_allclose(plan_loads(plan, solved_with), plan.gpu_loads, rtol=1e-12)
        expected = 0.01 / np.asarray(other.gpu_speed)
        for s, start, g in zip(plan.seq_lens, plan.seq_group_start, plan.seq_group_size, strict=True):
            speed = min(other.gpu_speed[start : start + g])
            a, b, c = other.linear_coef, other.quadratic_coef, other.alltoall_coef
            expected[start : start + g] += (a * s + b * s * s) / (g * speed) + c * s * (g - 1) / g**2
        np.testing.assert_allclose(plan_loads(plan, other), expected, rtol=1e-12)
    with pytest.raises(ValueError, match="gpu_speed has 3 entries but the plan has 4 GPUs"):
        plan_loads(plan, CostModel(1.0, 0.0, gpu_speed=(1, 1, 1)))


def test_garbage_collector_is_paused_only_during_the_solve():
    import gc

    topology = build_topology("g2n2")
    plan_routing([[5_000], [], [300], [9]], topology, FLUX)
    assert gc.isenabled()
    with pytest.raises(ValueError):
        plan_routing([[5_000], [], [300], [-9]], topology, FLUX)
    assert gc.isenabled()
    gc.disable()
    try:
        plan_routing([[5_000], [], [300], [9]], topology, FLUX)
        assert not gc.isenabled(), "a caller's disabled collector must stay disabled"
    finally:
        gc.enable()


def test_empty_ranks_and_empty_steps_are_normal_input():
    topology = build_topology("g2n2")
    plan = plan_routing([[], [], [5_000], []], topology, FLUX)
    assert plan.seq_lens.tolist() == [5_000] and plan.gpu_tokens.sum() == 5_000
    empty = plan_routing([[], [], [], []], topology, FLUX)
    assert empty.seq_lens.size == 0 and empty.max_load == 0.0 and empty.imbalance == 1.0
    assert empty.tokens_moved_fraction == 0.0 and empty.lower_bound == 0.0


def test_bad_input_errors_name_the_problem():
    topology = build_topology("g2n2")
    with pytest.raises(ValueError, match=r"lengths for 3 ranks, but topology 'g2n2' has 4 GPUs"):
        plan_routing([[1], [2], [3]], topology, FLUX)
    with pytest.raises(ValueError, match=r"rank 2: sequence 1 has length 0"):
        plan_routing([[5], [6], [7, 0], []], topology, FLUX)
    with pytest.raises(ValueError, match=r"rank 2: sequence lengths must be a flat list of token counts"):
        plan_routing([[5], [6], [[7, 8]], []], topology, FLUX)
    # A cap the solver cannot honour is an error, never silently ignored (an out-of-memory on a GPU).
    with pytest.raises(ValueError, match=r"'knapformer' cannot honour max_tokens_per_gpu=100"):
        plan_routing([[5], [], [], []], topology, FLUX, "knapformer", max_tokens_per_gpu=100)
    with pytest.raises(ValueError, match=r"'none' keeps every sequence home, and rank 2 holds 180 tokens"):
        plan_routing([[5], [], [90, 90], []], topology, FLUX, "none", max_tokens_per_gpu=100)
    assert plan_routing([[5], [], [30], []], topology, FLUX, "none", max_tokens_per_gpu=100).max_tokens_per_gpu == 100
    with pytest.raises(ValueError, match=r"unknown solver 'greedy'; choose one of none, knapformer, refine"):
        plan_routing([[5], [], [], []], topology, FLUX, "greedy")
    for steps in (2.5, -1, True):  # a float was a TypeError deep in the search
        with pytest.raises(
            ValueError, match=rf"refine_steps must be an integer >= 0 \(a count of search steps\); got {steps}"
        ):
            plan_routing([[5], [], [], []], topology, FLUX, refine_steps=steps)
    with pytest.raises(ValueError, match=r"max_tokens_per_gpu must be a positive integer"):
        plan_routing([[5], [], [], []], topology, FLUX, max_tokens_per_gpu=0)


@pytest.mark.parametrize(
    "lengths, message",
    [
        # Out of range, none wrapped around or clipped: a length, then the step's tokens and sequences.
        ([[9223372036854775807], [5]], "rank 0: sequence 0 has length 9223372036854775807, over 2**40 tokens"),
        ([[], [2**62, 2**62]], "rank 1: sequence 0 has length 4611686018427387904, over 2**40 tokens"),
        ([[np.uint64(2**63)], []], "rank 0: sequence 0 has length 9223372036854775808, over 2**40 tokens"),
        ([[5], np.array([2**41], dtype=np.uint64)], "rank 1: sequence 0 has length 2199023255552, over 2**40 tokens"),
        ([[2**40, 1], []], "rank 0: sequence 1 brings the step to 1099511627777 tokens, over 2**40"),
        ([[2**39, 2**39], [1]], "rank 1: sequence 0 brings the step to 1099511627777 tokens, over 2**40"),
        ([[1] * 2**19, [1] * (2**19 + 1)], "rank 1: sequence 524288 brings the step to 1048577 sequences, over 2**20"),
        ([[-3], []], "rank 0: sequence 0 has length -3; every length must be a positive token count"),
        # Not integers: floats (whole, huge and infinite ones too, Python or NumPy), bools, strings.
        ([[1e300], []], "rank 0: sequence 0 has length 1e+300 (a float)"),
        ([[float("inf")], []], "rank 0: sequence 0 has length inf (a float)"),
        ([[5], [2.5]], "rank 1: sequence 0 has length 2.5 (a float)"),
        ([[5, 6.0], []], "rank 0: sequence 1 has length 6.0 (a float)"),
        ([[np.float64(7)], []], "rank 0: sequence 0 has length 7.0 (a float64)"),
        ([np.array([5.0]), []], "rank 0: sequence 0 has length 5.0 (a float64)"),
        ([[True], []], "rank 0: sequence 0 has length True (a bool)"),
        ([[5, True], []], "rank 0: sequence 1 has length True (a bool)"),
        ([np.array([True]), []], "rank 0: sequence 0 has length True (a bool)"),
        ([["5"], []], "rank 0: sequence 0 has length '5' (a str)"),
    ],
)
def test_lengths_are_integers_in_range_or_refused_naming_the_value(lengths, message):
    """Issue 22: no length is cast (a float, a bool, a value past int64) and no sum overflows; the
    error names the rank, the index and the value, on one line."""
    topology = build_topology("g1n2")
    for entry in (plan_routing, lower_bound):
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            entry(lengths, topology, FLUX)
        assert "\n" not in str(error.value)


def test_lengths_may_be_python_or_numpy_integers_up_to_the_limits():
    topology = build_topology("g1n2")
    plan = plan_routing([np.array([5, 6], dtype=np.int32), [np.uint64(7), 2**40 - 18]], topology, FLUX)
    assert plan.seq_lens.dtype == np.int64 and plan.seq_lens.tolist() == [5, 6, 7, 2**40 - 18]
    assert int(plan.gpu_tokens.sum()) == 2**40 and np.isfinite(plan.max_load) and plan.max_load > 0
    assert plan_routing(np.array([[5, 6], [7, 8]]), topology, FLUX).seq_lens.tolist() == [5, 6, 7, 8]
    many = plan_routing([[1] * 2**19, [1] * 2**19], topology, FLUX, "none")
    assert many.seq_lens.size == 2**20


def test_sequence_that_fits_no_bag_is_named_with_the_cap():
    topology = build_topology("g1n2+g2n1")
    with pytest.raises(ValueError) as error:
        plan_routing([[100], [], [10, 9_000], []], topology, FLUX, max_tokens_per_gpu=4_000)
    message = str(error.value)
    assert "sequence 1 of rank 2 has 9000 tokens" in message
    assert "max_tokens_per_gpu=4000" in message and "4500" in message


def test_cap_no_assignment_can_meet_is_reported():
    topology = build_topology("g1n2")
    with pytest.raises(
        ValueError, match=r"max_tokens_per_gpu=100 could not be met: 300 tokens over 2 GPUs need at least 150"
    ):
        plan_routing([[100, 100], [100]], topology, FLUX, max_tokens_per_gpu=100)
