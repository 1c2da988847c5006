"""The elastic planner behind topology ``auto``: every sequence gets its own Ulysses degree and group.

Pure NumPy and Python, called by :func:`~deepspeed_knap.planner.plan_routing` on the same quantised
problem as the fixed-topology solvers, whose "bags" are here every aligned group of every size
(:attr:`~deepspeed_knap.topology.Topology.groups`): groups of one size are disjoint, groups of
different sizes are nested or disjoint. A GPU's load is the sum of the costs of the sequences of every
group it is in; the step time is the busiest GPU's load.

Dimension names: ``S`` GPUs, ``N`` sequences, ``B`` groups (all sizes), ``C`` group classes (equal size
and speed), ``V`` levels (distinct group sizes, largest first).

The solver:

1. **Degrees from the bound.** Splitting a sequence over ``G`` GPUs never saves GPU-seconds
   (``G * t(s, G)`` grows with ``G`` once the all-to-all costs anything), it only shortens the
   sequence. So for the lower bound ``T`` each sequence takes the size of its cheapest group class
   (in GPU-seconds) whose per-GPU cost fits ``T``: short sequences stay whole, long ones are split
   just enough.
2. **Packing, largest groups first.** Every group placed before a level is at least as large and
   aligned, so it covers whole groups of the level: within a level every group has one load, and
   packing the level is scheduling on identical machines (related ones with ``gpu_speed``). First
   each sequence stays in the group of its home GPU if that finishes within ``T`` (largest first, so
   the most tokens stay home); the rest go largest first to the group that finishes earliest.
3. **Local search** on GPU loads: move one sequence touching the busiest GPU to the group of any size
   that finishes earliest, or swap it with a sequence of a light group, while every load it touches
   ends below the current maximum (so the sorted load vector falls lexicographically: no cycles, and
   the step time never rises).
4. **Exact search** for steps of at most ``EXACT_MAX_SEQUENCES`` sequences: branch and bound over
   every group, within a node budget.

All arithmetic is on the problem's int64 costs, and ties break by ids, so plans are bit-identical on
every rank.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from deepspeed_knap.planner import _Problem

# Packing starts: split sequences until their per-GPU cost is at most this fraction of the bound.
PIECE_FRACTIONS = (1.0, 0.5, 0.25, 0.125)
EXACT_MAX_SEQUENCES = 12
EXACT_NODE_BUDGET = 20_000
# Local search: stop within this fraction of the bound, or when a window of steps cut the max by
# less than it (the step budget is plan_routing's refine_steps).
SEARCH_STEPS = 256
SEARCH_TOLERANCE = 1e-3
# Starts whose packed step time is this much above the best searched one are not searched.
SEARCH_SLACK = 0.08
STALL_WINDOW = 32
# Per local-search step: destinations tried per class (its lightest groups), groups per level whose
# sequences are swap partners, and swaps checked against the cap.
TARGETS_PER_CLASS = 4
SWAP_GROUPS_PER_LEVEL = 16
SWAP_ITEMS = 64
SWAP_TRIES = 32
# Two-step chains start from this many of the busiest GPU's costliest sequences.
CHAIN_STARTS = 4

_BIG = np.iinfo(np.int64).max


@dataclass(frozen=True, eq=False)
class _Levels:
    """The groups of the problem by size.

    Attributes:
        sizes: ``[V]`` group sizes, descending.
        group_ids: per level, ``[n_v]`` ids (into the problem's groups) ascending by first GPU.
        gpus: per level, ``[n_v, G_v]`` the GPUs of each group.
        group_at: per level, ``[S]`` the id of the level's group holding each GPU (-1: none).
        level_of_class: ``[C]`` level of each class.
        level_of_group, position_of_group: ``[B]`` each group's level and index in the level's arrays.
        block_of_gpu: ``[S]`` the top-level group (bag of the topology) holding each GPU.
        groups_in_block: per group id of a top-level group, ``[K]`` the ids of the groups inside it, ascending.
    """

    sizes: list[int]
    group_ids: list[np.ndarray]
    gpus: list[np.ndarray]
    group_at: list[np.ndarray]
    level_of_class: np.ndarray
    level_of_group: np.ndarray
    position_of_group: np.ndarray
    block_of_gpu: np.ndarray
    groups_in_block: dict[int, np.ndarray]

    @classmethod
    def build(cls, problem: _Problem) -> _Levels:
        sizes = sorted(set(problem.bag_size.tolist()), reverse=True)
        group_ids, gpus, group_at = [], [], []
        for size in sizes:
            ids = np.flatnonzero(problem.bag_size == size)
            ids = ids[np.argsort(problem.bag_first[ids], kind="stable")]
            members = problem.bag_first[ids][:, None] + np.arange(size)[None, :]
            at = np.full(problem.num_gpus, -1, dtype=np.int64)
            at[members.ravel()] = np.repeat(ids, size)
            group_ids.append(ids)
            gpus.append(members)
            group_at.append(at)
        level_of_class = np.array([sizes.index(int(g)) for g in problem.class_size], dtype=np.int64)
        level_of_group = np.empty(problem.num_bags, dtype=np.int64)
        position_of_group = np.empty(problem.num_bags, dtype=np.int64)
        for level, ids in enumerate(group_ids):
            level_of_group[ids] = level
            position_of_group[ids] = np.arange(len(ids))
        block_of_gpu = np.empty(problem.num_gpus, dtype=np.int64)
        groups_in_block = {}
        index = {(int(f), int(g)): b for b, (f, g) in enumerate(zip(problem.bag_first, problem.bag_size, strict=True))}
        for first, size in zip(problem.topology.bag_first_rank, problem.topology.bag_sizes, strict=True):
            block = index[(first, size)]
            block_of_gpu[first : first + size] = block
            groups_in_block[block] = np.flatnonzero(
                (problem.bag_first >= first) & (problem.bag_first + problem.bag_size <= first + size)
            )
        return cls(sizes, group_ids, gpus, group_at, level_of_class, level_of_group, position_of_group,
                   block_of_gpu, groups_in_block)  # fmt: skip


def chunk_tokens(seq_len: int, size: int) -> np.ndarray:
    """``[size]`` tokens each member of a group gets of a sequence: near-equal, the first ones one more."""
    base, extra = divmod(seq_len, size)
    return base + (np.arange(size) < extra)


class _State:
    """GPU loads and tokens of a (partial) assignment of sequences to groups."""

    def __init__(self, problem: _Problem, levels: _Levels):
        self.problem, self.levels = problem, levels
        self.loads = np.zeros(problem.num_gpus, dtype=np.int64)
        self.tokens = np.zeros(problem.num_gpus, dtype=np.int64)
        self.group_of_seq = np.full(len(problem.seq_lens), -1, dtype=np.int64)
        self.members: list[list[int]] = [[] for _ in range(problem.num_bags)]

    def cost(self, i: int, group: int) -> int:
        return int(self.problem.cost[i, self.problem.bag_class[group]])

    def span(self, group: int) -> slice:
        first = int(self.problem.bag_first[group])
        return slice(first, first + int(self.problem.bag_size[group]))

    def place(self, i: int, group: int) -> None:
        span = self.span(group)
        self.loads[span] += self.cost(i, group)
        self.tokens[span] += chunk_tokens(int(self.problem.seq_lens[i]), int(self.problem.bag_size[group]))
        self.group_of_seq[i] = group
        self.members[group].append(i)

    def remove(self, i: int) -> None:
        group = int(self.group_of_seq[i])
        span = self.span(group)
        self.loads[span] -= self.cost(i, group)
        self.tokens[span] -= chunk_tokens(int(self.problem.seq_lens[i]), int(self.problem.bag_size[group]))
        self.group_of_seq[i] = -1
        self.members[group].remove(i)

    def apply(self, moves: list[tuple[int, int]]) -> None:
        """Move each ``(sequence, group)`` of ``moves`` (all removed first, then all placed)."""
        for i, _ in moves:
            self.remove(i)
        for i, group in moves:
            self.place(i, group)

    def fits(self, i: int, group: int) -> bool:
        """Whether ``i`` in ``group`` keeps every GPU under the token cap (given the current tokens)."""
        problem = self.problem
        if not problem.allowed[i, problem.bag_class[group]]:
            return False
        if problem.cap is None:
            return True
        chunks = chunk_tokens(int(problem.seq_lens[i]), int(problem.bag_size[group]))
        return bool(np.all(self.tokens[self.span(group)] + chunks <= problem.cap))

    def touching(self, gpu: int) -> list[int]:
        """Sequences whose group holds ``gpu``."""
        found = []
        for at in self.levels.group_at:
            group = int(at[gpu])
            if group >= 0:
                found.extend(self.members[group])
        return found


def solve_elastic(problem: _Problem, steps: int = SEARCH_STEPS) -> np.ndarray | None:
    """``[N]`` group (index into the problem's groups) of every sequence, or ``None`` when no
    assignment found keeps every GPU under the memory cap. ``steps`` bounds each local search."""
    n = len(problem.seq_lens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    levels = _Levels.build(problem)
    candidates, tried = [], set()
    for piece in PIECE_FRACTIONS:
        level_of_seq = _degrees(problem, levels, piece)
        if level_of_seq.tobytes() not in tried:  # the same split as a larger piece gives the same plan
            tried.add(level_of_seq.tobytes())
            candidates.append(_pack_by_level(problem, levels, level_of_seq, steps))
    # The topology's own bags (the largest groups) as a fixed topology: auto is never worse than it.
    candidates.append(_pack_stage(problem, levels, _State(problem, levels), np.arange(n),
                                  np.asarray(sorted(levels.groups_in_block)), steps))  # fmt: skip
    candidates = [state for state in candidates if state is not None]
    if not candidates:
        return None
    # Across sizes: a sequence may change its group size, or trade places with one of another size.
    # Local search rarely gains more than a few percent, so a start that far behind is not searched.
    best = None
    for state in sorted(candidates, key=lambda state: int(state.loads.max())):  # stable: the first of equals
        if best is not None and int(state.loads.max()) > int(best.loads.max()) * (1 + SEARCH_SLACK):
            break
        _local_search(state, steps)
        if best is None or int(state.loads.max()) < int(best.loads.max()):
            best = state
    if n <= EXACT_MAX_SEQUENCES:
        exact = _exact_search(problem, levels, best.group_of_seq, EXACT_NODE_BUDGET)
        best = _State(problem, levels)
        for i, g in enumerate(exact.tolist()):
            best.place(i, g)
    _keep_home(best)
    return best.group_of_seq


def _keep_home(state: _State) -> None:
    """Bring single-GPU sequences back to their home GPU where that keeps the step time ``M`` (the
    busiest GPU's load), in place, largest first: move one home if it fits under ``M`` there, else
    swap it with a sequence on its home GPU that is not from there, if both GPUs stay under ``M``.
    Every step keeps more tokens home and no load above ``M``."""
    problem, levels = state.problem, state.levels
    top = int(state.loads.max())
    single_group = levels.group_at[-1]  # the single-GPU group of every GPU (sizes are descending)
    gpu_class = problem.bag_class[single_group]  # [S]
    cap = problem.cap
    away = [i for i in np.argsort(-problem.seq_lens, kind="stable").tolist()
            if problem.bag_size[state.group_of_seq[i]] == 1 and state.group_of_seq[i] != single_group[problem.src[i]]]  # fmt: skip
    for i in away:
        home, here = int(problem.src[i]), int(problem.bag_first[state.group_of_seq[i]])
        cost_home, cost_here = int(problem.cost[i, gpu_class[home]]), int(problem.cost[i, gpu_class[here]])
        if int(state.loads[home]) + cost_home <= top and state.fits(i, int(single_group[home])):
            state.apply([(i, int(single_group[home]))])
            continue
        guests = np.asarray(
            [j for j in state.members[int(single_group[home])] if problem.src[j] != home], dtype=np.int64
        )
        if guests.size == 0:
            continue
        load_home = int(state.loads[home]) - problem.cost[guests, gpu_class[home]] + cost_home
        load_here = int(state.loads[here]) - cost_here + problem.cost[guests, gpu_class[here]]
        ok = (load_home <= top) & (load_here <= top) & problem.allowed[guests, gpu_class[here]]
        if cap is not None:
            ok &= int(state.tokens[home]) - problem.seq_lens[guests] + problem.seq_lens[i] <= cap
            ok &= int(state.tokens[here]) - problem.seq_lens[i] + problem.seq_lens[guests] <= cap
        if ok.any():
            # A guest whose home is here comes home too; else the first that fits.
            back = ok & (problem.src[guests] == here)
            j = int(guests[int(np.argmax(back if back.any() else ok))])
            state.apply([(i, int(single_group[home])), (j, int(single_group[here]))])


def _pack_by_level(problem: _Problem, levels: _Levels, level_of_seq: np.ndarray, steps: int) -> _State | None:
    """Place every sequence in a group of its level: the split ones largest groups first (see the
    module docstring), then the whole ones on single GPUs with the fixed-topology solver."""
    target = problem.lower_bound
    cost = problem.cost
    state = _State(problem, levels)
    for level, size in enumerate(levels.sizes):
        seqs = np.flatnonzero(level_of_seq == level)
        if seqs.size == 0:
            continue
        if size == 1:
            return _pack_stage(problem, levels, state, seqs, levels.group_ids[level], steps)
        classes = np.flatnonzero(levels.level_of_class == level)
        seqs = seqs[np.lexsort((seqs, -cost[seqs][:, classes].min(axis=1)))]
        # Every group placed so far is larger and aligned: the level's groups have uniform loads.
        group_load = dict(zip(levels.group_ids[level].tolist(), state.loads[levels.gpus[level]].max(axis=1).tolist(),
                              strict=True))  # fmt: skip
        spilled = []
        for i, home in zip(seqs.tolist(), levels.group_at[level][problem.src[seqs]].tolist(), strict=True):
            # Home first: a sequence stays in its home GPU's group when it finishes within T there.
            if home >= 0 and group_load[home] + state.cost(i, home) <= target and state.fits(i, home):
                state.place(i, home)
                group_load[home] += state.cost(i, home)
            else:
                spilled.append(i)
        # The rest, largest first, to the group finishing earliest: a heap of (load, group) per class,
        # whose entries go stale when a load changes (skipped) or lack room under the cap (set aside).
        heaps = {
            c: [(load, g) for g, load in group_load.items() if problem.bag_class[g] == c] for c in classes.tolist()
        }
        for heap in heaps.values():
            heapq.heapify(heap)
        for i in spilled:
            best = None
            for c, heap in heaps.items():
                aside = []
                while heap and (heap[0][0] != group_load[heap[0][1]] or not state.fits(i, heap[0][1])):
                    entry = heapq.heappop(heap)
                    if entry[0] == group_load[entry[1]]:
                        aside.append(entry)
                if heap and problem.allowed[i, c]:
                    load, g = heap[0]
                    key = (load + int(cost[i, c]), int(problem.gpu_seconds[i, c]), g)
                    best = key if best is None or key < best else best
                for entry in aside:
                    heapq.heappush(heap, entry)
            if best is None:
                return None
            group = best[2]
            state.place(i, group)
            group_load[group] += state.cost(i, group)
            heapq.heappush(heaps[int(problem.bag_class[group])], (group_load[group], group))
    return state


def _pack_stage(problem: _Problem, levels: _Levels, state: _State, seqs: np.ndarray, bags: np.ndarray,
                steps: int) -> _State | None:  # fmt: skip
    """Place ``seqs`` in the disjoint groups ``bags`` with the fixed-topology solver (``refine``), on
    top of what ``state`` holds (a bag's load and tokens are its busiest GPU's). ``None`` if the cap
    defeats it."""
    from deepspeed_knap.planner import _refine  # the elastic planner builds on the fixed one

    gpus = [state.span(g) for g in bags.tolist()]
    base_load = np.array([int(state.loads[span].max()) for span in gpus], dtype=np.int64)
    base_tokens = np.array([int(state.tokens[span].max()) for span in gpus], dtype=np.int64)
    bag_of_seq = _refine(problem.tiling_problem(seqs, bags, base_load, base_tokens), steps)
    if bag_of_seq is None:
        return None
    for i, bag in zip(seqs.tolist(), bag_of_seq.tolist(), strict=True):
        state.place(i, int(bags[bag]))
    return state


def _degrees(problem: _Problem, levels: _Levels, piece: float) -> np.ndarray:
    """``[N]`` level of every sequence: split until its per-GPU cost is at most ``piece`` times the
    lower bound ``T`` (or as far as it goes), taking the cheapest GPU-seconds among the classes that
    fit, ties to the smaller group (classes are sorted by size, then speed). With few sequences per
    GPU, smaller pieces pack tighter than the GPU-seconds they add."""
    cost, allowed = problem.cost, problem.allowed
    fits = allowed & (cost <= int(problem.lower_bound * piece))
    cheapest_fit = np.argmin(np.where(fits, problem.gpu_seconds, _BIG), axis=1)
    shortest = np.argmin(np.where(allowed, cost, _BIG), axis=1)
    return levels.level_of_class[np.where(fits.any(axis=1), cheapest_fit, shortest)]


# ----------------------------------------------------------------------------------------------------
# Local search.


def _local_search(state: _State, steps: int = SEARCH_STEPS) -> None:
    """Lower the busiest GPU by moves and swaps, in place (see the module docstring).

    A step takes the busiest GPU (lowest id among equals) and applies the best move or swap of a
    sequence touching it, judged by the largest load it leaves on the GPUs it touches; a step is
    applied only if that is below the current maximum. Stops within ``SEARCH_TOLERANCE`` of the lower
    bound, when no step improves, or when ``STALL_WINDOW`` steps in a row cut the max by less than
    that tolerance.
    """
    problem = state.problem
    good_enough = problem.lower_bound + int(problem.lower_bound * SEARCH_TOLERANCE)
    window_start_max = int(state.loads.max())
    for step in range(steps):
        gpu = int(np.argmax(state.loads))
        top = int(state.loads[gpu])
        if top <= good_enough:
            return
        if step and step % STALL_WINDOW == 0:
            if window_start_max - top <= int(window_start_max * SEARCH_TOLERANCE):
                return
            window_start_max = top
        moves = _best_step(state, gpu, top) or _best_chain(state, gpu, top)
        if moves is None:
            return
        state.apply(moves)


def _best_chain(state: _State, gpu: int, top: int) -> list[tuple[int, int]] | None:
    """First two-step chain out of ``gpu`` that leaves every load it touches below ``top``: move one of
    its ``CHAIN_STARTS`` costliest sequences to the lightest group of a class elsewhere, even if that
    overloads the group, then the best step out of that group's busiest GPU."""
    problem, levels = state.problem, state.levels
    items = [i for i in state.touching(gpu) if state.cost(i, int(state.group_of_seq[i])) > 0]
    items.sort(key=lambda i: (-state.cost(i, int(state.group_of_seq[i])), i))
    block = levels.block_of_gpu[gpu]
    lo, hi = int(problem.bag_first[block]), int(problem.bag_first[block] + problem.bag_size[block])
    lightest = []  # the lightest group outside the block, of every class
    for c in range(len(problem.class_size)):
        level = int(levels.level_of_class[c])
        gpus, ids = levels.gpus[level], levels.group_ids[level]
        usable = ((gpus[:, 0] >= hi) | (gpus[:, -1] < lo)) & (problem.bag_class[ids] == c)
        if usable.any():
            maxima = np.where(usable, state.loads[gpus].max(axis=1), _BIG)
            lightest.append(int(ids[int(np.argmin(maxima))]))
    for i in items[:CHAIN_STARTS]:
        home = int(state.group_of_seq[i])
        for b in lightest:
            if not state.fits(i, b):
                continue
            state.apply([(i, b)])
            gpu_b = state.span(b).start + int(np.argmax(state.loads[state.span(b)]))
            follow = _best_step(state, gpu_b, top) if int(state.loads[gpu]) < top else None
            chain = None
            if follow is not None and all(j != i for j, _ in follow):
                # The follow-up lowers b's busiest GPU; every other GPU b or the follow-up touched
                # must end below top too.
                touched = [state.span(g) for _, g in follow] + [
                    state.span(int(state.group_of_seq[j])) for j, _ in follow
                ]
                undo = [(j, int(state.group_of_seq[j])) for j, _ in follow]
                state.apply(follow)
                if all(int(state.loads[span].max()) < top for span in [state.span(b), *touched]):
                    chain = [(i, b), *follow]
                state.apply(undo)
            state.apply([(i, home)])
            if chain is not None:
                return chain
    return None


def _best_step(state: _State, gpu: int, limit: int) -> list[tuple[int, int]] | None:
    """The best move or swap of a sequence touching ``gpu`` as ``[(sequence, group)]``, or ``None``
    when none leaves every load it touches below ``limit``.

    Every group holding ``gpu`` lies inside one top-level group, the *block* (at most ``max_degree``
    GPUs). Moves inside the block (to a smaller, larger or sibling group) are priced exactly on the
    block's GPUs; moves and swaps out of it go to the lightest groups elsewhere, whose loads only rise
    uniformly.
    """
    problem, levels = state.problem, state.levels
    items = np.asarray(state.touching(gpu), dtype=np.int64)
    if items.size == 0:
        return None
    group_a = state.group_of_seq[items]
    class_a = problem.bag_class[group_a]
    cost_a = problem.cost[items, class_a]
    keep = cost_a > 0  # moving a sequence that costs nothing (quantised) cannot lower the max
    items, group_a, class_a, cost_a = items[keep], group_a[keep], class_a[keep], cost_a[keep]
    if items.size == 0:
        return None
    block = levels.block_of_gpu[gpu]
    candidates = [
        _moves_inside(state, block, items, group_a, cost_a),
        *_moves_and_swaps_outside(state, block, limit, items, group_a, class_a, cost_a),
    ]
    best = min((c for c in candidates if c is not None), key=lambda c: c[0], default=None)
    return best[1] if best is not None and best[0] < limit else None


def _moves_inside(state: _State, block: int, items: np.ndarray, group_a: np.ndarray,
                  cost_a: np.ndarray) -> tuple[int, list[tuple[int, int]]] | None:  # fmt: skip
    """Best move of an item to another group of its block, priced on the block's GPUs ``[I, K, b]``."""
    problem, levels = state.problem, state.levels
    first, size = int(problem.bag_first[block]), int(problem.bag_size[block])
    inside = levels.groups_in_block[block]  # [K] groups of the block
    gpus = np.arange(first, first + size)
    member = (gpus[None, :] >= problem.bag_first[inside][:, None]) & (
        gpus[None, :] < (problem.bag_first[inside] + problem.bag_size[inside])[:, None]
    )  # [K, b]
    in_a = member[np.searchsorted(inside, group_a)]  # [I, b] (groups of the block are sorted ids)
    cost_to = problem.cost[items[:, None], problem.bag_class[inside][None, :]]  # [I, K]
    loads = state.loads[first : first + size]
    new = loads[None, None, :] - (cost_a[:, None] * in_a)[:, None, :] + cost_to[:, :, None] * member[None, :, :]
    score = new.max(axis=2)  # [I, K]
    valid = problem.allowed[items[:, None], problem.bag_class[inside][None, :]] & (inside[None, :] != group_a[:, None])
    if problem.cap is not None:
        seq_lens = problem.seq_lens[items]
        rank_in_a = gpus[None, :] - problem.bag_first[group_a][:, None]
        rank_in_k = gpus[None, :] - problem.bag_first[inside][:, None]
        chunks_a = _chunks(seq_lens[:, None], problem.bag_size[group_a][:, None], rank_in_a) * in_a  # [I, b]
        chunks_k = (
            _chunks(seq_lens[:, None, None], problem.bag_size[inside][None, :, None], rank_in_k[None]) * member[None]
        )
        tokens = state.tokens[first : first + size][None, None, :] - chunks_a[:, None, :] + chunks_k
        valid &= tokens.max(axis=2) <= problem.cap
    score = np.where(valid, score, _BIG)
    k, g = divmod(int(np.argmin(score)), len(inside))
    return (int(score[k, g]), [(int(items[k]), int(inside[g]))]) if score[k, g] < _BIG else None


def _chunks(seq_len: np.ndarray, size: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Tokens member ``rank`` of a group of ``size`` gets of a sequence (broadcasting; 0 off the group)."""
    on = (rank >= 0) & (rank < size)
    return np.where(on, seq_len // size + (rank < seq_len % size), 0)


def _moves_and_swaps_outside(state: _State, block: int, limit: int, items: np.ndarray, group_a: np.ndarray,
                             class_a: np.ndarray, cost_a: np.ndarray) -> list:  # fmt: skip
    """Best move of an item to the lightest group of a class outside the block, and best swap with a
    sequence of one of the lightest groups outside it (the item takes its group, it takes the item's).
    A group's loads shift uniformly, so its busiest GPU stays its busiest."""
    problem, levels = state.problem, state.levels
    cost, allowed, cap = problem.cost, problem.allowed, problem.cap
    max_a = np.array([int(state.loads[state.span(a)].max()) for a in group_a.tolist()])
    lo = int(problem.bag_first[block])
    hi = lo + int(problem.bag_size[block])
    best_move = None
    partner_groups = []
    # [V, max groups per level] the busiest GPU's load of every group (padded), for partner lookups.
    level_maxima = np.zeros((len(levels.sizes), max(len(ids) for ids in levels.group_ids)), dtype=np.int64)
    for level, gpus in enumerate(levels.gpus):
        ids = levels.group_ids[level]
        outside = (gpus[:, 0] >= hi) | (gpus[:, -1] < lo)
        level_maxima[level, : len(ids)] = state.loads[gpus].max(axis=1)
        maxima = np.where(outside, level_maxima[level, : len(ids)], _BIG)
        lightest = np.argsort(maxima, kind="stable")[:SWAP_GROUPS_PER_LEVEL]
        lightest = lightest[maxima[lightest] < _BIG]
        partner_groups += ids[lightest].tolist()
        token_max = state.tokens[gpus[lightest]].max(axis=1) if cap is not None else None
        for c in np.flatnonzero(levels.level_of_class == level).tolist():
            of_class = problem.bag_class[ids[lightest]] == c
            if not of_class.any():
                continue
            dest = lightest[of_class][:TARGETS_PER_CLASS]  # [M] lightest first
            score = np.maximum((max_a - cost_a)[:, None], maxima[dest][None, :] + cost[items, c][:, None])  # [I, M]
            valid = np.broadcast_to(allowed[items, c][:, None], score.shape).copy()
            if cap is not None:
                need = -(-problem.seq_lens[items] // levels.sizes[level])
                valid &= token_max[of_class][:TARGETS_PER_CLASS][None, :] + need[:, None] <= cap
            score = np.where(valid, score, _BIG)
            k, m = divmod(int(np.argmin(score)), score.shape[1])
            if score[k, m] < _BIG and (best_move is None or score[k, m] < best_move[0]):
                best_move = (int(score[k, m]), [(int(items[k]), int(ids[dest[m]]))])

    partners = [j for g in sorted(set(partner_groups)) for j in state.members[g]]
    if not partners:
        return [best_move]
    js = _spread_by_cost(
        np.asarray(partners, dtype=np.int64), cost[partners, problem.bag_class[state.group_of_seq[partners]]]
    )
    if len(items) > SWAP_ITEMS:  # a useful swap trades costs that differ by about half a gap: a spread will do
        keep = _spread_by_cost(np.arange(len(items)), cost_a)
        items, group_a, class_a, cost_a, max_a = items[keep], group_a[keep], class_a[keep], cost_a[keep], max_a[keep]
    group_b = state.group_of_seq[js]
    class_b = problem.bag_class[group_b]
    max_b = level_maxima[levels.level_of_group[group_b], levels.position_of_group[group_b]]
    new_a = (max_a - cost_a)[:, None] + cost[js[None, :], class_a[:, None]]  # [I, J]
    new_b = (max_b - cost[js, class_b])[None, :] + cost[items[:, None], class_b[None, :]]
    score = np.maximum(new_a, new_b)
    valid = allowed[items[:, None], class_b[None, :]] & allowed[js[None, :], class_a[:, None]]
    score = np.where(valid, score, _BIG)
    best_swap = None
    flat_score = score.ravel()
    tries = min(SWAP_TRIES, flat_score.size)
    shortlist = np.argpartition(flat_score, tries - 1)[:tries]
    for flat in shortlist[np.lexsort((shortlist, flat_score[shortlist]))].tolist():
        k, jj = divmod(flat, len(js))
        if score[k, jj] >= limit:
            break
        i, j, a, b = int(items[k]), int(js[jj]), int(group_a[k]), int(group_b[jj])
        if cap is None or _swap_fits(state, i, a, j, b):
            best_swap = (int(score[k, jj]), [(i, b), (j, a)])
            break
    return [best_move, best_swap]


def _spread_by_cost(ids: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """At most ``SWAP_ITEMS`` of ``ids``, spread evenly over their costs (all of them if fewer)."""
    if len(ids) <= SWAP_ITEMS:
        return ids
    by_cost = np.argsort(costs, kind="stable")
    return ids[by_cost[np.linspace(0, len(ids) - 1, SWAP_ITEMS).astype(np.int64)]]


def _swap_fits(state: _State, i: int, a: int, j: int, b: int) -> bool:
    """Whether ``i`` in group ``b`` and ``j`` in group ``a`` (disjoint groups) keep the token cap."""
    problem = state.problem
    len_i, len_j = int(problem.seq_lens[i]), int(problem.seq_lens[j])
    size_a, size_b = int(problem.bag_size[a]), int(problem.bag_size[b])
    tokens_a = state.tokens[state.span(a)] - chunk_tokens(len_i, size_a) + chunk_tokens(len_j, size_a)
    tokens_b = state.tokens[state.span(b)] - chunk_tokens(len_j, size_b) + chunk_tokens(len_i, size_b)
    return bool(tokens_a.max() <= problem.cap and tokens_b.max() <= problem.cap)


# ----------------------------------------------------------------------------------------------------
# Exact search for small steps.


def _exact_search(problem: _Problem, levels: _Levels, incumbent: np.ndarray, node_budget: int) -> np.ndarray:
    """The best assignment branch and bound finds within ``node_budget`` nodes, or ``incumbent``.

    Sequences go in descending order of their cheapest cost, each into every group of an allowed
    class; a branch is cut when a GPU reaches the incumbent's step time, or when even the cheapest
    GPU-seconds of the remaining sequences cannot fit under it on ``S`` GPUs. Groups are tried once
    per symmetry class: two groups whose placement leads to mirror-image states (same place inside
    top-level groups with identical loads, tokens and speeds, or inside sibling halves whose contents
    are identical) give the same best completion. Exact when the budget suffices; only run for small
    balance groups (``S <= 64``), where a state is cheap to compare.
    """
    n, num_gpus, cap = len(problem.seq_lens), problem.num_gpus, problem.cap
    if num_gpus > 64:
        return incumbent
    state = _State(problem, levels)
    for i, g in enumerate(incumbent.tolist()):
        state.place(i, g)
    best_max = int(state.loads.max())
    masked_cost = np.where(problem.allowed, problem.cost, _BIG)
    order = np.lexsort((np.arange(n), -masked_cost.min(axis=1))).tolist()
    cheapest = np.where(problem.allowed, problem.gpu_seconds, _BIG).min(axis=1)[order]
    rest = np.concatenate([np.cumsum(cheapest[::-1])[::-1], [0]]).tolist()
    candidates = []
    for i in order:
        options = []
        for g in np.flatnonzero(problem.allowed[i, problem.bag_class]).tolist():
            first, size = int(problem.bag_first[g]), int(problem.bag_size[g])
            chunks = chunk_tokens(int(problem.seq_lens[i]), size).tolist()
            options.append((g, first, size, state.cost(i, g), chunks, int(problem.bag_class[g])))
        candidates.append(options)
    top_of_gpu = [None] * num_gpus
    for first, size in zip(problem.topology.bag_first_rank, problem.topology.bag_sizes, strict=True):
        for gpu in range(first, first + size):
            top_of_gpu[gpu] = (first, size)
    speeds = list(problem.workload.gpu_speed) if problem.workload.gpu_speed is not None else None
    loads, tokens = [0] * num_gpus, [0] * num_gpus
    assign = [0] * n
    best_assign, nodes = None, 0

    def signature(lo: int, size: int) -> tuple:
        return (tuple(loads[lo : lo + size]), tuple(tokens[lo : lo + size]) if cap is not None else (),
                tuple(speeds[lo : lo + size]) if speeds is not None else ())  # fmt: skip

    def canonical(first: int, size: int, c: int) -> tuple:
        top_first, top_size = top_of_gpu[first]
        path, lo, span = [], top_first, top_size
        while span > size:
            half = span // 2
            right = first >= lo + half
            # Mirror-image halves: either one leads to the same completions, so name the left one.
            path.append(0 if signature(lo, half) == signature(lo + half, half) else int(right))
            lo, span = (lo + half if right else lo), half
        return c, top_size, signature(top_first, top_size), tuple(path)

    def search(k: int, current_max: int, used: int) -> None:
        nonlocal best_max, best_assign, nodes
        if k == n:
            best_max, best_assign = current_max, list(assign)
            return
        if nodes >= node_budget or best_max <= problem.lower_bound:
            return
        if -(-(used + rest[k]) // num_gpus) >= best_max:
            return
        seen = set()
        for g, first, size, cost, chunks, c in candidates[k]:
            new_max = max(loads[first : first + size]) + cost
            if new_max >= best_max:
                continue
            if cap is not None and any(t + x > cap for t, x in zip(tokens[first : first + size], chunks, strict=True)):
                continue
            key = canonical(first, size, c)
            if key in seen:
                continue
            seen.add(key)
            nodes += 1
            for m in range(size):
                loads[first + m] += cost
                tokens[first + m] += chunks[m]
            assign[k] = g
            search(k + 1, max(current_max, new_max), used + size * cost)
            for m in range(size):
                loads[first + m] -= cost
                tokens[first + m] -= chunks[m]

    search(0, 0, 0)
    if best_assign is None:
        return incumbent
    group_of_seq = np.empty(n, dtype=np.int64)
    group_of_seq[order] = best_assign
    return group_of_seq
