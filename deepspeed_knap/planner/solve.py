"""The planner: per-rank sequence lengths + topology + cost model -> :class:`RoutingPlan`.

Pure NumPy and Python, no ``torch.distributed``: every rank of a balance group calls
:func:`plan_routing` on the same gathered lengths and gets a bit-identical plan, and the planner can be
tested and benchmarked for 1,024 simulated GPUs on a laptop.

Dimension names: ``S`` ranks in the balance group, ``N`` sequences (rank 0's first, in order, then
rank 1's, ...), ``B`` bags, ``C`` bag classes (bags of equal size and speed), ``K`` chunks.

Determinism: modeled costs are quantised once to int64 units (rounded down; the largest sequence
cost is 2**32 units), and every load, comparison and tie-break after that is exact integer
arithmetic ordered by ids. Float noise, such as a SIMD reduction order that differs between two
CPUs, cannot change a plan. Guarantees below about max loads hold exactly in these units, so in
seconds to within one unit (2**-32 of the largest cost) per sequence.

Solvers (``SOLVERS``):

* ``none``: no balancing; each rank runs its own sequences alone (Ulysses degree 1).
* ``knapformer``: the published greedy (Zhang et al., 2025), reimplemented from its description, as
  the reference to beat. It knows nothing of communication, speeds or memory caps.
* ``refine`` (default): the best of three starting assignments (a finish-time greedy that prices the
  Ulysses all-to-all; the ``knapformer`` greedy; every sequence in the bag holding its home rank),
  improved by local search (move one sequence off the busiest bag, or swap it with a sequence of a
  lightly loaded bag, while that lowers the busiest bag's load), then permuted among identical bags to
  keep tokens on their home rank. Steps of at most ``EXACT_MAX_SEQUENCES`` sequences are finished by
  a budgeted exact branch and bound. If keeping every sequence alone on its home GPU (``none``) is no
  slower, that plan is returned instead: the all-to-all can cost more than balancing gains. Local
  search never raises the max load, so ``refine`` is never worse than ``knapformer`` or ``none`` in
  modeled max load, and it honours ``max_tokens_per_gpu``. With a route coefficient or latency in
  the cost model, ``refine`` then brings home (alone on its home GPU) every sequence whose move costs more
  route time than it saves compute (:mod:`~deepspeed_knap.planner.route`). On topology ``auto``
  with a ``max_degree`` above the node and a model that prices the all-to-all across nodes
  (``inter_node_alltoall_coef``), ``refine`` also solves the step inside nodes alone and keeps the
  plan with groups across nodes only when its modeled step is shorter: such a group is chosen only
  when it pays.
"""

from __future__ import annotations

import contextlib
import gc
import numbers
import statistics
import time
from collections.abc import Sequence

import numpy as np

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.planner.elastic import solve_elastic
from deepspeed_knap.planner.fixed import _knapformer_greedy, _refine
from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.problem import Problem, _flatten_segments, _group_loads
from deepspeed_knap.planner.route import gpu_traffic, keep_home, route_seconds
from deepspeed_knap.planner.topology import AUTO, Topology, build_topology

SOLVERS = ("none", "knapformer", "refine")
DEFAULT_SOLVER = "refine"
DEFAULT_REFINE_STEPS = 256


