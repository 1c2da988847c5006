"""Topology grammar, rank <-> bag maps, node alignment (against a brute-force search)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepspeed_knap.planner.topology import build_topology, parse_topology_spec


def test_parse_terms_in_written_order():
    assert parse_topology_spec("g8n4") == [(8, 4)]
    assert parse_topology_spec("g1n8+g2n4") == [(1, 8), (2, 4)]
    assert parse_topology_spec(" g2n1 + g2n3 ") == [(2, 1), (2, 3)]  # repeated G allowed


@pytest.mark.parametrize("spec, bad", [("g8n", "g8n"), ("g0n4", "g0n4"), ("g8x4", "g8x4"), ("g8n4+", "''"),
                                       ("g1n2+gn3", "gn3"), ("G8N4", "G8N4"), ("g08n4", "g08n4")])  # fmt: skip
def test_malformed_spec_names_the_bad_part_and_shows_the_grammar(spec, bad):
    with pytest.raises(ValueError) as error:
        parse_topology_spec(spec)
    assert bad in str(error.value)
    assert "g{G}n{N}(+g{G}n{N})*" in str(error.value)


def test_world_size_mismatch_shows_both_numbers():
    with pytest.raises(ValueError, match=r"multiple of its 12 GPUs.*has 16 ranks"):
        build_topology("g2n2+g4n2", world_size=16)


def test_replicas_and_contiguous_bags():
    topology = build_topology("g1n2+g2n1", world_size=8)
    assert topology.group_size == 4 and topology.num_replicas == 2
    assert topology.bag_sizes == (2, 1, 1)  # larger bags first
    assert topology.bag_first_rank == (0, 2, 3)
    assert topology.bag_of_gpu == (0, 0, 1, 2)
    assert list(topology.bag_ranks(0, replica=1)) == [4, 5]
    assert topology.locate(5) == (1, 0, 1)
    assert topology.locate(7) == (1, 2, 0)
    with pytest.raises(ValueError, match="outside the world of 8"):
        topology.locate(8)


def test_descending_order_is_not_enough_and_the_search_finds_the_aligned_order():
    topology = build_topology("g4n2+g2n2", gpus_per_node=6)
    assert topology.bag_sizes == (4, 2, 4, 2)  # 4, 4 would put the second bag across ranks 4..7
    assert topology.node_aligned


def test_impossible_alignment_is_reported_not_hidden():
    topology = build_topology("g3n2", gpus_per_node=4)
    assert not topology.node_aligned


def test_large_flat_topologies_do_not_recurse():
    topology = build_topology("g1n1024", gpus_per_node=8)
    assert topology.node_aligned and topology.num_bags == 1024


def _crosses(order, gpus_per_node):
    start = 0
    for size in order:
        inside = start % gpus_per_node + size <= gpus_per_node
        whole_nodes = start % gpus_per_node == 0 and size % gpus_per_node == 0
        if not (inside or whole_nodes):
            return True
        start += size
    return False


@settings(max_examples=150, deadline=None)
@given(
    terms=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 3)), min_size=1, max_size=3),
    gpus_per_node=st.integers(1, 8),
)
def test_alignment_matches_brute_force(terms, gpus_per_node):
    spec = "+".join(f"g{g}n{n}" for g, n in terms)
    sizes = [g for g, n in terms for _ in range(n)]
    possible = any(not _crosses(order, gpus_per_node) for order in set(itertools.permutations(sizes)))
    topology = build_topology(spec, gpus_per_node=gpus_per_node)
    assert sorted(topology.bag_sizes) == sorted(sizes)
    assert topology.node_aligned == possible
    if possible:
        assert not _crosses(topology.bag_sizes, gpus_per_node)


@pytest.mark.parametrize("spec, message", [
    ("g99999999999999999999n1", "its bag size G 99999999999999999999 is over 16,384, the most GPUs a balance group"),
    ("g1n" + "9" * 5000, "its bag count N 9999999999999999999999999999999999999999... (5,000 characters) is over"),
    ("g8n2049", "topology 'g8n2049' has over 16,384 GPUs (sum of G*N: 16,392 by its term 1)"),
    ("+".join(["g1n1"] * 100_000), "(499,999 characters)' has over 16,384 GPUs (sum of G*N: 16,385 by its term 16385)"),
])  # fmt: skip
def test_bag_sizes_and_counts_over_the_most_gpus_are_refused_by_the_parser_at_once(spec, message):
    """Before, g99999999999999999999n1 grew a list of that many bags until memory ran out."""
    import time

    from deepspeed_knap.runtime.config import get_knapformer_config

    start = time.perf_counter()
    with pytest.raises(ValueError) as parsed:
        parse_topology_spec(spec)
    with pytest.raises(ValueError) as configured:  # the config's topology goes through the same parser
        get_knapformer_config({"knapformer": {"enabled": True, "topology": spec}})
    assert time.perf_counter() - start < 2
    assert message in str(parsed.value) and message in str(configured.value)
    assert parse_topology_spec("g8n2048") == [(8, 2048)]  # 16,384 GPUs: the most


def test_auto_over_the_most_gpus_is_refused_before_laying_out_groups():
    with pytest.raises(ValueError, match="topology 'auto' over 1,000,000,000 GPUs: its balance group is the whole"):
        build_topology("auto", 10**9)
    assert build_topology("auto", 16_384).group_size == 16_384
