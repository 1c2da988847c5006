"""Two link classes for the Ulysses all-to-alls: a group's peers on other nodes are priced at
``inter_node_alltoall_coef``, so topology ``auto`` takes a group across nodes only where it pays,
checked against brute force over every group of every sequence on 4 nodes of 2 GPUs."""

import dataclasses
import itertools

import numpy as np
import pytest

from deepspeed_knap import build_topology, plan_routing
from deepspeed_knap.cost.model import DEFAULT_ALLTOALL_GBPS, DEFAULT_INTER_NODE_ALLTOALL_GBPS, CostModel
from deepspeed_knap.models.registry import default_cost_model
from deepspeed_knap.planner.solve import plan_loads
from tests.support.plans import check_plan_covers_every_token, near_optimal

NODES, NODE = 4, 2  # the modeled case: 4 nodes of 2 GPUs
# Splitting pays for long sequences (attention dominates); the inter-node rate decides how far.
BASE = CostModel(linear_coef=1e-4, quadratic_coef=2e-8, alltoall_coef=2e-6)
INTER_NODE_RATES = (2e-6, 2e-5, 2e-4, 2e-3)  # as NVLink, then 10x to 1,000x dearer


def group_seconds(s: int, size: int, model: CostModel, gpus_per_node: int) -> float:
    """Per-GPU seconds of ``s`` tokens in an aligned group of ``size`` GPUs, from the formula: a member
    exchanges with its ``min(size, node) - 1`` peers in its node at ``c`` and the rest at ``c'``."""
    in_node = min(size, gpus_per_node) - 1
    across = size - 1 - in_node
    compute = (model.linear_coef * s + model.quadratic_coef * s * s) / size
    return compute + s / size**2 * (model.alltoall_coef * in_node + model.inter_node_alltoall_coef * across)


def brute_force(flat: list[int], groups: list[tuple[int, int]], model: CostModel, num_gpus: int, node: int):
    """Best step over every group per sequence, and best with every group inside a node."""
    rows = []
    for s in flat:
        row = []
        for start, size in groups:
            load = np.zeros(num_gpus)
            load[start : start + size] = group_seconds(s, size, model, node)
            row.append(load)
        rows.append(row)
    best, best_in_node = np.inf, np.inf
    for choice in itertools.product(range(len(groups)), repeat=len(flat)):
        step = sum(rows[i][g] for i, g in enumerate(choice)).max()
        best = min(best, step)
        if all(groups[g][1] <= node for g in choice):
            best_in_node = min(best_in_node, step)
    return best, best_in_node