def plan_routing(
    seq_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    cost_model: CostModel,
    solver: str = DEFAULT_SOLVER,
    max_tokens_per_gpu: int | None = None,
    refine_steps: int = DEFAULT_REFINE_STEPS,
    seq_segments_per_rank: Sequence[Sequence[Sequence[int]]] | None = None,
) -> RoutingPlan:
    """Plan one step for one balance group.

    Args:
        seq_lens_per_rank: ``S`` lists, one per rank of the balance group, of that rank's sequence
            lengths (tokens): Python or NumPy integers from 1 to 2**40, at most 2**40 tokens and 2**20
            sequences in all (``MAX_STEP_TOKENS`` and ``MAX_STEP_SEQUENCES`` of
            :mod:`~deepspeed_knap.planner.problem`). An empty list is a rank with nothing this step.
        topology: bag layout; only its balance group (``topology.group_size`` ranks) is planned.
        cost_model: the cost model (:class:`~deepspeed_knap.cost.model.CostModel`).
        solver: one of :data:`SOLVERS`.
        max_tokens_per_gpu: hard cap on tokens a GPU may hold after routing. ``refine`` honours it;
            ``none`` raises when a rank's own tokens exceed it; ``knapformer`` cannot honour it and
            raises when given one.
        refine_steps: local-search step budget of ``refine`` (a count, not a time, so plans stay
            deterministic).
        seq_segments_per_rank: ``None``, or ``S`` lists (as ``seq_lens_per_rank``) of one row per
            sequence: the lengths of its attention segments, non-negative integers summing to its
            length (FLUX.3: text, image, references; ``Flux3Inputs.segments``). The cost model
            prices each sequence's attention by them (``segment_attention_share``: the blocks
            attending within each segment pay ``sum_k l_k**2``, the others ``s**2``). ``None``:
            every sequence one segment, the plans of before bit for bit.

    Raises:
        ValueError: wrong number of ranks, lengths that are no integers (floats and bools are
            refused, not cast) or out of those limits, segments that do not sum to their sequence's
            length, an unknown solver, a sequence no bag can hold under the cap, or a cap the
            planner finds no assignment for.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if max_tokens_per_gpu is not None and (
        isinstance(max_tokens_per_gpu, bool)
        or not isinstance(max_tokens_per_gpu, (int, np.integer))
        or max_tokens_per_gpu <= 0
    ):
        raise ValueError(f"max_tokens_per_gpu must be a positive integer or None; got {max_tokens_per_gpu!r}")
    if not isinstance(refine_steps, numbers.Integral) or isinstance(refine_steps, bool) or refine_steps < 0:
        raise ValueError(f"refine_steps must be an integer >= 0 (a count of search steps); got {refine_steps!r}")
    with _gc_paused():
        plan, problem = _solve(seq_lens_per_rank, topology, cost_model, solver, max_tokens_per_gpu, refine_steps,
                               seq_segments_per_rank)  # fmt: skip
        if not _crosses_nodes_by_cost(topology, cost_model, solver):
            return plan
        # Groups across nodes only where they pay: the plan inside nodes unless this one is faster.
        node = build_topology(AUTO, topology.world_size, topology.gpus_per_node, topology.gpus_per_node)
        try:
            inside, _ = _solve(seq_lens_per_rank, node, cost_model, solver, max_tokens_per_gpu, refine_steps,
                               seq_segments_per_rank)  # fmt: skip
        except ValueError:  # the cap: some sequence needs a group across nodes
            return plan
        nodes = topology.gpus_per_node
        if _modeled_step(plan, cost_model, nodes) < _modeled_step(inside, cost_model, nodes):
            return plan
        return problem.make_plan(solver, inside.seq_group_start, inside.seq_group_size)


def _crosses_nodes_by_cost(topology: Topology, cost_model: CostModel, solver: str) -> bool:
    """Whether ``topology`` is ``auto`` with groups of whole nodes that ``refine`` gives by their
    price (the model prices the all-to-all across nodes; without it they only take what the cap
    keeps out of every node's group)."""
    return (solver == "refine" and topology.elastic and topology.gpus_per_node is not None
            and topology.max_degree > topology.gpus_per_node and cost_model.prices_inter_node_alltoall)  # fmt: skip


def _modeled_step(plan: RoutingPlan, cost_model: CostModel, gpus_per_node: int | None) -> float:
    """Seconds of ``plan``'s step: its busiest GPU's load and its route phase, if priced."""
    if not cost_model.prices_routes:
        return plan.max_load
    return plan.max_load + plan_route_s(plan, cost_model, gpus_per_node)


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector during a solve. The solver allocates many small objects,
    which trigger full collections; in a process that has torch and DeepSpeed loaded each one walks
    millions of objects, and measured at 1,024 GPUs x 32 sequences that nearly tripled the solve time
    (44 -> 122 ms median). The solver builds no reference cycles, so nothing is left for it to free."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _solve(seq_lens_per_rank, topology: Topology, cost_model: CostModel, solver: str, max_tokens_per_gpu: int | None,
           refine_steps: int, seq_segments_per_rank=None) -> tuple[RoutingPlan, Problem]:  # fmt: skip
    """The plan of one topology, and the problem it solved."""
    if topology.elastic and solver == "knapformer":
        raise ValueError(
            "solver 'knapformer' needs a fixed topology (it assigns sequences to bags of one size each); "
            "topology 'auto' is planned by 'refine' (or 'none')"
        )
    if solver == "knapformer" and max_tokens_per_gpu is not None:
        raise ValueError(
            f"solver 'knapformer' cannot honour max_tokens_per_gpu={max_tokens_per_gpu} (the published greedy knows "
            "no memory); use solver 'refine', or drop the cap"
        )
    problem = Problem.build(seq_lens_per_rank, topology, cost_model, max_tokens_per_gpu, seq_segments_per_rank)
    if solver == "none":
        if not problem.fits_cap_at_home():  # nothing moves: the cap holds or it is an error, never an OOM
            home_tokens = np.bincount(problem.src, weights=problem.seq_lens, minlength=problem.num_gpus)
            rank = int(np.argmax(home_tokens))
            raise ValueError(
                f"solver 'none' keeps every sequence home, and rank {rank} holds {int(home_tokens[rank])} tokens, over "
                f"max_tokens_per_gpu={max_tokens_per_gpu}; balance with solver 'refine', or raise the cap"
            )
        return problem.make_home_plan(solver), problem
    if topology.elastic:
        bag_of_seq = solve_elastic(problem, refine_steps)
    elif solver == "knapformer":
        bag_of_seq = _knapformer_greedy(problem)
    else:
        bag_of_seq = _refine(problem, refine_steps)
    home_fits = solver == "refine" and problem.fits_cap_at_home()
    if bag_of_seq is None and not home_fits:
        total, gpus = int(problem.seq_lens.sum()), topology.group_size
        why = ""
        if problem.barred_within_cap and -(-total // gpus) <= max_tokens_per_gpu:  # room enough, on average
            why = (" (groups of whole nodes take only sequences that no group inside a node holds alone under the "
                   "cap)")  # fmt: skip
        raise ValueError(
            f"max_tokens_per_gpu={max_tokens_per_gpu} could not be met: {total} tokens over {gpus} GPUs need at "
            f"least {-(-total // gpus)} per GPU on average, and the planner found no assignment that keeps every "
            f"GPU under the cap{why}. Raise the cap or use larger bags"
        )
    # Running every sequence alone on its home GPU needs no bag at all; when no topology plan beats
    # it (tiny sequences, where the all-to-all costs more than balancing wins), that is the plan.
    if bag_of_seq is None:
        return problem.make_home_plan(solver), problem
    group_start, group_size = problem.bag_first[bag_of_seq], problem.bag_size[bag_of_seq]
    route_s = 0.0
    if solver == "refine" and cost_model.prices_routes:  # moving tokens costs time: keep home what does not pay
        group_start, group_size = _keep_home(problem, group_start, group_size)
        route_s = route_seconds(cost_model, gpu_traffic(problem.seq_lens, problem.src, group_start, group_size,
                                                        problem.num_gpus, topology.gpus_per_node))  # fmt: skip
    plan = problem.make_plan(solver, group_start, group_size)
    if home_fits and problem.home_max_load_s <= plan.max_load + route_s:
        return problem.make_home_plan(solver), problem
    return plan, problem


def _keep_home(problem: Problem, group_start: np.ndarray, group_size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~deepspeed_knap.planner.route.keep_home` of the plan of groups ``(group_start,
    group_size)`` ``[N]``, with the problem's costs in its quantised units (rounded down, as the
    problem's own)."""
    model, unit = problem.cost_model, problem.seconds_per_unit
    speed = np.ones(problem.num_gpus) if model.gpu_speed is None else np.asarray(model.gpu_speed, dtype=np.float64)
    group_speed = np.array([speed[start : start + size].min() for start, size in
                            zip(group_start.tolist(), group_size.tolist(), strict=True)])  # fmt: skip
    across = model.cross_node_peers(group_start, group_size, problem.topology.gpus_per_node)
    load_units = np.floor(model.per_gpu_time(problem.seq_lens, group_size, group_speed, problem.segment_squares,
                                             across if across.any() else None) / unit).astype(np.int64)  # fmt: skip
    home_units = np.floor(model.per_gpu_time(problem.seq_lens, 1, speed[problem.src], problem.segment_squares)
                          / unit).astype(np.int64)  # fmt: skip
    base_units = np.floor(model.gpu_overhead_s(problem.num_gpus) / unit).astype(np.int64)
    return keep_home(model, problem.seq_lens, problem.src, group_start, group_size, load_units, home_units, unit,
                     base_units, problem.topology.gpus_per_node, problem.cap)  # fmt: skip


def lower_bound(
    seq_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    cost_model: CostModel,
    max_tokens_per_gpu: int | None = None,
    seq_segments_per_rank: Sequence[Sequence[Sequence[int]]] | None = None,
) -> float:
    """Modeled seconds no plan over ``topology``'s groups (or keeping every sequence home) can beat:
    the ``lower_bound`` every plan of these lengths carries, without solving. With topology ``auto``
    it is the bound for giving every sequence its own Ulysses degree. ``seq_segments_per_rank``: as
    :func:`plan_routing`'s.

    Raises:
        ValueError: as :func:`plan_routing`, for bad lengths or a sequence no group holds under the cap.
    """
    with _gc_paused():
        return Problem.build(
            seq_lens_per_rank, topology, cost_model, max_tokens_per_gpu, seq_segments_per_rank
        ).lower_bound_s


def plan_loads(
    plan: RoutingPlan,
    cost_model: CostModel,
    seq_segments_per_rank: Sequence[Sequence[Sequence[int]]] | None = None,
    gpus_per_node: int | None = None,
) -> np.ndarray:
    """``[S]`` modeled seconds per GPU of running ``plan`` under ``cost_model``, which may differ from
    the model the plan was solved with: what a plan made with a wrong model really costs.
    ``seq_segments_per_rank``: the step's attention segments (as :func:`plan_routing`'s), priced by
    ``cost_model``; ``None``: one segment per sequence. A plan solved without segments, priced with
    them, is what ignoring them costs. ``gpus_per_node``: where nodes end, for the all-to-all of
    groups across nodes (``inter_node_alltoall_coef``); ``None``: one node. A plan's own
    ``gpu_loads`` are priced with its topology's nodes.

    Raises:
        ValueError: ``cost_model.gpu_speed`` does not list one speed per GPU of the plan.
    """
    if cost_model.gpu_speed is not None and len(cost_model.gpu_speed) != plan.num_gpus:
        raise ValueError(
            f"gpu_speed has {len(cost_model.gpu_speed)} entries but the plan has {plan.num_gpus} GPUs; give one per GPU"
        )
    squares = None
    if seq_segments_per_rank is not None:  # plan order is rank 0's sequences, then rank 1's, ...
        squares = _flatten_segments(seq_segments_per_rank, plan.seq_lens, plan.seq_src_rank, plan.num_gpus)
    return _group_loads(cost_model, plan.seq_lens, plan.seq_group_start, plan.seq_group_size, plan.num_gpus,
                        squares, gpus_per_node)  # fmt: skip


def plan_route_s(plan: RoutingPlan, cost_model: CostModel, gpus_per_node: int | None = None) -> float:
    """Modeled seconds of ``plan``'s route phase under ``cost_model``: the route and the reverse
    route, forward and backward, of the tokens it moves (:mod:`~deepspeed_knap.planner.route`).
    ``gpus_per_node``: where nodes end, for ``inter_node_route_coef``; ``None``: one node. The
    plan's modeled step is ``plan.max_load + plan_route_s(plan, cost_model, gpus_per_node)``."""
    traffic = gpu_traffic(plan.seq_lens, plan.seq_src_rank, plan.seq_group_start, plan.seq_group_size, plan.num_gpus,
                          gpus_per_node)  # fmt: skip
    return route_seconds(cost_model, traffic)


def timed_plan(
    seq_lens: list[list[int]],
    topology: Topology,
    cost_model: CostModel,
    solver: str,
    max_tokens_per_gpu: int | None = None,
    repeat: int = 1,
    seq_segments_per_rank: list[list[tuple[int, ...]]] | None = None,
) -> tuple[RoutingPlan, float]:
    """The plan and the median wall-clock milliseconds of ``repeat`` solves (``seq_segments_per_rank``:
    :func:`~deepspeed_knap.planner.plan_routing`'s)."""
    times, plan = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        plan = plan_routing(seq_lens, topology, cost_model, solver, max_tokens_per_gpu,
                            seq_segments_per_rank=seq_segments_per_rank)  # fmt: skip
        times.append((time.perf_counter() - start) * 1e3)
    return plan, statistics.median(times)
