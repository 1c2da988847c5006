"""Solvers over a fixed topology's bags: the finish-time greedy, the ``knapformer`` greedy, first fit
decreasing, and ``refine`` (the best start, local search, exact search for small steps; the loop of
the one and the driver of the other are :mod:`~deepspeed_knap.planner.search`'s).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator

import numpy as np

from deepspeed_knap.planner.problem import _COST_UNITS, Problem
from deepspeed_knap.planner.search import (
    BIG,
    CHAIN_STARTS,
    EXACT_MAX_SEQUENCES,
    FIXED_EXACT_NODE_BUDGET,
    SEARCH_TOLERANCE,
    STALL_WINDOW,
    SWAP_ITEMS,
    BranchAndBound,
    good_enough,
    local_search,
)

# Bags of a class are interchangeable for a move, so only the lightest few of each class are tried
# (more than one: under a memory cap the lightest may lack room).
MOVE_TARGETS_PER_CLASS = 4


# ----------------------------------------------------------------------------------------------------
# Greedy constructions.


class _BagHeaps:
    """For every bag class, a heap of ``(load, bag id)``: the lightest bag of a class in O(1).

    With a token ``cap``, :meth:`lightest` sets aside bags without room for ``need`` more tokens;
    :meth:`add` charges the bag that ``lightest`` last returned for that class and puts the set-aside
    bags back.
    """

    def __init__(self, bags_by_class: list[list[int]], cap: int | None = None,
                 start_load: np.ndarray | None = None, start_tokens: np.ndarray | None = None):  # fmt: skip
        loads = [0] * sum(len(bags) for bags in bags_by_class) if start_load is None else start_load.tolist()
        self.heaps = [sorted((loads[bag], bag) for bag in bags) for bags in bags_by_class]  # sorted: valid heaps
        self.cap = cap
        self.bag_tokens = [0] * len(loads) if start_tokens is None else start_tokens.tolist()
        self.set_aside: list[tuple[int, tuple[int, int]]] = []

    def lightest(self, c: int, need: int = 0) -> tuple[int, int] | None:
        heap = self.heaps[c]
        while self.cap is not None and heap and self.bag_tokens[heap[0][1]] + need > self.cap:
            self.set_aside.append((c, heapq.heappop(heap)))
        return heap[0] if heap else None

    def add(self, c: int, amount: int, need: int = 0) -> int:
        load, bag = self.heaps[c][0]
        heapq.heapreplace(self.heaps[c], (load + amount, bag))
        self.bag_tokens[bag] += need
        if self.set_aside:
            for c_aside, entry in self.set_aside:
                heapq.heappush(self.heaps[c_aside], entry)
            self.set_aside.clear()
        return bag


def _finish_time_greedy(problem: Problem) -> np.ndarray | None:
    """``[N]`` bag of each sequence: largest first, each to the bag where it would finish earliest.

    The price of a bag includes the Ulysses all-to-all, so a short sequence is not split over a big
    bag for nothing; ties go to the option using fewer GPU-seconds, then the lower bag id. Returns
    ``None`` if the memory cap leaves some sequence without room.
    """
    n = len(problem.seq_lens)
    order = np.lexsort((np.arange(n), -problem.cost.min(axis=1)))
    heaps = _BagHeaps(problem.bags_by_class(), problem.cap, problem.start_load, problem.start_tokens)
    placed = []
    cost_rows = problem.cost[order].tolist()
    gpu_seconds = problem.gpu_seconds[order].tolist()
    # Without a cap, and with every class allowed, a bag needs no check (otherwise the last loop).
    unchecked = problem.cap is None and not problem.barred_within_cap
    if unchecked and len(problem.class_size) == 1:  # one class: always its lightest bag
        heap = heaps.heaps[0]
        for cost in problem.cost[order, 0].tolist():
            load, bag = heap[0]
            heapq.heapreplace(heap, (load + cost, bag))
            placed.append(bag)
    elif unchecked:  # the common case, kept tight (heap access inlined)
        class_heaps = heaps.heaps
        for costs, gpu_s in zip(cost_rows, gpu_seconds, strict=True):
            best_finish, best_c, best_bag = -1, 0, -1
            for c, cost in enumerate(costs):
                load, bag = class_heaps[c][0]
                finish = load + cost
                # Same order as the tuple (finish, gpu_s, bag), without building one per class.
                if (
                    best_finish < 0
                    or finish < best_finish
                    or (finish == best_finish and (gpu_s[c], bag) < (gpu_s[best_c], best_bag))
                ):
                    best_finish, best_c, best_bag = finish, c, bag
            heapq.heapreplace(class_heaps[best_c], (best_finish, best_bag))
            placed.append(best_bag)
    else:
        for costs, gpu_s, allowed, needs in zip(
            cost_rows, gpu_seconds, problem.allowed[order].tolist(), problem.tokens[order].tolist(), strict=True
        ):
            best = None
            for c, cost in enumerate(costs):
                top = heaps.lightest(c, needs[c]) if allowed[c] else None
                if top is not None:
                    key = (top[0] + cost, gpu_s[c], top[1], c)
                    if best is None or key < best:
                        best = key
            if best is None:
                return None
            c = best[3]
            placed.append(heaps.add(c, costs[c], needs[c]))
    bag_of_seq = np.empty(n, dtype=np.int64)
    bag_of_seq[order] = placed
    return bag_of_seq


def _knapformer_greedy(problem: Problem) -> np.ndarray:
    """``[N]`` bag of each sequence by the KnapFormer greedy, as published.

    Workload ``w = a*s + b*s**2`` (no communication, no speeds); sequences by ``w`` descending; a bag's
    capacity is the mean per-GPU workload times its size ``G``; candidate bags have capacity ``>= w``
    and ``G <= s``, else all bags of the largest ``G``; the candidate with the lowest occupancy (used
    over capacity) wins, ties to the lower bag id. Exact integer arithmetic throughout.
    """
    n = len(problem.seq_lens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # At G=1 there is no all-to-all term; attention priced by segment where the problem has them.
    w_s = problem.cost_model.per_gpu_time(problem.seq_lens, 1, 1.0, problem.segment_squares)
    w = np.rint(w_s * (_COST_UNITS / w_s.max())).astype(np.int64)
    sizes = np.unique(problem.bag_size)
    heaps = _BagHeaps([np.flatnonzero(problem.bag_size == g).tolist() for g in sizes])
    # Candidates depend only on the sequence: capacity_G >= w  <=>  total * G >= w * S.
    candidate = (sizes[None, :] <= problem.seq_lens[:, None]) & (
        int(w.sum()) * sizes[None, :] >= w[:, None] * int(problem.bag_size.sum())
    )
    candidate[~candidate.any(axis=1), -1] = True
    order = np.lexsort((np.arange(n), -w))
    # Heaps hold used * (L / G), L the lcm of the sizes: occupancy used / (mean * G) compares exactly
    # as a plain integer across classes.
    scale = [math.lcm(*sizes.tolist()) // g for g in sizes.tolist()]
    class_heaps = heaps.heaps
    placed = []
    # Sequences that may use every class take the lowest occupancy over all bags: one heap serves.
    # They form a suffix of the order in practice (restricted ones are the largest, or shorter than
    # a bag), so the per-class scan runs up to the last restricted sequence only.
    candidate = candidate[order]
    restricted = np.flatnonzero(~candidate.all(axis=1))
    split = int(restricted[-1]) + 1 if restricted.size else 0
    amounts = w[order].tolist()
    for amount, candidates in zip(amounts[:split], candidate[:split].tolist(), strict=True):
        best_k, best_occupancy, best_bag = -1, 0, -1
        for k, ok in enumerate(candidates):
            if ok:
                occupancy, bag = class_heaps[k][0]
                if best_k < 0 or occupancy < best_occupancy or (occupancy == best_occupancy and bag < best_bag):
                    best_occupancy, best_bag, best_k = occupancy, bag, k
        heapq.heapreplace(class_heaps[best_k], (best_occupancy + amount * scale[best_k], best_bag))
        placed.append(best_bag)
    all_bags = [entry for heap in class_heaps for entry in heap]
    heapq.heapify(all_bags)
    bag_scale = [scale[k] for k in np.searchsorted(sizes, problem.bag_size).tolist()]
    for amount in amounts[split:]:
        occupancy, bag = all_bags[0]
        heapq.heapreplace(all_bags, (occupancy + amount * bag_scale[bag], bag))
        placed.append(bag)
    bag_of_seq = np.empty(n, dtype=np.int64)
    bag_of_seq[order] = placed
    return bag_of_seq


def _first_fit_decreasing(problem: Problem) -> np.ndarray | None:
    """``[N]`` bag of each sequence packed for the memory cap alone, or ``None`` if it fails.

    Bin packing's first-fit decreasing: sequences by the tokens they need (their smallest per-GPU
    share) descending, each to the lowest-id bag with room. Load balance is left to local search.
    Used only when the cap (or :attr:`Problem.allowed`) defeats every load-driven start.
    """
    # Without a cap only allowed matters (groups of whole nodes): room is endless.
    room = np.full(problem.num_bags, BIG) if problem.cap is None else problem.cap - problem.start_tokens
    need = problem.tokens[:, problem.bag_class]  # [N, B] tokens on the busiest GPU of each bag
    bag_of_seq = np.empty(len(problem.seq_lens), dtype=np.int64)
    for i in np.lexsort((np.arange(len(problem.seq_lens)), -problem.tokens.min(axis=1))).tolist():
        fits = np.flatnonzero((need[i] <= room) & problem.allowed[i, problem.bag_class])
        if fits.size == 0:
            return None
        bag_of_seq[i] = fits[0]
        room[fits[0]] -= need[i, fits[0]]
    return bag_of_seq


# ----------------------------------------------------------------------------------------------------
# Our solver: best start, local search, locality.


def _refine(problem: Problem, steps: int, tolerance: float = 0.0) -> np.ndarray | None:
    """``[N]`` bag of each sequence (see the module docstring), or ``None`` if none found fits the cap.
    ``tolerance``: the exact search stops within it of the lower bound (the elastic planner's stages:
    ``SEARCH_TOLERANCE``; a fixed topology's own plan: 0, exact within the budget)."""
    if len(problem.seq_lens) == 0:
        return np.zeros(0, dtype=np.int64)
    starts = [problem.home_bag, _finish_time_greedy(problem)]
    # The published greedy knows nothing of work placed beforehand: not a start for the elastic
    # planner's stages (their base tokens are set), but it is for a fixed topology, overheads or not
    # (refine is never worse than knapformer).
    if problem.base_tokens is None:
        starts.append(_knapformer_greedy(problem))
    feasible = [s for s in starts if s is not None and problem.fits_cap(s)]
    if not feasible:  # only under a tight cap: fall back to bin packing, then to the exact search
        packed = _first_fit_decreasing(problem)
        if packed is None and len(problem.seq_lens) <= EXACT_MAX_SEQUENCES:
            packed = _exact_search(problem, None, tolerance)
        feasible = [packed] if packed is not None else []
    if not feasible:
        return None
    # min() keeps the first of equal loads: the home-bag start, which moves the fewest tokens.
    bag_of_seq = min(feasible, key=lambda s: int(problem.bag_loads(s).max())).copy()
    _local_search(problem, bag_of_seq, steps)
    if len(bag_of_seq) <= EXACT_MAX_SEQUENCES:
        bag_of_seq = _exact_search(problem, bag_of_seq, tolerance)
    return _keep_tokens_home(problem, bag_of_seq)


def _exact_search(problem: Problem, incumbent: np.ndarray | None, tolerance: float = 0.0) -> np.ndarray | None:
    """The best assignment branch and bound finds within ``FIXED_EXACT_NODE_BUDGET`` nodes (it stops at
    one within ``tolerance`` of the lower bound), or
    ``incumbent`` (with none: any assignment that fits the memory cap, and the best of those, or
    ``None``).

    Sequences go in descending order of their cheapest cost (over every class, allowed or not); of
    several empty bags of one class only the first is tried (they are interchangeable). Besides the cuts of :class:`BranchAndBound`, a
    branch is cut when a bag reaches the incumbent's max load or the memory cap.
    """
    incumbent_max = BIG if incumbent is None else int(problem.bag_loads(incumbent).max())
    found = _BagSearch(problem, incumbent_max, tolerance).solve(
        int(problem.start_load.max()), int((problem.start_load * problem.bag_size).sum())
    )
    return incumbent if found is None else found


class _BagSearch(BranchAndBound):
    """The branch and bound of :func:`_exact_search`: a place is a bag, whose load and tokens are
    lists here (read one entry at a time)."""

    def __init__(self, problem: Problem, incumbent_max: int, tolerance: float = 0.0):
        n = len(problem.seq_lens)
        order = np.lexsort((np.arange(n), -problem.cost.min(axis=1)))
        super().__init__(problem, order, incumbent_max, FIXED_EXACT_NODE_BUDGET,
                         good_enough(problem.lower_bound, tolerance))  # fmt: skip
        # [N, C] per sequence of the order: its cost, whether it is allowed, and its tokens per class.
        self.cost, self.allowed, self.need = (problem.cost[order].tolist(), problem.allowed[order].tolist(),
                                              problem.tokens[order].tolist())  # fmt: skip
        self.bag_class, self.class_size = problem.bag_class.tolist(), problem.class_size.tolist()
        self.interchangeable = problem.interchangeable.tolist()
        # [B] each bag's load, tokens and sequences on the current branch.
        self.loads, self.tokens = problem.start_load.tolist(), problem.start_tokens.tolist()
        self.counts = [0] * problem.num_bags

    def branches(self, k: int, current_max: int) -> Iterator[tuple[int, int, int]]:
        loads, tokens, counts, cap = self.loads, self.tokens, self.counts, self.problem.cap
        cost, allowed, need = self.cost[k], self.allowed[k], self.need[k]
        bag_class, class_size, interchangeable = self.bag_class, self.class_size, self.interchangeable
        empty_classes_tried = set()
        for b in range(len(loads)):
            c = bag_class[b]
            if counts[b] == 0:  # empty bags that are interchangeable: trying one is enough
                if interchangeable[b] in empty_classes_tried:
                    continue
                empty_classes_tried.add(interchangeable[b])
            new_load = loads[b] + cost[c]
            if not allowed[c] or new_load >= self.best_max or (cap is not None and tokens[b] + need[c] > cap):
                continue
            loads[b], tokens[b], counts[b] = new_load, tokens[b] + need[c], counts[b] + 1
            yield b, max(current_max, new_load), class_size[c] * cost[c]
            loads[b], tokens[b], counts[b] = loads[b] - cost[c], tokens[b] - need[c], counts[b] - 1


def _local_search(problem: Problem, bag_of_seq: np.ndarray, steps: int) -> None:
    """Lower the busiest bag's load by moves, swaps and two-step chains, in place, for <= ``steps``
    steps, by :func:`~deepspeed_knap.planner.search.local_search` (which says when it stops; here the
    stall window is ``min(B, STALL_WINDOW)`` steps).

    A step takes the busiest bag ``A`` (lowest id among equals) and applies the best of: moving one of
    its sequences to a light bag of any class, or swapping one with a sequence of the least-loaded bags
    (up to ``SWAP_ITEMS`` of them), judged by the larger of the new loads. When neither helps, a
    chain: move a sequence of ``A`` into a bag ``B`` even if that overloads ``B``, then the best move or
    swap out of ``B`` (never back into ``A``). A step is applied only if every load it touches ends
    below ``A``'s load.
    """
    state = _Assignment(problem, bag_of_seq)

    def improve(a: int, load_a: int) -> list[tuple[int, int]] | None:
        found = state.best_step(a, load_a, exclude=(a,)) or state.best_chain(a, load_a)
        return None if found is None else found[1]

    local_search(state.loads, problem.lower_bound, steps, improve, state.apply, min(problem.num_bags, STALL_WINDOW),
                 SEARCH_TOLERANCE)  # fmt: skip


class _Assignment:
    """A mutable assignment of sequences to bags with its loads, for local search.

    ``bag_of_seq`` is updated in place; ``loads`` (quantised) and ``bag_tokens`` (tokens on each
    bag's busiest GPU) follow every move.
    """

    def __init__(self, problem: Problem, bag_of_seq: np.ndarray):
        self.problem = problem
        self.bag_of_seq = bag_of_seq
        self.loads = problem.bag_loads(bag_of_seq)
        self.bag_tokens = problem.bag_tokens(bag_of_seq)
        # Each bag's sequences in ascending order (a stable sort by bag), without a Python loop over N.
        by_bag = np.argsort(bag_of_seq, kind="stable")
        bounds = np.searchsorted(bag_of_seq[by_bag], np.arange(problem.num_bags + 1)).tolist()
        by_bag = by_bag.tolist()
        self.members: list[list[int]] = [by_bag[lo:hi] for lo, hi in itertools.pairwise(bounds)]
        self.class_first = np.concatenate([[0], np.cumsum(problem.class_count)[:-1]]).tolist()

    def move(self, i: int, to_bag: int) -> None:
        problem, from_bag = self.problem, int(self.bag_of_seq[i])
        c_from, c_to = problem.bag_class[from_bag], problem.bag_class[to_bag]
        self.loads[from_bag] -= problem.cost[i, c_from]
        self.loads[to_bag] += problem.cost[i, c_to]
        self.bag_tokens[from_bag] -= problem.tokens[i, c_from]
        self.bag_tokens[to_bag] += problem.tokens[i, c_to]
        self.members[from_bag].remove(i)
        self.members[to_bag].append(i)
        self.bag_of_seq[i] = to_bag

    def apply(self, moves: list[tuple[int, int]]) -> None:
        """:meth:`move` each ``(sequence, to_bag)`` of ``moves``, in order."""
        for i, to_bag in moves:
            self.move(i, to_bag)

    def best_step(self, a: int, limit: int, exclude: tuple[int, ...]) -> tuple[int, list[tuple[int, int]]] | None:
        """Best move or swap of a sequence of bag ``a`` with bags not in ``exclude``.

        Returns ``(score, [(sequence, to_bag), ...])`` when its score (the largest load it leaves on
        the bags it touches) is below ``limit``, else ``None``.
        """
        problem, loads, bag_tokens = self.problem, self.loads, self.bag_tokens
        bag_class, cost, tokens, cap, big = problem.bag_class, problem.cost, problem.tokens, problem.cap, BIG
        if not self.members[a]:
            return None
        items = np.asarray(self.members[a])
        class_a = bag_class[a]
        left_a = loads[a] - cost[items, class_a]  # [k] load of a once the item leaves

        # Moves: item k of a to a target bag; bags of a class are interchangeable, so the lightest few.
        by_class_then_load = np.lexsort((loads, bag_class))
        targets = np.concatenate(
            [by_class_then_load[first : first + MOVE_TARGETS_PER_CLASS + len(exclude)] for first in self.class_first]
        )
        keep = targets != exclude[0]  # one or two bags: comparisons cost a tenth of np.isin here
        for bag in exclude[1:]:
            keep &= targets != bag
        targets = targets[keep]
        move_score = np.maximum(loads[targets][None, :] + cost[items][:, bag_class[targets]], left_a[:, None])  # [k, M]
        if cap is not None:
            move_score[bag_tokens[targets][None, :] + tokens[items][:, bag_class[targets]] > cap] = big
        if problem.barred_within_cap:
            move_score[~problem.allowed[items][:, bag_class[targets]]] = big
        best = None
        if targets.size:
            flat = int(np.argmin(move_score))
            k, t = divmod(flat, len(targets))
            best = (int(move_score.flat[flat]), [(int(items[k]), int(targets[t]))])

        # Swaps: an item of a with sequence j of a light partner bag, for a sample of a's items spread
        # evenly by cost (float positions, rounded down: elastic's integer ones differ for some
        # lengths, and so would plans).
        swap_items = items
        if len(items) > SWAP_ITEMS:
            by_cost = np.argsort(cost[items, class_a], kind="stable")
            swap_items = items[by_cost[np.linspace(0, len(items) - 1, SWAP_ITEMS).astype(np.int64)]]
        js = []
        for b in np.argsort(loads, kind="stable")[: SWAP_ITEMS + len(exclude)].tolist():
            if len(js) >= SWAP_ITEMS:
                break
            if b not in exclude:
                js.extend(self.members[b])
        if js:
            js = np.asarray(js, dtype=np.int64)
            bag_j = self.bag_of_seq[js]
            class_b = bag_class[bag_j]
            new_a = (loads[a] - cost[swap_items, class_a])[:, None] + cost[js, class_a][None, :]  # [k', J]
            new_b = (loads[bag_j] - cost[js, class_b])[None, :] + cost[swap_items][:, class_b]
            swap_score = np.maximum(new_a, new_b)
            if cap is not None:
                over_a = bag_tokens[a] - tokens[swap_items, class_a][:, None] + tokens[js, class_a][None, :] > cap
                over_b = (bag_tokens[bag_j] - tokens[js, class_b])[None, :] + tokens[swap_items][:, class_b] > cap
                swap_score[over_a | over_b] = big
            if problem.barred_within_cap:
                allowed = problem.allowed
                swap_score[~allowed[js, class_a][None, :] | ~allowed[swap_items][:, class_b]] = big
            flat = int(np.argmin(swap_score))
            if best is None or swap_score.flat[flat] < best[0]:
                k, jj = divmod(flat, len(js))
                i, j = int(swap_items[k]), int(js[jj])
                best = (int(swap_score.flat[flat]), [(i, int(bag_j[jj])), (j, a)])
        return best if best is not None and best[0] < limit else None

    def best_chain(self, a: int, limit: int) -> tuple[int, list[tuple[int, int]]] | None:
        """First two-step chain out of bag ``a`` that leaves every touched load below ``limit``.

        For each of the ``CHAIN_STARTS`` largest sequences of ``a`` and each class's lightest other bag ``B``: move the
        sequence into ``B``, then look for the best step out of ``B`` that avoids ``a`` and ``B``.
        Tentative moves are undone; the chain is returned, not applied.
        """
        problem = self.problem
        items = sorted(self.members[a], key=lambda i: (-int(problem.cost[i, problem.bag_class[a]]), i))[:CHAIN_STARTS]
        by_class_then_load = np.lexsort((self.loads, problem.bag_class)).tolist()
        lightest = []  # the lightest bag other than a of each class
        for first, count in zip(self.class_first, problem.class_count.tolist(), strict=True):
            lightest += [b for b in by_class_then_load[first : first + count] if b != a][:1]
        for i in items:
            for b in lightest:
                if not problem.allowed[i, problem.bag_class[b]] or (
                    problem.cap is not None
                    and self.bag_tokens[b] + problem.tokens[i, problem.bag_class[b]] > problem.cap
                ):
                    continue
                self.move(i, b)
                follow = self.best_step(b, limit, exclude=(a, b)) if self.loads[a] < limit else None
                self.move(i, a)
                if follow is not None:
                    return follow[0], [(i, b), *follow[1]]
        return None


def _keep_tokens_home(problem: Problem, bag_of_seq: np.ndarray) -> np.ndarray:
    """Permute whole bag contents among identical bags (same size, speed, base load and base tokens)
    to keep tokens home.

    Loads are unchanged, so the max load is too. A sequence whose contents land in the bag holding its
    home rank keeps the chunk that rank gets. Matching contents to bags is an assignment problem;
    exact solvers cost ~25 ms at 1,024 bags, so contents and bags are matched greedily by kept tokens
    (heaviest pair first, ties by ids), and the identity is kept if it keeps more.
    """
    num_bags, home_bag = problem.num_bags, problem.home_bag
    size = problem.bag_size[home_bag]
    position = problem.src - problem.bag_first[home_bag]
    kept = np.where(problem.home_covered, problem.seq_lens // size + (position < problem.seq_lens % size), 0)
    same_class = problem.interchangeable[home_bag] == problem.interchangeable[bag_of_seq]
    pair_key, inverse = np.unique(bag_of_seq[same_class] * num_bags + home_bag[same_class], return_inverse=True)
    pair_kept = np.bincount(inverse.ravel(), weights=kept[same_class]).astype(np.int64)

    by_weight = np.lexsort((pair_key, -pair_kept))
    content_to_bag = [-1] * num_bags
    bag_taken = [False] * num_bags
    matched = 0
    for content, bag, weight in zip(
        (pair_key[by_weight] // num_bags).tolist(),
        (pair_key[by_weight] % num_bags).tolist(),
        pair_kept[by_weight].tolist(),
        strict=True,
    ):
        if content_to_bag[content] < 0 and not bag_taken[bag]:
            content_to_bag[content], bag_taken[bag] = bag, True
            matched += weight
    kept_identity = int(pair_kept[pair_key // num_bags == pair_key % num_bags].sum())
    if matched <= kept_identity:
        return bag_of_seq
    content_to_bag, bag_taken = np.asarray(content_to_bag), np.asarray(bag_taken)
    # The unmatched contents of each class take its free bags, both in id order (a class has as many
    # of one as of the other): sorted by class, stably, the two lists line up.
    unmatched, free = np.flatnonzero(content_to_bag < 0), np.flatnonzero(~bag_taken)
    unmatched = unmatched[np.argsort(problem.interchangeable[unmatched], kind="stable")]
    content_to_bag[unmatched] = free[np.argsort(problem.interchangeable[free], kind="stable")]
    return content_to_bag[bag_of_seq]