def random_steps(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        lengths = [[] for _ in range(NODES * NODE)]
        for _ in range(int(rng.integers(1, 4))):
            lengths[int(rng.integers(0, NODES * NODE))].append(int(rng.integers(500, 30_000)))
        yield lengths


def test_auto_crosses_nodes_only_where_it_pays_against_brute_force():
    """4 nodes of 2 GPUs, groups of 1 to 8 (4: two nodes, 8: all four), 12 random steps at each of
    four inter-node rates: the plan is the brute-force optimum over every group of every sequence
    (up to where auto's search stops, ``near_optimal``);
    it uses a group across nodes only where the best plan inside nodes is slower, and always where
    it is; its loads are the formula's. Both outcomes occur."""
    topology = build_topology("auto", NODES * NODE, gpus_per_node=NODE, max_degree=NODES * NODE)
    groups = list(topology.groups)
    outcomes = set()
    for inter_node, lengths in itertools.product(INTER_NODE_RATES, random_steps(seed=0, count=12)):
        model = dataclasses.replace(BASE, inter_node_alltoall_coef=inter_node)
        flat = [s for rank in lengths for s in rank]
        plan = plan_routing(lengths, topology, model)
        check_plan_covers_every_token(plan, lengths, topology)
        best, best_in_node = brute_force(flat, groups, model, topology.group_size, NODE)
        expected = np.zeros(topology.group_size)
        for s, start, size in zip(flat, plan.seq_group_start.tolist(), plan.seq_group_size.tolist(), strict=True):
            expected[start : start + size] += group_seconds(s, size, model, NODE)
        np.testing.assert_allclose(plan.gpu_loads, expected, rtol=1e-12)
        assert plan.max_load <= near_optimal(best)
        across = bool((plan.seq_group_size > NODE).any())
        # auto's branch and bound stops near its bound (near_optimal): a crossing that pays less
        # than that may be left out (none of these steps has one: both checks below run on every step).
        pays, pays_beyond_tolerance = best_in_node > best * (1 + 1e-6), best_in_node > near_optimal(best)
        assert pays == pays_beyond_tolerance, (inter_node, lengths, best, best_in_node)
        assert across == pays, (inter_node, lengths, plan.seq_group_size.tolist(), best, best_in_node)
        outcomes.add(across)
    assert outcomes == {True, False}


def test_a_long_sequence_leaves_its_node_up_to_the_rate_where_crossing_stops_paying():
    """One 24,000-token sequence on 4 nodes of 2 GPUs: the group of all four nodes (6 of its 7 peers
    across) up to the inter-node rate ``c'`` where it costs as much as its home node's group of 2,
    that group above it: the switch is where the formula puts it, to 0.1%."""
    topology = build_topology("auto", NODES * NODE, gpus_per_node=NODE, max_degree=NODES * NODE)
    lengths = [[24_000]] + [[] for _ in range(NODES * NODE - 1)]
    no_inter = dataclasses.replace(BASE, inter_node_alltoall_coef=0.0)
    # group_seconds(8) = its value at c' = 0 plus 24,000 * 6 / 64 c'.
    switch = (group_seconds(24_000, 2, no_inter, NODE) - group_seconds(24_000, 8, no_inter, NODE)) / (24_000 * 6 / 64)
    for inter_node, size in ((2e-6, 8), (0.999 * switch, 8), (1.001 * switch, 2), (2e-2, 2)):
        plan = plan_routing(lengths, topology, dataclasses.replace(BASE, inter_node_alltoall_coef=inter_node))
        assert plan.seq_group_size.tolist() == [size] and plan.seq_group_start.tolist() == [0]


def test_fixed_bags_across_nodes_are_priced_at_the_inter_node_rate():
    """``g4n2`` over nodes of 2: every bag spans two nodes; its loads are the formula's, higher than
    the one-bandwidth model's by the cross-node share, and ``plan_loads`` with the nodes agrees."""
    model = dataclasses.replace(BASE, inter_node_alltoall_coef=2e-4)
    topology = build_topology("g4n2", gpus_per_node=NODE)
    lengths = [[20_000], [], [], [], [15_000], [], [], []]
    plan = plan_routing(lengths, topology, model, "knapformer")
    assert plan.seq_group_size.tolist() == [4, 4]
    expected = np.repeat([group_seconds(20_000, 4, model, NODE), group_seconds(15_000, 4, model, NODE)], 4)
    np.testing.assert_allclose(plan.gpu_loads, expected, rtol=1e-12)
    np.testing.assert_array_equal(plan_loads(plan, model, gpus_per_node=NODE), plan.gpu_loads)
    one_node = plan_loads(plan, model)  # nodes unknown: every peer in the node
    np.testing.assert_allclose(plan.gpu_loads - one_node, np.repeat([20_000, 15_000], 4) / 16 * 2 * (2e-4 - 2e-6))


def test_straddling_bag_is_priced_at_its_member_with_the_most_peers_across():
    """A bag of 3 from GPU 1 over nodes of 2 holds 1 GPU of node 0 and 2 of node 1: the member alone
    on node 0 exchanges with 2 peers across (the dearer rate), unless crossing is the cheaper."""
    model = dataclasses.replace(BASE, inter_node_alltoall_coef=2e-4)
    assert model.cross_node_peers(np.array([1, 0, 0]), np.array([3, 2, 4]), 2).tolist() == [2, 0, 2]
    cheaper = dataclasses.replace(BASE, inter_node_alltoall_coef=1e-6)
    assert cheaper.cross_node_peers(np.array([1]), np.array([3]), 2).tolist() == [1]
    assert model.cross_node_peers(np.array([1]), np.array([3]), None).tolist() == [0]
    assert BASE.cross_node_peers(np.array([0]), np.array([4]), 2).tolist() == [0]  # not priced apart


def test_no_peer_across_prices_as_one_bandwidth_bit_for_bit():
    """Within nodes the new term is the old one to the last bit: the same plans as the model without
    an inter-node price, on 32 GPUs of 8 per node, ``auto`` within nodes and fixed bags."""
    priced = default_cost_model("flux-dev")
    one_link = dataclasses.replace(priced, inter_node_alltoall_coef=None)
    s = np.arange(1, 5000, 7)
    for g in (1, 2, 4, 8):
        np.testing.assert_array_equal(priced.per_gpu_time(s, g, 1.0, None, 0), one_link.per_gpu_time(s, g))
    rng = np.random.default_rng(0)
    lengths = [rng.integers(200, 20_000, size=int(rng.integers(0, 4))).tolist() for _ in range(32)]
    for topology in (build_topology("auto", 32, gpus_per_node=8), build_topology("g8n2+g4n4", gpus_per_node=8)):
        a, b = plan_routing(lengths, topology, priced), plan_routing(lengths, topology, one_link)
        for field in dataclasses.fields(a):
            left, right = getattr(a, field.name), getattr(b, field.name)
            assert np.array_equal(left, right) if isinstance(left, np.ndarray) else left == right


def test_presets_price_the_inter_node_all_to_all_at_infiniband_bandwidth():
    """The FLOP presets take 50 GB/s per GPU across nodes (one 400 Gb/s InfiniBand port per H100),
    150 GB/s within: ``c'`` is 3 ``c``; ``None`` leaves it unpriced; a bad bandwidth is named."""
    assert DEFAULT_ALLTOALL_GBPS / DEFAULT_INTER_NODE_ALLTOALL_GBPS == 3
    for preset in ("flux-dev", "wan2.1-14b"):
        model = default_cost_model(preset)
        assert model.inter_node_alltoall_coef == pytest.approx(3 * model.alltoall_coef, rel=1e-12)
        assert default_cost_model(preset, inter_node_alltoall_gbps=None).inter_node_alltoall_coef is None
    with pytest.raises(ValueError, match="inter_node_alltoall_gbps=-5"):
        default_cost_model("flux-dev", inter_node_alltoall_gbps=-5)
    with pytest.raises(ValueError, match="inter_node_alltoall_coef must be a finite number >= 0; got -1"):
        CostModel(1.0, 1.0, inter_node_alltoall_coef=-1)
