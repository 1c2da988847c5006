"""Compute-bag topology: the ``g{G}n{N}(+g{G}n{N})*`` grammar, ``auto``, and the rank <-> bag maps.

A *balance group* of ``S = sum(G * N)`` consecutive ranks is cut into *compute bags*: ``N`` bags of
``G`` GPUs for every ``g{G}n{N}`` term. A bag runs DeepSpeed-Ulysses sequence parallelism of degree
``G`` over the sequences the planner gives it. A world of ``k * S`` ranks holds ``k`` replicas of the
balance group; each replica balances on its own.

``auto`` (the elastic topology) has no fixed bags: the whole world is one balance group, and every
step each sequence runs in a group of its own size ``1, 2, 4, ...`` up to ``max_degree``. A group of
``G`` GPUs starts at a multiple of ``G`` and never crosses a node, so any two groups are nested or
disjoint (a buddy system). The topology's "bags" are then the largest such groups, which tile the
world; :attr:`Topology.groups` lists every group a plan may use. A ``max_degree`` above a node (of a
power-of-two size) adds groups of whole nodes (2, 4, ... nodes, aligned likewise), which the planner
gives where their price pays (the cost model's inter-node all-to-all rate), or, under a model without
one, only to sequences that no group inside a node holds under the memory cap.

Ranks of a bag are contiguous. Given ``gpus_per_node``, bags are ordered so that none crosses a node
boundary whenever such an order exists (bags larger than a node must then start on a node boundary and
cover whole nodes). Among valid orders the first found with larger bags first is taken, so the layout is
deterministic.

:func:`create_process_groups` makes the communication groups through ``deepspeed.comm``; everything
else here is pure Python.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass

AUTO = "auto"
GRAMMAR = "g{G}n{N}(+g{G}n{N})*, e.g. 'g8n4' (4 bags of 8 GPUs) or 'g1n8+g2n4', or 'auto'"
_TERM = re.compile(r"g([1-9][0-9]*)n([1-9][0-9]*)")
DEFAULT_MAX_DEGREE = 8
# The most GPUs one balance group (what one plan covers) may have: 16x the largest benchmarked
# (1,024), the size of the largest single training jobs reported (16,384 H100s). The planner's arrays
# grow with it: `deepspeed-knap plan --gpus 16384` (topology auto, 45,568 sequences of kf_image_video)
# solves in 6.7 s and 0.18 GB on a 2-core CPU, 65,536 GPUs in 31 s and 0.9 GB; a typo's billion GPUs
# would take longer than any job.
MAX_GPUS = 16_384
# The largest bag (or auto's largest group): Ulysses gives each GPU of a bag a head at least, and no
# DiT has more than a few dozen (FLUX 24, Wan 40). The planner's arrays grow with the number of GPUs
# times the largest group: one bag of 4,096 GPUs took 3.7 GB to plan, of 16,384 over 24 GB.
MAX_BAG_SIZE = 1_024


def parse_topology_spec(spec: str) -> list[tuple[int, int]]:
    """Parse ``spec`` into ``[(bag_size G, bag_count N), ...]`` in the order written (``[]`` for ``auto``).

    Raises:
        ValueError: naming the malformed term and showing the grammar.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"topology must be a non-empty string of the form {GRAMMAR}; got {spec!r}")
    if spec.strip() == AUTO:
        return []
    terms, total = [], 0
    for term in spec.strip().split("+"):
        match = _TERM.fullmatch(term.strip())
        if match is None:
            raise ValueError(
                f"malformed topology term {term!r} in {spec!r}: expected {GRAMMAR} "
                "(G and N are positive integers without leading zeros)"
            )
        # Compared as digits first: a number of thousands of digits is refused before int() reads it.
        for digits, what in ((match.group(1), "bag size G"), (match.group(2), "bag count N")):
            if len(digits) > len(str(MAX_GPUS)) or int(digits) > MAX_GPUS:
                raise ValueError(
                    f"topology term {_shortened(term.strip())!r}: its {what} {_shortened(digits)} is over "
                    f"{MAX_GPUS:,}, the most GPUs a balance group may have; give the bags of one balance group"
                )
        terms.append((int(match.group(1)), int(match.group(2))))
        if terms[-1][0] > MAX_BAG_SIZE:
            raise ValueError(
                f"topology term {term.strip()!r}: its bag size G {terms[-1][0]:,} is over {MAX_BAG_SIZE:,}, the largest "
                "bag (Ulysses needs an attention head per GPU of a bag); use smaller bags"
            )
        total += terms[-1][0] * terms[-1][1]  # checked term by term: every term holds at least one GPU
        if total > MAX_GPUS:
            raise ValueError(
                f"topology {_shortened(spec.strip())!r} has over {MAX_GPUS:,} GPUs (sum of G*N: {total:,} by its "
                f"term {len(terms)}), the most GPUs a balance group may have; give the bags of one balance group (a "
                "world of several such groups balances each alone)"
            )
    return terms


