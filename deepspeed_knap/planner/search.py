"""What the two solvers share: the loop and stopping rule of local search, the driver of the exact
branch and bound, and the constants that tune both.

The fixed-topology solver (:mod:`~deepspeed_knap.planner.fixed`) puts every sequence in one of
disjoint bags; the elastic one (:mod:`~deepspeed_knap.planner.elastic`, topology ``auto``) in one of
nested groups of every size, with a load per GPU. Both improve their best start by local search,
which lowers the busiest load a step at a time (:func:`local_search`), and finish steps of few
sequences by a budgeted branch and bound (:class:`BranchAndBound`). What a step or a branch is
depends on the state, and stays with each solver: a bag's one load against every GPU of a group,
interchangeable empty bags against mirror-image groups, the elastic search's completion of short
sequences on single GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from deepspeed_knap.planner.problem import Problem

# A load, cost or score no real one reaches (a load sums quantised costs of at most 2**32 units): a
# barred option, or no incumbent yet.
BIG = np.iinfo(np.int64).max

# Local search stops once the max load is within this fraction of the lower bound (the cost model is
# far coarser than that), and when a window of STALL_WINDOW steps cut the max by less than it.
SEARCH_TOLERANCE = 1e-3
STALL_WINDOW = 32
# The elastic planner's starts and branch and bound also stop within SEARCH_FLOOR_S seconds of the
# bound, or within SEARCH_FLOOR_SHARE of it where that is less (the bound is the work's, the GPUs'
# fixed overhead left out: from 1 s on, SEARCH_TOLERANCE rules; under 0.1 s, 1%). A further start
# costs about that much host time: at 2 GPUs and 9 sequences a whole auto solve took 3.1 ms against
# refine's 1.0 (1.7 ms with the floor), and no plan of a run's 32 gained 1% on its first start. On
# CPU ranks that time is taken from training: in bench train on 2 cores auto's ranks computed the
# same tokens 2.6-2.9% slower than knapformer's (two batches; with the floor 0.5% and 2.7%).
SEARCH_FLOOR_S = 1e-3
SEARCH_FLOOR_SHARE = 1e-2
# Swaps pair at most this many of the busiest load's sequences with about as many partners: a useful
# swap trades costs that differ by about half the load gap, so a sample spread evenly by cost will do.
SWAP_ITEMS = 64
# Two-step chains start from this many of the busiest load's costliest sequences (each try costs a
# full step search).
CHAIN_STARTS = 4
# Steps with at most this many sequences (the elastic solver does not count short ones) are finished
# by a branch and bound (the elastic solver's stops where elastic_good_enough says): few
# sequences per GPU is where one bad placement costs the most.
EXACT_MAX_SEQUENCES = 16
# Node budgets of the two exact searches: each bounds a small step's search time. A node of the
# elastic search prices every GPU of a group, keys the state by its mirror images and sorts its
# options: about 4x a fixed search's node (9 against 2 us, small steps at 8 GPUs, 2-core CPU), so its
# 2,000 nodes take up to ~20 ms where the fixed search's 20,000 take ~40 ms. It needs fewer: it
# completes a branch of short sequences on single GPUs instead of branching on them.
FIXED_EXACT_NODE_BUDGET = 20_000
ELASTIC_EXACT_NODE_BUDGET = 2_000


def good_enough(lower_bound: int, tolerance: float) -> int:
    """The max load a search may stop at: within ``tolerance`` of ``lower_bound``, in its integer units."""
    return lower_bound + int(lower_bound * tolerance)


def elastic_good_enough(problem: Problem) -> int:
    """The max load the elastic planner's starts and branch and bound stop at: within
    ``SEARCH_TOLERANCE`` of the lower bound, or if more, within ``SEARCH_FLOOR_S`` seconds of it or
    ``SEARCH_FLOOR_SHARE`` of it, whichever is less (so bounds of 1 s or more keep
    ``SEARCH_TOLERANCE``, bounds under 0.1 s stop within 1%; the bound is the work's, without the
    GPUs' fixed overhead). In the problem's integer units."""
    lower_bound, unit_s = problem.lower_bound, problem.seconds_per_unit
    floor = min(int(SEARCH_FLOOR_S / unit_s), int(lower_bound * SEARCH_FLOOR_SHARE)) if unit_s > 0 else 0
    return max(good_enough(lower_bound, SEARCH_TOLERANCE), lower_bound + floor)


def local_search(
    loads: np.ndarray,
    lower_bound: int,
    steps: int,
    improve: Callable[[int, int], list[tuple[int, int]] | None],
    apply: Callable[[list[tuple[int, int]]], None],
    window: int,
    stall_tolerance: float,
) -> None:
    """Lower ``loads.max()`` step by step, in place, for at most ``steps`` steps.

    A step takes the busiest entry of ``loads`` (``[B]`` bags or ``[S]`` GPUs, which ``apply``
    updates in place; the lowest index among equals) and asks ``improve(index, load)`` for moves
    ``[(sequence, to), ...]`` that leave every load they touch below that load, then applies them.
    The sorted loads thus fall lexicographically: no cycles, and the max never rises. Stops when
    ``improve`` finds nothing, once the max is within ``SEARCH_TOLERANCE`` of ``lower_bound``, or
    when ``window`` steps in a row cut the max by at most ``stall_tolerance`` of it (each step
    lowers one busiest load: stalled on small lexicographic gains).
    """
    stop_at = good_enough(lower_bound, SEARCH_TOLERANCE)
    window_start_max = 0
    for step in range(steps):
        busiest = int(np.argmax(loads))
        top = int(loads[busiest])
        if top <= stop_at:
            return
        if step % window == 0:
            if step and window_start_max - top <= int(window_start_max * stall_tolerance):
                return
            window_start_max = top
        moves = improve(busiest, top)
        if moves is None:
            return
        apply(moves)


class BranchAndBound:
    """Depth-first branch and bound over the placements of ``N`` sequences, one at a time in
    ``order`` (``[N]`` sequence ids), within ``node_budget`` nodes, against an incumbent whose max
    load is ``incumbent_max`` (``BIG``: none yet), stopping at an incumbent of max load ``stop_at``
    or less (:func:`good_enough`; the lower bound: exact within the budget).

    A subclass says what a placement is: :meth:`branches` places the ``k``-th sequence of the order
    in turn in every place worth trying (each below the incumbent), and undoes it. This class keeps
    the incumbent, counts nodes, and ends a branch

    * at a leaf, which becomes the incumbent (each placement on its way stayed below it);
    * at the node budget, or once the incumbent's max load is ``stop_at`` or less;
    * when even the cheapest GPU-seconds of the sequences left, spread over all ``S`` GPUs, cannot
      get under the incumbent;
    * where the subclass's :meth:`completes` or :meth:`cuts` says so.

    At most ``stop_at`` above the optimum when the budget suffices.
    """

    def __init__(self, problem: Problem, order: np.ndarray, incumbent_max: int, node_budget: int, stop_at: int):
        self.problem, self.order, self.node_budget = problem, order, node_budget
        self.num_gpus = problem.num_gpus  # read at every node
        self.stop_at = stop_at
        cheapest = np.where(problem.allowed, problem.gpu_seconds, BIG).min(axis=1)[order]
        # [N + 1] the least GPU-seconds of the sequences from the k-th of the order on.
        self.gpu_seconds_left = np.concatenate([np.cumsum(cheapest[::-1])[::-1], [0]]).tolist()
        self.best_max, self.best_assign = incumbent_max, None
        self.assign = [0] * len(order)  # the place of each sequence of the order, on the current branch
        self.nodes = 0

    def solve(self, start_max: int, start_gpu_seconds: int) -> np.ndarray | None:
        """``[N]`` the place of every sequence in the best assignment found, or ``None`` if none beat
        the incumbent. ``start_max`` and ``start_gpu_seconds``: the max load and the GPU-seconds
        placed before any sequence."""
        self._search(0, start_max, start_gpu_seconds)
        if self.best_assign is None:
            return None
        placed = np.empty(len(self.assign), dtype=np.int64)
        placed[self.order] = self.best_assign
        return placed

    def _search(self, k: int, current_max: int, used: int) -> None:
        if k == len(self.order):
            self.best_max, self.best_assign = current_max, list(self.assign)
            return
        if self.completes(k, current_max):
            return
        if self.nodes >= self.node_budget or self.best_max <= self.stop_at:
            return
        if -(-(used + self.gpu_seconds_left[k]) // self.num_gpus) >= self.best_max or self.cuts(k):
            return
        for place, new_max, gpu_seconds in self.branches(k, current_max):
            self.nodes += 1
            self.assign[k] = place
            self._search(k + 1, new_max, used + gpu_seconds)

    def branches(self, k: int, current_max: int) -> Iterator[tuple[int, int, int]]:
        """Place the ``k``-th sequence of the order in each place worth trying, in turn, yielding
        ``(place, max load so far, GPU-seconds it adds)`` while it is there; the incumbent may fall
        between two."""
        raise NotImplementedError

    def completes(self, k: int, current_max: int) -> bool:
        """Whether the branch needs no further search: the subclass may complete it cheaply (and
        update the incumbent). None does here."""
        return False

    def cuts(self, k: int) -> bool:
        """Whether a bound of the subclass's shows the branch cannot beat the incumbent. None does here."""
        return False
