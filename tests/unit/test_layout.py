"""Per-GPU layouts, checked by simulating every all-to-all of a step in NumPy over all GPUs."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.planner import SOLVERS, plan_routing
from deepspeed_knap.planner.fixed import Problem
from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.runtime.layout import gpu_layout, local_layout

WORKLOAD = CostModel(linear_coef=1.0, quadratic_coef=0.05)
TOPOLOGIES = ["g1n4", "g2n2", "g4n1", "g1n2+g2n1", "g1n2+g2n1+g4n1", "g8n1", "g2n4"]


def mixed_plan(seq_lens_per_rank, topology, cost_model, seed=0):
    """A plan no solver makes: each sequence at random either alone at home or in a random bag, so
    GPUs belong to several attention groups at once."""
    problem = Problem.build(seq_lens_per_rank, topology, cost_model, None)
    rng = np.random.default_rng(seed)
    bags = rng.integers(0, topology.num_bags, len(problem.seq_lens))
    home = rng.random(len(problem.seq_lens)) < 0.5
    starts = np.where(home, problem.src, np.asarray(topology.bag_first_rank)[bags])
    sizes = np.where(home, 1, np.asarray(topology.bag_sizes)[bags])
    return problem.make_plan("mixed", starts.astype(np.int64), sizes.astype(np.int64))


def simulate_step(plan):
    """Run route, attention gather and reverse route on (sequence id, position) labels of every token."""
    num_gpus = plan.num_gpus
    layouts = [gpu_layout(plan, g) for g in range(num_gpus)]
    home = []
    for layout in layouts:
        ids = layout.home_seq_ids
        home.append(np.concatenate([np.stack([np.full(n, i), np.arange(n)], 1) for i, n in
                                    zip(ids, plan.seq_lens[ids], strict=True)] or [np.zeros((0, 2), int)]))  # fmt: skip
    # Counts mirror: what g sends to d is what d expects from g.
    for g in range(num_gpus):
        for d in range(num_gpus):
            assert layouts[g].send_counts[d] == layouts[d].recv_counts[g]
            assert layouts[g].sample_send_counts[d] == layouts[d].sample_recv_counts[g]
    # Route.
    sent = [np.split(home[g][layouts[g].send_rows], np.cumsum(layouts[g].send_counts)[:-1]) for g in range(num_gpus)]
    routed = [np.concatenate([sent[g][d] for g in range(num_gpus)]) for d in range(num_gpus)]
    samples_sent = [np.split(layouts[g].home_seq_ids[layouts[g].sample_send_index],
                             np.cumsum(layouts[g].sample_send_counts)[:-1]) for g in range(num_gpus)]  # fmt: skip
    for d, layout in enumerate(layouts):
        expected = np.concatenate([np.stack([np.full(n, i), s + np.arange(n)], 1) for i, s, n in
                                   zip(layout.seq_ids, layout.chunk_starts, layout.chunk_lens, strict=True)]
                                  or [np.zeros((0, 2), int)])  # fmt: skip
        assert np.array_equal(routed[d], expected)
        assert np.all(layout.chunk_lens > 0) and np.all(np.diff(layout.seq_ids) > 0)
        assert np.array_equal(np.concatenate([samples_sent[g][d] for g in range(num_gpus)]), layout.seq_ids)
    # Attention: gathering each group's members' rows member by member, then seq_major, gives whole sequences.
    for layout in layouts:
        covered = []
        for group in layout.attention_groups:
            members = [layouts[group.start + p] for p in range(group.size)]
            pieces = []
            for member in members:
                mine = next(a for a in member.attention_groups if (a.start, a.size) == (group.start, group.size))
                assert (mine.rows is None) == (len(member.attention_groups) == 1)
                rows = mine.rows if mine.rows is not None else np.arange(member.num_routed_tokens)
                assert len(rows) == mine.num_local_tokens
                pieces.append(routed[member.gpu][rows])
            gathered = np.concatenate(pieces)
            if group.seq_major is not None:
                gathered = gathered[group.seq_major]
            whole = np.concatenate([np.stack([np.full(n, i), np.arange(n)], 1)
                                    for i, n in zip(group.seq_ids, group.seq_lens, strict=True)])  # fmt: skip
            assert np.array_equal(gathered, whole)
            covered.append(group.rows if group.rows is not None else np.arange(layout.num_routed_tokens))
        if covered:
            assert np.array_equal(np.sort(np.concatenate(covered)), np.arange(layout.num_routed_tokens))
        # Smaller groups first (its own, with no exchange, then its pair, ...), one group of a size at
        # most, and among equal sizes (none on one GPU) the one global order.
        sizes = [a.size for a in layout.attention_groups]
        assert sizes == sorted(set(sizes)), [(a.start, a.size) for a in layout.attention_groups]
    # Reverse route: send back what arrived, restore home order.
    back = [np.split(routed[d], np.cumsum(layouts[d].recv_counts)[:-1]) for d in range(num_gpus)]
    for g, layout in enumerate(layouts):
        arrived = np.concatenate([back[d][g] for d in range(num_gpus)])
        assert np.array_equal(arrived[np.argsort(layout.send_rows, kind="stable")], home[g])


lengths = st.one_of(st.integers(1, 9), st.integers(10, 300))


@st.composite
def steps(draw):
    topology = build_topology(draw(st.sampled_from(TOPOLOGIES)))
    seq_lens = draw(st.lists(st.lists(lengths, max_size=4), min_size=topology.group_size,
                             max_size=topology.group_size))  # fmt: skip
    return topology, seq_lens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps(), st.sampled_from([*SOLVERS, "mixed"]))
def test_simulated_step_moves_every_token_where_the_plan_says_and_back(step, solver):
    topology, seq_lens = step
    if solver == "mixed":
        plan = mixed_plan(seq_lens, topology, WORKLOAD)
    else:
        plan = plan_routing(seq_lens, topology, WORKLOAD, solver)
    simulate_step(plan)


def test_mixed_plans_put_gpus_in_several_groups():
    topology = build_topology("g1n2+g2n1+g4n1")
    plan = mixed_plan([[9, 8, 7, 6]] * 8, topology, WORKLOAD, seed=3)
    assert max(len(gpu_layout(plan, g).attention_groups) for g in range(8)) >= 2
    simulate_step(plan)


def test_a_gpu_holding_only_empty_chunks_of_one_of_its_groups_lists_no_rows_for_it():
    # GPU 1 holds an empty chunk of the 1-token sequence (group of 2) and its own sequence alone.
    problem = Problem.build([[1], [5]], build_topology("g2n1"), WORKLOAD, None)
    plan = problem.make_plan("mixed", np.array([0, 1]), np.array([2, 1]))
    groups = gpu_layout(plan, 1).attention_groups
    assert [(g.start, g.size, g.rows.tolist()) for g in groups] == [(1, 1, [0, 1, 2, 3, 4]), (0, 2, [])]
    simulate_step(plan)


def test_local_layout_is_one_group_of_one_gpu():
    layout = local_layout([3, 1, 4])
    assert [(a.start, a.size) for a in layout.attention_groups] == [(0, 1)]
    assert layout.attention_groups[0].seq_lens.tolist() == [3, 1, 4]
    assert layout.chunk_lens.tolist() == [3, 1, 4] and layout.num_routed_tokens == 8
    assert local_layout([]).attention_groups == ()


def test_layout_rejects_a_gpu_outside_the_plan_and_a_malformed_plan():
    plan = plan_routing([[5], [6]], build_topology("g2n1"), WORKLOAD)
    with pytest.raises(ValueError, match="GPU 2 is outside"):
        gpu_layout(plan, 2)
    broken = plan.__class__(**{**plan.__dict__, "chunk_gpu": plan.chunk_gpu[::-1].copy()})
    with pytest.raises(ValueError, match="one per GPU"):
        gpu_layout(broken, 0)