def _shortened(text: str, limit: int = 40) -> str:
    """``text`` for an error message, cut to ``limit`` characters (a typo may be thousands long)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


@dataclass(frozen=True)
class Topology:
    """Bags of one balance group, and where each replica of the group sits in the world.

    Attributes:
        spec: the topology string as given (whitespace stripped).
        bag_sizes: ``[B]`` GPUs per bag, in rank order inside the balance group (``auto``: the largest
            groups, which tile the world).
        bag_first_rank: ``[B]`` first rank (inside the balance group) of each bag.
        world_size: total ranks; a multiple of ``group_size``.
        gpus_per_node: GPUs per node, or ``None`` when unknown.
        node_aligned: whether every bag of every replica avoids crossing a node boundary
            (``True`` when ``gpus_per_node`` is ``None``, and always for ``auto``).
        max_degree: ``auto`` only: the largest group; ``None`` for a fixed topology.
    """

    spec: str
    bag_sizes: tuple[int, ...]
    bag_first_rank: tuple[int, ...]
    world_size: int
    gpus_per_node: int | None
    node_aligned: bool
    max_degree: int | None = None

    @property
    def elastic(self) -> bool:
        """Whether each sequence gets its own group every step (``auto``)."""
        return self.max_degree is not None

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, int], ...]:
        """``(start, size)`` of every group a plan may run a sequence's attention in, positions inside
        the balance group, larger groups first, then by start: the bags of a fixed topology; for
        ``auto`` every aligned sub-group (halving down to single GPUs) of every bag. Every rank
        creates the process groups in this order."""
        if not self.elastic:
            return tuple(zip(self.bag_first_rank, self.bag_sizes, strict=True))
        found = [
            (start, size)
            for first, top in zip(self.bag_first_rank, self.bag_sizes, strict=True)
            for size in _halvings(top)
            for start in range(first, first + top, size)
        ]
        return tuple(sorted(found, key=lambda group: (-group[1], group[0])))

    @property
    def group_size(self) -> int:
        """Ranks in one balance group, ``S``."""
        return sum(self.bag_sizes)

    @property
    def num_bags(self) -> int:
        return len(self.bag_sizes)

    @property
    def num_replicas(self) -> int:
        """How many balance groups the world holds, ``k``."""
        return self.world_size // self.group_size

    @functools.cached_property
    def bag_of_gpu(self) -> tuple[int, ...]:
        """``[S]`` bag id of every rank of the balance group."""
        return tuple(b for b, size in enumerate(self.bag_sizes) for _ in range(size))

    def bag_ranks(self, bag: int, replica: int = 0) -> range:
        """Global ranks of ``bag`` in balance-group ``replica``."""
        first = replica * self.group_size + self.bag_first_rank[bag]
        return range(first, first + self.bag_sizes[bag])

    def locate(self, global_rank: int) -> tuple[int, int, int]:
        """``(replica, bag, rank inside the bag)`` of a global rank."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"rank {global_rank} is outside the world of {self.world_size} ranks")
        replica, group_rank = divmod(global_rank, self.group_size)
        bag = self.bag_of_gpu[group_rank]
        return replica, bag, group_rank - self.bag_first_rank[bag]


def build_topology(
    spec: str, world_size: int | None = None, gpus_per_node: int | None = None, max_degree: int | None = None
) -> Topology:
    """Parse ``spec`` and lay its bags out over ``world_size`` ranks.

    Args:
        spec: topology string, see :data:`GRAMMAR`.
        world_size: ranks in the job; defaults to one balance group (required for ``auto``). Must be a
            multiple of the group size ``S = sum(G * N)``.
        gpus_per_node: when given, bags are ordered so none crosses a node boundary if any order allows;
            ``auto`` groups never cross one (but groups of whole nodes, see ``max_degree``).
        max_degree: ``auto`` only: the largest group, a power of two; above the node (whose size must
            then be a power of two too), groups of whole nodes, given where they pay (the module
            docstring). Default: the smallest of 8, the node and the world, rounded
            down to a power of two (the model's heads bound it too: :func:`deepspeed_knap.initialize`
            passes them).

    Raises:
        ValueError: malformed spec, world size that is not a multiple of ``S``, bad ``gpus_per_node``
            or ``max_degree``.
    """
    terms = parse_topology_spec(spec)
    if gpus_per_node is not None and (not _positive_int(gpus_per_node)):
        raise ValueError(f"gpus_per_node must be a positive integer or None; got {gpus_per_node!r}")
    if not terms:
        return _build_auto(world_size, gpus_per_node, max_degree)
    if max_degree is not None:
        raise ValueError(
            f"max_degree={max_degree!r} applies to topology 'auto' only; topology {spec!r} fixes its bag sizes"
        )
    group_size = sum(g * n for g, n in terms)
    if world_size is None:
        world_size = group_size
    if not _positive_int(world_size) or world_size % group_size:
        raise ValueError(
            f"topology {spec!r} needs a world size that is a multiple of its {group_size} GPUs "
            f"(sum of G*N over its terms); the world has {world_size} ranks. Change the topology so "
            f"that sum(G*N) divides {world_size}, or launch a multiple of {group_size} ranks"
        )

    sizes = sorted((g for g, n in terms for _ in range(n)), reverse=True)
    bag_sizes = sizes
    node_aligned = True
    if gpus_per_node is not None:
        bag_sizes = _node_aligned_order(sizes, gpus_per_node) or sizes
        node_aligned = _all_aligned(bag_sizes * (world_size // group_size), gpus_per_node)
    return Topology(spec.strip(), tuple(bag_sizes), _firsts(bag_sizes), world_size, gpus_per_node, node_aligned)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _firsts(sizes: list[int]) -> tuple[int, ...]:
    """First rank of each of consecutive bags of ``sizes``."""
    return tuple(itertools.accumulate(sizes[:-1], initial=0)) if sizes else ()


def _halvings(size: int) -> list[int]:
    """``size, size / 2, ..., 1`` for a power of two."""
    return [size >> k for k in range(size.bit_length())]


def default_max_degree(world_size: int, gpus_per_node: int | None = None, num_heads: int | None = None) -> int:
    """The ``auto`` default: the smallest of :data:`DEFAULT_MAX_DEGREE`, the node, the world and the
    heads, rounded down to a power of two."""
    limit = min(DEFAULT_MAX_DEGREE, world_size, gpus_per_node or world_size, num_heads or world_size)
    return 1 << (max(limit, 1).bit_length() - 1)


def _build_auto(world_size: int | None, gpus_per_node: int | None, max_degree: int | None) -> Topology:
    if not _positive_int(world_size):
        raise ValueError(f"topology 'auto' needs the world size (a positive integer); got {world_size!r}")
    if world_size > MAX_GPUS:  # auto's balance group is the world
        raise ValueError(
            f"topology 'auto' over {world_size:,} GPUs: its balance group is the whole world, and {MAX_GPUS:,} GPUs "
            "is the most one may have; use fixed bags, whose balance groups replicate over the world"
        )
    if max_degree is None:
        max_degree = default_max_degree(world_size, gpus_per_node)
    elif _positive_int(max_degree) and max_degree > MAX_BAG_SIZE:
        raise ValueError(
            f"max_degree={max_degree:,} is over {MAX_BAG_SIZE:,}, the largest group (Ulysses needs an attention head "
            "per GPU of a group); give a smaller one"
        )
    elif not _positive_int(max_degree) or max_degree & (max_degree - 1):
        raise ValueError(
            f"max_degree must be a power of two (1, 2, 4, 8, ...); got {max_degree!r}. Ulysses groups of 'auto' "
            "halve down to single GPUs"
        )
    if gpus_per_node is not None and max_degree > gpus_per_node and gpus_per_node & (gpus_per_node - 1):
        raise ValueError(
            f"max_degree={max_degree} is larger than a node of {gpus_per_node} GPUs: groups of whole nodes need "
            f"nodes of a power-of-two size; use max_degree <= {1 << (gpus_per_node.bit_length() - 1)}"
        )
    # Tile every node (or the world; or spans of max_degree GPUs, whole nodes, when it is larger) with
    # the largest aligned groups: a group of G starts at a multiple of G, so all groups of all sizes
    # are nested or disjoint, and with power-of-two nodes a group of at most a node stays inside one.
    node = max(gpus_per_node or world_size, max_degree)
    sizes = []
    for node_start in range(0, world_size, node):
        start, end = node_start, min(node_start + node, world_size)
        while start < end:
            size = max_degree
            while start % size or start + size > end:
                size //= 2
            sizes.append(size)
            start += size
    return Topology(AUTO, tuple(sizes), _firsts(sizes), world_size, gpus_per_node, True, max_degree)


def _fits_node(start: int, size: int, gpus_per_node: int) -> bool:
    """Whether a bag of ``size`` starting at ``start`` stays inside one node or covers whole nodes."""
    offset = start % gpus_per_node
    if size <= gpus_per_node:
        return offset + size <= gpus_per_node
    return offset == 0 and size % gpus_per_node == 0


def _node_aligned_order(sizes: list[int], gpus_per_node: int) -> list[int] | None:
    """An order of bag ``sizes`` in which no bag crosses a node boundary, or ``None`` if none exists.

    Depth-first search over (counts of each distinct size left, offset inside the current node),
    memoising dead states; topologies have few distinct bag sizes, so the state space is small. Larger
    sizes are tried first, so power-of-two layouts come out in plain descending order. (When the group
    does not fill whole nodes, later replicas start mid-node; :func:`build_topology` reports that
    through ``node_aligned`` rather than searching a layout per replica.)
    """
    distinct = sorted(set(sizes), reverse=True)
    dead: set[tuple[tuple[int, ...], int]] = set()
    order: list[int] = []
    # Explicit stack (g1n1024 would be 1024 recursion levels): (sizes left, offset, next size to try).
    stack = [(tuple(sizes.count(s) for s in distinct), 0, 0)]
    while stack:
        remaining, offset, choice = stack[-1]
        if not any(remaining):
            return order
        for i in range(choice, len(distinct)):
            if not remaining[i] or not _fits_node(offset, distinct[i], gpus_per_node):
                continue
            child = ((*remaining[:i], remaining[i] - 1, *remaining[i + 1 :]), (offset + distinct[i]) % gpus_per_node)
            if child not in dead:
                stack[-1] = (remaining, offset, i + 1)
                stack.append((*child, 0))
                order.append(distinct[i])
                break
        else:
            dead.add((remaining, offset))
            stack.pop()
            if order:
                order.pop()
    return None


def _all_aligned(bag_sizes: list[int], gpus_per_node: int) -> bool:
    start = 0
    for size in bag_sizes:
        if not _fits_node(start, size, gpus_per_node):
            return False
        start += size
    return True
