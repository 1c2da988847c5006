"""The elastic planner behind topology ``auto``: every sequence gets its own Ulysses degree and group.

Pure NumPy and Python, called by :func:`~deepspeed_knap.planner.plan_routing` on the same quantised
problem as the fixed-topology solvers, whose "bags" are here every aligned group of every size
(:attr:`~deepspeed_knap.planner.topology.Topology.groups`): groups of one size are disjoint, groups of
different sizes are nested or disjoint. A GPU's load is the sum of the costs of the sequences of every
group it is in; the step time is the busiest GPU's load.

Dimension names: ``S`` GPUs, ``N`` sequences, ``B`` groups (all sizes), ``C`` group classes (equal size
and speed), ``V`` levels (distinct group sizes, largest first).

The solver:

1. **Degrees from the bound.** Splitting a sequence over ``G`` GPUs never saves GPU-seconds
   (``G * t(s, G)`` grows with ``G`` once the all-to-all costs anything), it only shortens the
   sequence. So for the lower bound ``T`` each sequence takes the size of its cheapest group class
   (in GPU-seconds) whose per-GPU cost fits ``T``: short sequences stay whole, long ones are split
   just enough. Further starts split down to ``T/2``, ``T/4``, ``T/8`` (with few sequences per GPU,
   smaller pieces pack tighter; one more, at 1.05 ``T``, gives room to a sequence just over it).
   Further starts are fixed topologies of the family solved by the fixed-topology solver
   (``refine``): the largest groups, each size alone, each size on an equal share of the GPUs, and
   mixes giving each size GPUs in proportion to what a degree start puts there; the best of them is
   improved by hill climbing on its mix (one group of a size more or fewer, split or merged). Local
   search across sizes rarely finds such plans of disjoint groups, often the best when images and
   videos mix. The first start close enough to the bound ends the packing (within
   ``SEARCH_TOLERANCE`` of it, or below a second of work within ``SEARCH_FLOOR_S``, at most 1%:
   :func:`~deepspeed_knap.planner.search.elastic_good_enough`), but the largest groups are always
   solved: auto is never worse than the topology's own bags (with a ``max_degree`` within a node; a
   plan with groups of whole nodes is kept only where it beats the plan inside nodes,
   :func:`~deepspeed_knap.planner.plan_routing`).
2. **Packing, largest groups first.** Every group placed before a level is at least as large and
   aligned, so it covers whole groups of the level: within a level every group has one load, and
   packing the level is scheduling on identical machines (related ones with ``gpu_speed``). First
   each sequence stays in the group of its home GPU if that finishes within ``T`` (largest first, so
   the most tokens stay home); the rest go largest first to the group that finishes earliest. The
   single-GPU level goes to the fixed-topology solver (``refine``) over the loads already there.
   When the memory cap defeats every such start, one packs for the cap alone (groups of any size).
3. **Only starts that can win.** A start's degrees bound its step time (its costliest sequence, its
   GPU-seconds spread over all GPUs), and splitting further only raises the bound: starts are packed
   in order of bound until the bound reaches the best packed step time, then searched best packed
   first, skipping those whose bound reaches the best searched step time or whose packed one is
   ``SEARCH_SLACK`` above it.
4. **Local search** on GPU loads: move one sequence touching the busiest GPU to the group of any size
   that finishes earliest, or swap it with a sequence of a light group, while every load it touches
   ends below the current maximum (so the sorted load vector falls lexicographically: no cycles, and
   the step time never rises). The best start, and those close behind it, then also try two-step
   chains when stuck. The loop and when it stops are the fixed solver's too
   (:func:`~deepspeed_knap.planner.search.local_search`).
5. **Branch and bound** for steps of at most ``EXACT_MAX_SEQUENCES`` sequences (besides short ones that
   cost next to nothing): branch and bound over every group, within ``ELASTIC_EXACT_NODE_BUDGET``
   nodes, on the fixed solver's driver (:class:`~deepspeed_knap.planner.search.BranchAndBound`),
   stopping where the starts do, and not run when the best start already got there (the local search
   and the stages' fixed-topology searches stop within ``SEARCH_TOLERANCE``; ``refine`` on a fixed
   topology stays exact within its budget).
6. **Locality:** single-GPU sequences go back to their home GPU, or trade places with a guest there,
   wherever that keeps the step time. Then, with equal speeds and overheads, a symmetry of the
   groups (blocks of one size traded, the halves of any group traded) that permutes the GPUs, and
   so keeps every load, places the contents where the most tokens stay home.

All arithmetic is on the problem's int64 costs, and ties break by ids, so plans are bit-identical on
every rank. The effort is a deterministic count of steps, never a clock.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from deepspeed_knap.cost.model import index_ranges
from deepspeed_knap.planner.fixed import _refine  # the elastic planner builds on the fixed one
from deepspeed_knap.planner.problem import Problem
from deepspeed_knap.planner.search import (
    BIG,
    CHAIN_STARTS,
    ELASTIC_EXACT_NODE_BUDGET,
    EXACT_MAX_SEQUENCES,
    SEARCH_TOLERANCE,
    STALL_WINDOW,
    SWAP_ITEMS,
    BranchAndBound,
    elastic_good_enough,
    local_search,
)

# Packing starts: split sequences until their per-GPU cost is at most this fraction of the bound.
PIECE_FRACTIONS = (1.05, 1.0, 0.5, 0.25, 0.125)
# The exact search takes steps of at most EXACT_MAX_SEQUENCES sequences not counting short ones
# (costing under 1/EXACT_SHORT of the bound), up to EXACT_SHORT_TOTAL in all.
EXACT_SHORT = 1000
EXACT_SHORT_TOTAL = 64
# Hill-climbing steps over mixes of group sizes (fixed topologies of the family).
TILING_ROUNDS = 4
# Starts whose packed step time is this much above the best searched one are not searched.
SEARCH_SLACK = 0.08
# The first search of each start (no chains: it only has to show which start wins) checks for a stall
# after this many steps, at the same rate: many GPUs near the max make steps cheap to stall on.
EXPLORE_WINDOW = 8
# Per local-search step: groups per class outside the busiest GPU's block that are move targets and
# whose sequences are swap partners (sampled down to SWAP_ITEMS), and how many of the best swaps are
# checked against the cap.
SWAP_GROUPS_PER_CLASS = 16
SWAP_TRIES = 32
# Chains (from CHAIN_STARTS sequences) are tried on the best searched start and on those whose step
# time is at most this much above it.
CHAIN_SLACK = 0.02
# Passes of bringing single-GPU sequences home: a later pass finds room that the first one made.
KEEP_HOME_PASSES = 2
# Blocks each block's contents are priced in for trading them home (besides its own).
TRADE_CANDIDATES = 2

# The cost of a sequence in a class the cap bars: a load plus it is never below the step time, and
# never overflows (loads stay below 2**62, see _local_search).
_BARRED = 2**61


@dataclass(frozen=True, eq=False)
class _Levels:
    """The groups of the problem by size, and the tables the search reads.

    Attributes:
        sizes: ``[V]`` group sizes, descending.
        group_ids: per level, ``[n_v]`` ids (into the problem's groups) ascending by first GPU.
        group_at: per level, ``[S]`` the id of the level's group holding each GPU (-1: none).
        groups_of_gpu: per GPU, the ids of the groups holding it, largest first.
        level_of_class: ``[C]`` level of each class.
        class_table: ``[C, n]`` the group ids of each class, ascending, padded with ``B``, the classes of
            larger groups first; table_position: per top-level group, the (row, column) indices of
            the groups inside it in ``class_table``.
        block_of_gpu: ``[S]`` the top-level group (bag of the topology) holding each GPU.
        groups_in_block: per group id of a top-level group, ``[K]`` the ids of the groups inside it, ascending.
        inside_position: ``[B]`` each group's index in ``groups_in_block`` of its block.
        block_member: per block size ``b``, ``[K, b]`` whether the block's ``k``-th group (in id order)
            holds its ``g``-th GPU (the same for every block of that size).
        padded_gpus: ``[B, max_degree]`` the GPUs of every group, repeated to fill the row: a row's max
            is the group's busiest GPU.
        first, size, group_class, block_of_group: ``[B]`` as Python ints: the search reads them one
            entry at a time, where NumPy's per-call overhead dominates.
        key_scale: ``B + 1``; group_index: ``[B]`` ``0 .. B-1``.
        step_cost: ``[N + 1, C]`` the problem's costs, ``_BARRED`` where the cap bars the class, and a
            last row of zeros: a partner that holds nothing.
    """

    sizes: list[int]
    group_ids: list[np.ndarray]
    group_at: list[np.ndarray]
    groups_of_gpu: list[list[int]]
    level_of_class: np.ndarray
    class_table: np.ndarray
    table_position: dict[int, tuple[np.ndarray, np.ndarray]]
    block_of_gpu: list[int]
    groups_in_block: dict[int, np.ndarray]
    inside_position: np.ndarray
    block_member: dict[int, np.ndarray]
    padded_gpus: np.ndarray
    first: list[int]
    size: list[int]
    group_class: list[int]
    block_of_group: list[int]
    key_scale: int
    group_index: np.ndarray
    step_cost: np.ndarray

    @classmethod
    def build(cls, problem: Problem) -> _Levels:
        sizes = sorted(set(problem.bag_size.tolist()), reverse=True)
        group_ids, group_at = [], []
        for size in sizes:
            ids = np.flatnonzero(problem.bag_size == size)
            ids = ids[np.argsort(problem.bag_first[ids], kind="stable")]
            at = np.full(problem.num_gpus, -1, dtype=np.int64)
            at[(problem.bag_first[ids][:, None] + np.arange(size)[None, :]).ravel()] = np.repeat(ids, size)
            group_ids.append(ids)
            group_at.append(at)
        at = np.stack(group_at, axis=1)  # [S, V]
        groups_of_gpu = [[g for g in row if g >= 0] for row in at.tolist()]
        level_of_class = np.array([sizes.index(int(g)) for g in problem.class_size], dtype=np.int64)
        class_ids = [np.flatnonzero(problem.bag_class == c) for c in np.argsort(level_of_class, kind="stable")]
        class_table = np.full((len(class_ids), max(len(ids) for ids in class_ids)), problem.num_bags, dtype=np.int64)
        for row, ids in enumerate(class_ids):
            class_table[row, : len(ids)] = ids
        row_col = np.full((problem.num_bags, 2), -1, dtype=np.int64)  # where each group sits in class_table
        row_col[class_table[class_table < problem.num_bags]] = np.argwhere(class_table < problem.num_bags)
        block_of_gpu = np.empty(problem.num_gpus, dtype=np.int64)
        groups_in_block = {}
        index = {(int(f), int(g)): b for b, (f, g) in enumerate(zip(problem.bag_first, problem.bag_size, strict=True))}
        for first, size in zip(problem.topology.bag_first_rank, problem.topology.bag_sizes, strict=True):
            block = index[(first, size)]
            block_of_gpu[first : first + size] = block
            groups_in_block[block] = np.flatnonzero(
                (problem.bag_first >= first) & (problem.bag_first + problem.bag_size <= first + size)
            )
        inside_position = np.empty(problem.num_bags, dtype=np.int64)
        block_member = {}
        for block, inside in groups_in_block.items():
            inside_position[inside] = np.arange(len(inside))
            size = int(problem.bag_size[block])
            offset = np.arange(size)[None, :] + int(problem.bag_first[block])
            block_member[size] = (offset >= problem.bag_first[inside][:, None]) & (
                offset < (problem.bag_first[inside] + problem.bag_size[inside])[:, None]
            )
        widest = int(problem.bag_size.max())
        padded_gpus = problem.bag_first[:, None] + np.arange(widest)[None, :] % problem.bag_size[:, None]
        step_cost = np.vstack([np.where(problem.allowed, problem.cost, _BARRED), np.zeros_like(problem.cost[:1])])
        table_position = {block: (row_col[inside, 0], row_col[inside, 1]) for block, inside in groups_in_block.items()}
        return cls(sizes, group_ids, group_at, groups_of_gpu, level_of_class, class_table, table_position,
                   block_of_gpu.tolist(), groups_in_block, inside_position, block_member, padded_gpus,
                   problem.bag_first.tolist(), problem.bag_size.tolist(), problem.bag_class.tolist(),
                   block_of_gpu[problem.bag_first].tolist(), problem.num_bags + 1, np.arange(problem.num_bags),
                   step_cost)  # fmt: skip


def chunk_tokens(seq_len: int, size: int) -> np.ndarray:
    """``[size]`` tokens each member of a group gets of a sequence: near-equal, the first ones one more."""
    base, extra = divmod(seq_len, size)
    return base + (np.arange(size) < extra)


class _State:
    """GPU loads (and, under a token cap, tokens) of a (partial) assignment of sequences to groups."""

    def __init__(self, problem: Problem, levels: _Levels):
        self.problem, self.levels = problem, levels
        # A slow GPU's larger fixed overhead is load it holds before any sequence.
        self.loads = problem.gpu_start_load.copy()
        self.tokens = np.zeros(problem.num_gpus, dtype=np.int64) if problem.cap is not None else None
        self.group_of_seq = np.full(len(problem.seq_lens), -1, dtype=np.int64)
        self.members: list[list[int]] = [[] for _ in range(problem.num_bags)]
        # [B] every group's busiest GPU, and [B + 1] keys ranking groups by it (ties by id; the last
        # one pads levels.class_table), kept by apply() once the local search starts them.
        self.group_max: np.ndarray | None = None
        self.group_key: np.ndarray | None = None

    def cost(self, i: int, group: int) -> int:
        return int(self.problem.cost[i, self.levels.group_class[group]])

    def span(self, group: int) -> slice:
        first = self.levels.first[group]
        return slice(first, first + self.levels.size[group])

    def place(self, i: int, group: int) -> None:
        self._add(i, group, 1)
        self.group_of_seq[i] = group
        self.members[group].append(i)

    def remove(self, i: int) -> None:
        group = int(self.group_of_seq[i])
        self._add(i, group, -1)
        self.group_of_seq[i] = -1
        self.members[group].remove(i)

    def _add(self, i: int, group: int, sign: int) -> None:
        first, size = self.levels.first[group], self.levels.size[group]
        cost = int(self.problem.cost[i, self.levels.group_class[group]])
        if size == 1:  # a scalar update costs a fifth of a slice's
            self.loads[first] += sign * cost
        else:
            self.loads[first : first + size] += sign * cost
        if self.tokens is not None:
            self.tokens[first : first + size] += sign * chunk_tokens(int(self.problem.seq_lens[i]), size)

    def place_all(self, seqs: np.ndarray, groups: np.ndarray) -> None:
        """:meth:`place` every ``seqs[k]`` in ``groups[k]``, in that order, vectorised."""
        problem = self.problem
        size = problem.bag_size[groups]
        gpu = index_ranges(problem.bag_first[groups], size)
        np.add.at(self.loads, gpu, np.repeat(problem.cost[seqs, problem.bag_class[groups]], size))
        if self.tokens is not None:
            rank = gpu - np.repeat(problem.bag_first[groups], size)
            np.add.at(self.tokens, gpu, _chunks(np.repeat(problem.seq_lens[seqs], size), np.repeat(size, size), rank))
        self.group_of_seq[seqs] = groups
        members = self.members
        for i, group in zip(seqs.tolist(), groups.tolist(), strict=True):
            members[group].append(i)

    def apply(self, moves: list[tuple[int, int]]) -> None:
        """Move each ``(sequence, group)`` of ``moves`` (all removed first, then all placed)."""
        blocks = {self.levels.block_of_group[int(self.group_of_seq[i])] for i, _ in moves}
        for i, _ in moves:
            self.remove(i)
        for i, group in moves:
            self.place(i, group)
        if self.group_max is not None:  # only the groups of the blocks touched change
            blocks.update(self.levels.block_of_group[group] for _, group in moves)
            for block in blocks:
                inside = self.levels.groups_in_block[block]
                self.group_max[inside] = self.loads[self.levels.padded_gpus[inside]].max(axis=1)
                self.group_key[inside] = self.group_max[inside] * self.levels.key_scale + inside

    def fits(self, i: int, group: int) -> bool:
        """Whether ``i`` in ``group`` keeps every GPU under the token cap (given the current tokens)."""
        problem = self.problem
        if not problem.allowed[i, self.levels.group_class[group]]:
            return False
        if problem.cap is None:
            return True
        chunks = chunk_tokens(int(problem.seq_lens[i]), self.levels.size[group])
        return bool(np.all(self.tokens[self.span(group)] + chunks <= problem.cap))

    def touching(self, gpu: int) -> list[int]:
        """Sequences whose group holds ``gpu``."""
        return [i for group in self.levels.groups_of_gpu[gpu] for i in self.members[group]]


def solve_elastic(problem: Problem, steps: int) -> np.ndarray | None:
    """``[N]`` group (index into the problem's groups) of every sequence, or ``None`` when no
    assignment found keeps every GPU under the memory cap. ``steps`` bounds each local search."""
    n = len(problem.seq_lens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    levels = _Levels.build(problem)
    best = _best_start(problem, levels, steps)
    if best is None:
        return None
    # Sequences that cost next to nothing mostly end up spread over single GPUs at the leaves (see
    # _exact_search): only the others count, up to a few times as many sequences in all.
    cheapest = np.where(problem.allowed, problem.cost, BIG).min(axis=1)
    small = n <= EXACT_SHORT_TOTAL and int((cheapest * EXACT_SHORT > problem.lower_bound).sum()) <= EXACT_MAX_SEQUENCES
    if small and int(best.loads.max()) > elastic_good_enough(problem):
        exact = _exact_search(problem, levels, best.group_of_seq)
        best = _State(problem, levels)
        best.place_all(np.arange(n), exact)
    return _trade_groups_home(problem, levels, _keep_home(best))


def _best_start(problem: Problem, levels: _Levels, steps: int) -> _State | None:
    """The best start after local search, of those that can win (see the module docstring), or
    ``None`` if the cap defeats every one."""
    n = len(problem.seq_lens)
    # [N, V] per level, the cheapest cost and GPU-seconds of each sequence among its allowed classes.
    level_cost = np.full((n, len(levels.sizes)), BIG, dtype=np.int64)
    level_gpu_seconds = level_cost.copy()
    for c, level in enumerate(levels.level_of_class.tolist()):
        ok = problem.allowed[:, c]
        level_cost[ok, level] = np.minimum(level_cost[ok, level], problem.cost[ok, c])
        level_gpu_seconds[ok, level] = np.minimum(level_gpu_seconds[ok, level], problem.gpu_seconds[ok, c])

    base = problem.gpu_start_load

    def bound(cost: np.ndarray, gpu_seconds: np.ndarray) -> int:
        """Step time no plan with these ``[N]`` least costs and GPU-seconds beats: the costliest
        sequence (or fixed overhead), the mean GPU."""
        if cost.max() >= BIG:
            return BIG
        return max(int(cost.max()), int(base.max()), -(-int(gpu_seconds.sum() + base.sum()) // problem.num_gpus))

    rows = np.arange(n)
    degree_starts = _degrees(problem, levels)
    starts = [(bound(level_cost[rows, level_of_seq], level_gpu_seconds[rows, level_of_seq]), level_of_seq, None)
              for level_of_seq in degree_starts]  # fmt: skip
    gpu_seconds_by_level = [np.bincount(level_of_seq, level_gpu_seconds[rows, level_of_seq], len(levels.sizes))
                            for level_of_seq in degree_starts]  # fmt: skip
    tilings = _tilings(problem, levels, gpu_seconds_by_level)
    own_bags = tilings[0]
    for tiling in tilings:
        classes = np.unique(problem.bag_class[tiling])
        barred = ~problem.allowed[:, classes]
        starts.append((bound(np.where(barred, BIG, problem.cost[:, classes]).min(axis=1),
                             np.where(barred, BIG, problem.gpu_seconds[:, classes]).min(axis=1)), None, tiling))  # fmt: skip
    # Packed starts, the best packed step time, and the best tiling start (tiling, state) to climb from.
    packed, best_packed, best_tiling = [], BIG, None
    good_enough = elastic_good_enough(problem)
    for start_bound, level_of_seq, tiling in sorted(starts, key=lambda start: start[0]):  # stable: larger pieces first
        if start_bound >= best_packed:
            break  # bounds only grow from here
        if best_packed <= good_enough and tiling is not own_bags:
            continue  # within tolerance of the bound already (auto stays never worse than its own bags)
        if tiling is not None:
            # The topology's own bags exactly (as refine on them): auto is never worse than them.
            tolerance = 0.0 if tiling is own_bags else SEARCH_TOLERANCE
            state = _pack_stage(problem, levels, _State(problem, levels), np.arange(n), tiling, steps,
                                tolerance=tolerance)  # fmt: skip
        else:
            state = _pack_by_level(problem, levels, level_of_seq, steps)
        if state is not None:
            packed.append((start_bound, state))
            best_packed = min(best_packed, int(state.loads.max()))
            if tiling is not None and (best_tiling is None or state.loads.max() < best_tiling[1].loads.max()):
                best_tiling = (tiling, state)
    if best_tiling is not None and best_packed > good_enough:
        climbed = _climb_tiling(problem, levels, *best_tiling, steps)
        if climbed is not best_tiling[1]:
            packed.append((problem.lower_bound, climbed))
    if not packed:  # only under a tight cap
        state = _pack_for_cap(problem, levels)
        if state is None and n <= EXACT_SHORT_TOTAL:  # bin packing can miss: small steps are searched
            found = _exact_search(problem, levels, None)
            if found is not None:
                state = _State(problem, levels)
                state.place_all(np.arange(n), found)
        if state is None:
            return None
        packed.append((problem.lower_bound, state))
    best, searched = None, []
    for start_bound, state in sorted(packed, key=lambda start: int(start[1].loads.max())):
        if best is not None and (start_bound >= int(best.loads.max())
                                 or int(state.loads.max()) > int(best.loads.max()) * (1 + SEARCH_SLACK)):  # fmt: skip
            continue
        _local_search(state, steps, chains=False)
        searched.append(state)
        if best is None or int(state.loads.max()) < int(best.loads.max()):
            best = state
    # Chains, for the best and those close behind it (stable sort: the best stays first among equals).
    for state in sorted(searched, key=lambda state: int(state.loads.max())):
        if state is not best and int(state.loads.max()) > int(best.loads.max()) * (1 + CHAIN_SLACK):
            break
        _local_search(state, steps)
        if int(state.loads.max()) < int(best.loads.max()):
            best = state
    return best


def _trade_groups_home(problem: Problem, levels: _Levels, group_of_seq: np.ndarray) -> np.ndarray:
    """``[N]`` the groups of ``group_of_seq`` with their contents placed where more tokens stay on
    their home GPU, by a symmetry of the groups: the contents of a top-level group (block) may go to
    another block of its size, and at every group the contents of its two halves may trade places.
    With equal speeds and overheads (otherwise nothing changes) that permutes the GPUs: every load
    moves with its GPU, so the step time is kept (under a cap, the result is kept only if the cap
    holds: a group's first GPUs carry a sequence's odd tokens).

    ``value(c, p)``: the most tokens the sequences of group ``c`` and of the groups inside it keep
    home with ``c``'s contents in slot ``p`` (a group of its size): its own sequences' home chunks
    there, plus the better of its halves straight or traded; 0 without computing when no home GPU
    of those sequences lies in ``p``. A block that keeps home all the tokens it has is not priced;
    the others are priced in their own slot (if they hold split sequences) and in those of the
    ``TRADE_CANDIDATES`` blocks where most of their tokens are at home (if more than they keep
    now), paired greedily by value (largest first, ties by ids), and the pairing kept only if it
    beats leaving every block where it is."""
    blocks = sorted(levels.groups_in_block)  # ids of the top-level groups (larger first, then by GPU)
    # Blocks of single GPUs hold single-GPU sequences only, which _keep_home has placed already.
    if problem.gpu_speed is not None or problem.gpu_base is not None or max(levels.size[b] for b in blocks) == 1:
        return group_of_seq
    first, size = levels.first, levels.size
    # Tokens each block's contents would keep home (chunk sizes rounded down) in each block, and keep now.
    index = {block: k for k, block in enumerate(blocks)}
    holding = np.array([index[b] for b in levels.block_of_group])[group_of_seq]  # [N]
    home = np.array([index[b] for b in levels.block_of_gpu])[problem.src]  # [N]
    chunk = problem.seq_lens // problem.bag_size[group_of_seq]
    at_home = np.bincount(holding * len(blocks) + home, weights=chunk,
                          minlength=len(blocks) ** 2).reshape(len(blocks), len(blocks))  # fmt: skip
    rank = problem.src - problem.bag_first[group_of_seq]
    kept_now = np.bincount(holding, weights=np.where((rank >= 0) & (rank < problem.bag_size[group_of_seq]), chunk, 0),
                           minlength=len(blocks))  # fmt: skip
    # Worth pricing: a block's own slot where it holds split sequences (with single-GPU ones only,
    # _keep_home has already traded what a swap of halves could), and another block where more of
    # its tokens would be home than it keeps now.
    split = np.bincount(holding, weights=problem.bag_size[group_of_seq] > 1, minlength=len(blocks)) > 0
    candidates = []
    for k, a in enumerate(blocks):
        if kept_now[k] < at_home[k].sum():
            ranked = np.lexsort((np.arange(len(blocks)), -at_home[k]))[:TRADE_CANDIDATES].tolist()
            candidates += [(a, blocks[j]) for j in sorted({k, *ranked})
                           if (j == k and split[k]) or (j != k and at_home[k, j] > kept_now[k])]  # fmt: skip
    if not candidates:
        return group_of_seq
    level_of_size = {g: v for v, g in enumerate(levels.sizes)}
    src, seq_lens = problem.src.tolist(), problem.seq_lens.tolist()
    by_group = np.argsort(group_of_seq, kind="stable")
    bounds = np.searchsorted(group_of_seq[by_group], np.arange(problem.num_bags + 1)).tolist()
    by_group = by_group.tolist()

    def halves(group: int) -> tuple[int, int] | None:
        if size[group] == 1:
            return None
        at = levels.group_at[level_of_size[size[group] // 2]]
        return int(at[first[group]]), int(at[first[group] + size[group] // 2])

    # Per group, sorted: the home GPUs of the sequences in it and inside it, and its own sequences'
    # homes with their lengths (a slot is a span of GPUs: what falls in one is a bisection away);
    # collected for a block when it is first priced.
    homes: dict[int, list[int]] = {}
    own: dict[int, tuple[list[int], list[int]]] = {}

    def collect(group: int) -> list[int]:
        by_home = sorted((src[i], seq_lens[i]) for i in by_group[bounds[group] : bounds[group + 1]])
        own[group] = ([h for h, _ in by_home], [length for _, length in by_home])
        found = set(own[group][0])
        for half in halves(group) or ():
            found.update(collect(half))
        homes[group] = sorted(found)
        return homes[group]

    memo: dict[tuple[int, int], tuple[int, bool]] = {}

    def value(c: int, p: int) -> int:
        if c not in homes:
            collect(c)
        if (c, p) in memo:
            return memo[c, p][0]
        lo, width = first[p], size[p]
        found = bisect.bisect_left(homes[c], lo)
        if found == len(homes[c]) or homes[c][found] >= lo + width:
            return 0
        own_homes, own_lens = own[c]
        kept = 0
        for k in range(bisect.bisect_left(own_homes, lo), bisect.bisect_left(own_homes, lo + width)):
            kept += own_lens[k] // width + (own_homes[k] - lo < own_lens[k] % width)
        trade = False
        if width > 1:
            (c_left, c_right), (p_left, p_right) = halves(c), halves(p)
            straight = value(c_left, p_left) + value(c_right, p_right)
            traded = value(c_left, p_right) + value(c_right, p_left)
            trade = traded > straight
            kept += max(straight, traded)
        memo[c, p] = (kept, trade)
        return kept

    target, taken = {}, set()
    for gained, a, b in sorted(((value(a, b), a, b) for a, b in candidates if size[a] == size[b]),
                               key=lambda pair: (-pair[0], pair[1], pair[2])):  # fmt: skip
        if gained > 0 and a not in target and b not in taken:
            target[a] = b
            taken.add(b)
    free = {}  # per size, the blocks of that size in order and the position of the first maybe free
    for a in blocks:  # the rest: where they are if free, else the first free block of their size
        if a not in target:
            if a in taken:
                same, at = free.setdefault(size[a], ([b for b in blocks if size[b] == size[a]], [0]))
                while same[at[0]] in taken:  # the first free block only moves forward
                    at[0] += 1
                target[a] = same[at[0]]
            else:
                target[a] = a
            taken.add(target[a])
    moved = [a for a in blocks if target[a] != a]
    if sum(value(a, target[a]) for a in moved) <= sum(value(a, a) for a in moved):
        target = {a: a for a in blocks}
    slot = np.arange(problem.num_bags)

    def place(c: int, p: int) -> None:
        slot[c] = p
        if size[c] > 1:
            (c_left, c_right), (p_left, p_right) = halves(c), halves(p)
            if memo.get((c, p), (0, False))[1]:
                p_left, p_right = p_right, p_left
            place(c_left, p_left)
            place(c_right, p_right)

    for a, b in target.items():
        place(a, b)
    traded = slot[group_of_seq]
    if problem.cap is not None:
        state = _State(problem, levels)
        state.place_all(np.arange(len(seq_lens)), traded)
        if int(state.tokens.max()) > problem.cap:
            return group_of_seq
    return traded


def _keep_home(state: _State) -> np.ndarray:
    """``[N]`` the groups of ``state`` with single-GPU sequences brought back to their home GPU where
    that keeps the step time ``M`` (the busiest GPU's load), largest first: move one home if it fits
    under ``M`` there, else swap it with a guest of its home GPU (a sequence from elsewhere) if both
    GPUs stay under ``M``: a guest from the GPU it leaves first (both come home), else the costliest
    guest that fits. Every move keeps more tokens home and no load above ``M``; ``KEEP_HOME_PASSES``
    passes, as one move makes room for another. ``state`` is left as it was.

    Thousands of sequences may be away, so this is plain Python on lists, and each GPU's guests are
    kept sorted by their cost there (as ``cost * N + sequence``): the guests that fit are a bisection
    away, and with one class on both GPUs the costliest of them is the last."""
    problem, levels = state.problem, state.levels
    single_group = levels.group_at[-1]  # the single-GPU group of every GPU (sizes are descending)
    gpu_class = problem.bag_class[single_group]  # [S]
    on = problem.bag_first[state.group_of_seq]
    away = np.flatnonzero((problem.bag_size[state.group_of_seq] == 1) & (on != problem.src))
    group_of_seq = state.group_of_seq.copy()
    if away.size == 0:
        return group_of_seq
    n, num_gpus = len(problem.seq_lens), problem.num_gpus
    top, cap = int(state.loads.max()), problem.cap
    guest_key = problem.cost[away, gpu_class[on[away]]] * n + away
    by_gpu = np.lexsort((guest_key, on[away]))
    guests: dict[int, list[int]] = {}  # GPU -> its guests' keys, ascending
    guests_from: dict[int, list[int]] = {}  # GPU * S + home -> its guests from there, ascending
    for gpu, key, j, home in zip(on[away][by_gpu].tolist(), guest_key[by_gpu].tolist(), away[by_gpu].tolist(),
                                 problem.src[away][by_gpu].tolist(), strict=True):  # fmt: skip
        guests.setdefault(gpu, []).append(key)
        guests_from.setdefault(gpu * num_gpus + home, []).append(j)
    gpu_class, src, on = gpu_class.tolist(), problem.src.tolist(), on.tolist()
    # cost[c][i]: what sequence i costs alone on a GPU of class c (for the classes of single GPUs).
    cost = [problem.cost[:, c].tolist() if c in gpu_class else None for c in range(len(problem.class_size))]
    loads = state.loads.tolist()
    if cap is not None:
        allowed, seq_lens, tokens = problem.allowed, problem.seq_lens.tolist(), state.tokens.tolist()

    def fits_swap(i: int, j: int, home: int, here: int) -> bool:
        """Whether ``i`` (on ``here``) and its home's guest ``j`` can trade places."""
        class_home, class_here = gpu_class[home], gpu_class[here]
        if (loads[home] - cost[class_home][j] + cost[class_home][i] > top
                or loads[here] - cost[class_here][i] + cost[class_here][j] > top):  # fmt: skip
            return False
        return cap is None or (bool(allowed[j, class_here]) and tokens[home] - seq_lens[j] + seq_lens[i] <= cap
                               and tokens[here] - seq_lens[i] + seq_lens[j] <= cap)  # fmt: skip

    def relocate(j: int, gpu: int) -> None:
        old, home = on[j], src[j]
        loads[old] -= cost[gpu_class[old]][j]
        loads[gpu] += cost[gpu_class[gpu]][j]
        if cap is not None:
            tokens[old] -= seq_lens[j]
            tokens[gpu] += seq_lens[j]
        if old != home:
            guests[old].remove(cost[gpu_class[old]][j] * n + j)
            guests_from[old * num_gpus + home].remove(j)
        if gpu != home:
            bisect.insort(guests.setdefault(gpu, []), cost[gpu_class[gpu]][j] * n + j)
            bisect.insort(guests_from.setdefault(gpu * num_gpus + home, []), j)
        on[j] = gpu

    def partner_of(i: int, home: int, here: int) -> int | None:
        """The guest of ``home`` that ``i`` trades places with, or ``None``."""
        back = guests_from.get(home * num_gpus + here)
        if back:
            partner = next((j for j in back if fits_swap(i, j, home, here)), None)
            if partner is not None:
                return partner
        at_home = guests.get(home)
        if not at_home:
            return None
        cost_i = cost[gpu_class[home]][i]
        # A guest's cost at home must cover what home lacks, and (one class) fit what here has left.
        lo = bisect.bisect_left(at_home, (loads[home] + cost_i - top) * n)
        if gpu_class[home] != gpu_class[here]:
            return next((key % n for key in reversed(at_home[lo:]) if fits_swap(i, key % n, home, here)), None)
        hi = bisect.bisect_left(at_home, (top - loads[here] + cost_i + 1) * n)
        if cap is None:
            return at_home[hi - 1] % n if hi > lo else None
        return next((key % n for key in reversed(at_home[lo:hi]) if fits_swap(i, key % n, home, here)), None)

    waiting = away[np.argsort(-problem.seq_lens[away], kind="stable")].tolist()
    for _ in range(KEEP_HOME_PASSES):
        for i in waiting:
            home, here = src[i], on[i]
            if here == home:  # it came home as a guest of an earlier swap
                continue
            if loads[home] + cost[gpu_class[home]][i] <= top and (
                cap is None or (allowed[i, gpu_class[home]] and tokens[home] + seq_lens[i] <= cap)
            ):
                relocate(i, home)
                continue
            partner = partner_of(i, home, here)
            if partner is not None:
                relocate(partner, here)
                relocate(i, home)
        waiting = [i for i in waiting if on[i] != src[i]]
    group_of_seq[away] = single_group[np.asarray(on)[away]]
    return group_of_seq


def _pack_by_level(problem: Problem, levels: _Levels, level_of_seq: np.ndarray, steps: int) -> _State | None:
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
        ids = levels.group_ids[level]
        group_load = dict(zip(ids.tolist(), state.loads[levels.padded_gpus[ids]].max(axis=1).tolist(), strict=True))
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


def _pack_stage(problem: Problem, levels: _Levels, state: _State, seqs: np.ndarray, bags: np.ndarray,
                steps: int, give_up_at: int | None = None, tolerance: float = SEARCH_TOLERANCE) -> _State | None:  # fmt: skip
    """Place ``seqs`` in the disjoint groups ``bags`` with the fixed-topology solver (``refine``, its
    exact search stopping within ``tolerance`` of the stage's bound), on top of what ``state`` holds
    (a bag's load and tokens are its busiest GPU's). ``None`` if the cap defeats it, or if the stage's
    lower bound reaches ``give_up_at`` (no solve could get below it)."""
    if not problem.allowed[np.ix_(seqs, np.unique(problem.bag_class[bags]))].any(axis=1).all():
        return None  # the cap leaves some sequence no bag
    padded = state.levels.padded_gpus[bags]
    base_load = state.loads[padded].max(axis=1)
    # Without a cap tokens do not matter: bags of one load are then interchangeable for refine.
    base_tokens = state.tokens[padded].max(axis=1) if state.tokens is not None else np.zeros_like(base_load)
    stage = problem.tiling_problem(seqs, bags, base_load, base_tokens)
    if give_up_at is not None and stage.lower_bound >= give_up_at:
        return None
    bag_of_seq = _refine(stage, steps, tolerance)
    if bag_of_seq is None:
        return None
    state.place_all(seqs, bags[bag_of_seq])
    return state


def _pack_for_cap(problem: Problem, levels: _Levels) -> _State | None:
    """Every sequence placed for the memory cap alone, or ``None`` if that fails: the start of last
    resort when the cap defeats every load-driven one (which put the sequences of a level in groups of
    that level only). Like bin packing's first-fit decreasing: sequences by the tokens they need
    (their smallest per-GPU share) descending, each in the group, of any size, that leaves its
    busiest GPU the fewest tokens (ties: the lowest load, then the lowest id). Load balance is left to
    local search."""
    state = _State(problem, levels)
    first, size = problem.bag_first, problem.bag_size
    for i in np.lexsort((np.arange(len(problem.seq_lens)), -problem.tokens.min(axis=1))).tolist():
        best = None
        for group in np.flatnonzero(problem.allowed[i, problem.bag_class]).tolist():
            span = slice(int(first[group]), int(first[group] + size[group]))
            tokens = state.tokens[span] + chunk_tokens(int(problem.seq_lens[i]), int(size[group]))
            if tokens.max() <= problem.cap:
                key = (int(tokens.max()), int(state.loads[span].max()) + state.cost(i, group), group)
                best = key if best is None or key < best else best
        if best is None:
            return None
        state.place(i, best[2])
    return state


def _tilings(problem: Problem, levels: _Levels, gpu_seconds_by_level: list[np.ndarray]) -> list[np.ndarray]:
    """Fixed topologies of the ``auto`` family, each ``[K]`` ids of disjoint groups covering every
    GPU ascending by first GPU (as ``refine`` sees bags), for ``refine`` to solve as starts: the
    topology's own bags (the largest groups: auto is never worse than them), every level's groups
    alone, every level on an equal share of the GPUs, and per ``[V]`` GPU-seconds by level (of a
    degree start) a mix giving each level GPUs in proportion, largest groups first. Local search
    across sizes rarely turns a plan of nested groups into one of disjoint groups of several sizes,
    which is often best when images and videos mix."""
    num_gpus = problem.num_gpus
    tilings = [np.asarray(sorted(levels.groups_in_block, key=lambda g: levels.first[g]))]
    tilings += [ids for ids in levels.group_ids if len(ids) * int(problem.bag_size[ids[0]]) == num_gpus]
    equal_share = _layout(levels, [num_gpus // len(levels.sizes) // size for size in levels.sizes], num_gpus)
    tilings += [equal_share] if equal_share is not None else []
    for gpu_seconds in gpu_seconds_by_level:
        counts = [max(round(num_gpus * share / size), 1 if share > 0 else 0)
                  for share, size in zip(gpu_seconds / gpu_seconds.sum(), levels.sizes, strict=True)]  # fmt: skip
        groups = _layout(levels, counts, num_gpus)
        if groups is not None:
            tilings.append(groups)
    unique = {tiling.tobytes(): tiling for tiling in tilings}
    return list(unique.values())


def _layout(levels: _Levels, counts: list[int], num_gpus: int) -> np.ndarray | None:
    """``[K]`` ids of ``counts[v]`` groups of each level, largest first from GPU 0 on (so each is
    aligned), fewer where the GPUs run out, and the smallest groups taking the GPUs left; ``None``
    where that does not cover every GPU (a ragged last node)."""
    groups, first = [], 0
    for level, (count, size) in enumerate(zip(counts, levels.sizes, strict=True)):
        if level == len(counts) - 1:
            count = (num_gpus - first) // size
        for _ in range(min(count, (num_gpus - first) // size)):
            group = int(levels.group_at[level][first])
            if group < 0 or levels.first[group] != first:
                return None
            groups.append(group)
            first += size
    return np.asarray(groups, dtype=np.int64) if first == num_gpus else None


def _climb_tiling(problem: Problem, levels: _Levels, tiling: np.ndarray, state: _State, steps: int) -> _State:
    """The best mix found from ``tiling`` (solved by ``refine`` into ``state``) by hill climbing: a
    step tries one group more or one fewer of each size but the smallest (which take the GPUs left),
    and one group split into two of the next size or two merged, each solved by ``refine``, and keeps
    the best if it lowers the step time; at most ``TILING_ROUNDS`` steps."""
    sizes = levels.sizes
    counts = [int((problem.bag_size[tiling] == size).sum()) for size in sizes]
    seen = {tiling.tobytes()}  # layouts solved (counts the GPUs run out for give one layout twice)
    for _ in range(TILING_ROUNDS):
        step = None
        for level in range(len(sizes) - 1):
            # One group of the size more or fewer (the smallest groups take the rest), or one split
            # into two of the next size, or two of those merged.
            for change, next_change in ((1, 0), (-1, 0), (-1, 2), (1, -2)):
                near = counts.copy()
                near[level] += change
                near[level + 1] += next_change
                if min(near) < 0:
                    continue
                groups = _layout(levels, near, problem.num_gpus)
                if groups is None or groups.tobytes() in seen:
                    continue
                seen.add(groups.tobytes())
                best = state if step is None else step[2]
                # Only a mix that beats the best counts: one whose bound reaches it is not solved.
                solved = _pack_stage(problem, levels, _State(problem, levels), np.arange(len(problem.seq_lens)),
                                     groups, steps, int(best.loads.max()))  # fmt: skip
                if solved is not None and solved.loads.max() < best.loads.max():
                    step = (near, groups, solved)
        if step is None:
            break
        counts, tiling, state = step
        counts[-1] = int((problem.bag_size[tiling] == sizes[-1]).sum())
    return state


def _degrees(problem: Problem, levels: _Levels) -> list[np.ndarray]:
    """``[N]`` level of every sequence for each of ``PIECE_FRACTIONS`` that gives a new one: split
    until its per-GPU cost is at most ``piece`` times the lower bound ``T`` (or as far as it goes),
    taking the cheapest GPU-seconds among the classes that fit, ties to the smaller group (classes are
    sorted by size, then speed). With few sequences per GPU, smaller pieces pack tighter than the
    GPU-seconds they add."""
    cost = np.where(problem.allowed, problem.cost, BIG)
    gpu_seconds = np.where(problem.allowed, problem.gpu_seconds, BIG)
    shortest = cost.argmin(axis=1)
    found, seen = [], set()
    for piece in PIECE_FRACTIONS:
        fits = cost <= int(problem.lower_bound * piece)
        level_of_seq = levels.level_of_class[
            np.where(fits.any(axis=1), np.where(fits, gpu_seconds, BIG).argmin(axis=1), shortest)
        ]
        if level_of_seq.tobytes() not in seen:  # the same split as a larger piece gives the same plan
            seen.add(level_of_seq.tobytes())
            found.append(level_of_seq)
    return found


# ----------------------------------------------------------------------------------------------------
# Local search.


def _local_search(state: _State, steps: int, chains: bool = True) -> None:
    """Lower the busiest GPU by moves and swaps, in place (see the module docstring), by
    :func:`~deepspeed_knap.planner.search.local_search`, which says when it stops; without
    ``chains`` (a first search) the stall window is ``EXPLORE_WINDOW`` steps, its tolerance pro rata.

    A step takes the busiest GPU (lowest id among equals) and applies the best move or swap of a
    sequence touching it, judged by the largest load it leaves on the GPUs it touches; a step is
    applied only if that is below the current maximum.

    Steps rank groups by keys ``load * (B + 1) + id`` (:func:`_lightest_outside`); loads only fall, and
    a chain raises one group by at most the largest cost, so the keys fit int64 unless the busiest GPU
    starts above ``2**63 / (B + 1)`` minus that cost: millions of sequences per GPU, then not searched.
    """
    problem = state.problem
    if (int(state.loads.max()) + int(problem.cost.max())) * (problem.num_bags + 1) >= BIG:
        return
    state.group_max = state.loads[state.levels.padded_gpus].max(axis=1)
    state.group_key = np.append(state.group_max * state.levels.key_scale + state.levels.group_index, BIG)
    window = STALL_WINDOW if chains else EXPLORE_WINDOW

    def improve(gpu: int, top: int) -> list[tuple[int, int]] | None:
        return _best_step(state, gpu, top) or (_best_chain(state, gpu, top) if chains else None)

    local_search(state.loads, problem.lower_bound, steps, improve, state.apply, window,
                 SEARCH_TOLERANCE * window / STALL_WINDOW)  # fmt: skip


def _best_chain(state: _State, gpu: int, top: int) -> list[tuple[int, int]] | None:
    """First two-step chain out of ``gpu`` that leaves every load it touches below ``top``: move one of
    its ``CHAIN_STARTS`` costliest sequences to the lightest group of a class elsewhere, even if that
    overloads the group, then the best step out of that group's busiest GPU."""
    levels = state.levels
    items = [i for i in state.touching(gpu) if state.cost(i, int(state.group_of_seq[i])) > 0]
    items.sort(key=lambda i: (-state.cost(i, int(state.group_of_seq[i])), i))
    light = _lightest_outside(state, levels.block_of_gpu[gpu]).tolist()
    classes = [levels.group_class[g] for g in light]
    # The lightest group outside the block, of every class (light is lightest first within a class).
    lightest = [light[classes.index(c)] for c in sorted(set(classes))]
    for i in items[:CHAIN_STARTS]:
        home = int(state.group_of_seq[i])
        if int(state.loads[gpu]) - state.cost(i, home) >= top:
            continue
        for b in lightest:
            if not state.fits(i, b):
                continue
            # A follow-up takes at most one sequence's cost off b's busiest GPU: skip the search
            # when even the costliest one there could not bring it below top.
            span = state.span(b)
            gpu_b = span.start + int(state.loads[span].argmax())
            most_off = max((state.cost(j, int(state.group_of_seq[j])) for j in state.touching(gpu_b)), default=0)
            if int(state.group_max[b]) + state.cost(i, b) - most_off >= top:
                continue
            state.apply([(i, b)])
            follow = _best_step(state, gpu_b, top)
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
    items, group_a = [], []
    for group in levels.groups_of_gpu[gpu]:
        items += state.members[group]
        group_a += [group] * len(state.members[group])
    if not items:
        return None
    items, group_a = np.asarray(items), np.asarray(group_a)
    cost_items = levels.step_cost[items]  # [I, C]
    cost_a = cost_items[np.arange(len(items)), problem.bag_class[group_a]]
    if not cost_a.all():  # moving a sequence that costs nothing (quantised) cannot lower the max
        keep = cost_a > 0
        items, group_a, cost_items, cost_a = items[keep], group_a[keep], cost_items[keep], cost_a[keep]
        if items.size == 0:
            return None
    block = levels.block_of_gpu[gpu]
    found = [_move_inside(state, block, items, group_a, cost_items, cost_a),
             _trade_outside(state, block, limit, items, group_a, cost_a)]  # fmt: skip
    best = min((f for f in found if f is not None), key=lambda f: f[0], default=None)
    return best[1] if best is not None and best[0] < limit else None


def _lightest_outside(state: _State, block: int) -> np.ndarray:
    """``[D]`` ids of the ``SWAP_GROUPS_PER_CLASS`` lightest groups of every class outside ``block``,
    class by class (larger groups first), lightest first (ties by id): one partition over keys that
    pack a group's busiest GPU's load and its id into one int64 (see :func:`_local_search` for why
    they cannot overflow)."""
    levels = state.levels
    table = state.group_key[levels.class_table]  # [C, n], padded with BIG
    table[levels.table_position[block]] = BIG
    if table.shape[1] > SWAP_GROUPS_PER_CLASS:
        table = np.partition(table, SWAP_GROUPS_PER_CLASS - 1, axis=1)[:, :SWAP_GROUPS_PER_CLASS]
    table.sort(axis=1)
    return table[table < BIG] % levels.key_scale


def _move_inside(state: _State, block: int, items: np.ndarray, group_a: np.ndarray, cost_items: np.ndarray,
                 cost_a: np.ndarray) -> tuple[int, list[tuple[int, int]]] | None:  # fmt: skip
    """Best move of an item to another group of its block, priced on the block's GPUs ``[I, K, b]``."""
    problem, levels = state.problem, state.levels
    first, size = levels.first[block], levels.size[block]
    inside = levels.groups_in_block[block]  # [K] groups of the block
    member = levels.block_member[size]  # [K, b]
    in_a = member[levels.inside_position[group_a]]  # [I, b]
    left = state.loads[first : first + size] - cost_a[:, None] * in_a  # [I, b] once the item leaves
    score = (left[:, None, :] + cost_items[:, problem.bag_class[inside]][:, :, None] * member).max(axis=2)  # [I, K]
    score[inside[None, :] == group_a[:, None]] = BIG
    if problem.cap is not None:
        seq_lens = problem.seq_lens[items]
        gpus = np.arange(first, first + size)
        rank_in_a = gpus[None, :] - problem.bag_first[group_a][:, None]
        rank_in_k = gpus[None, :] - problem.bag_first[inside][:, None]
        chunks_a = _chunks(seq_lens[:, None], problem.bag_size[group_a][:, None], rank_in_a) * in_a  # [I, b]
        chunks_k = (
            _chunks(seq_lens[:, None, None], problem.bag_size[inside][None, :, None], rank_in_k[None]) * member[None]
        )
        tokens = state.tokens[first : first + size][None, None, :] - chunks_a[:, None, :] + chunks_k
        score[tokens.max(axis=2) > problem.cap] = BIG
    k, g = divmod(int(np.argmin(score)), len(inside))
    return int(score[k, g]), [(int(items[k]), int(inside[g]))]


def _chunks(seq_len: np.ndarray, size: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Tokens member ``rank`` of a group of ``size`` gets of a sequence (broadcasting; 0 off the group)."""
    on = (rank >= 0) & (rank < size)
    return np.where(on, seq_len // size + (rank < seq_len % size), 0)


def _trade_outside(state: _State, block: int, limit: int, items: np.ndarray, group_a: np.ndarray,
                   cost_a: np.ndarray) -> tuple[int, list[tuple[int, int]]] | None:  # fmt: skip
    """Best move of an item into one of the lightest groups outside its block, or swap with one of their
    sequences (the item takes its group, it takes the item's), ``[I, J]``. A move is a swap with
    nothing: every such group also offers a partner ``N`` that costs nothing. A group's loads shift
    uniformly, so its busiest GPU stays its busiest."""
    problem, levels = state.problem, state.levels
    light = _lightest_outside(state, block)
    if light.size == 0:
        return None
    partners, partner_groups = [], []
    for g in sorted(light.tolist()):
        partners += state.members[g]
        partner_groups += [g] * len(state.members[g])
    js, group_b = np.asarray(partners, dtype=np.int64), np.asarray(partner_groups, dtype=np.int64)
    if len(js) > SWAP_ITEMS:  # a useful swap trades costs that differ by about half a gap: a spread will do
        keep = _spread_by_cost(levels.step_cost[js, problem.bag_class[group_b]])
        js, group_b = js[keep], group_b[keep]
    if len(items) > SWAP_ITEMS:
        keep = _spread_by_cost(cost_a)
        items, group_a, cost_a = items[keep], group_a[keep], cost_a[keep]
    js = np.concatenate([js, np.full(len(light), len(problem.seq_lens))])
    group_b = np.concatenate([group_b, light])
    class_a, class_b = problem.bag_class[group_a], problem.bag_class[group_b]
    step_cost = levels.step_cost  # its row N is the partner that costs nothing
    new_a = (state.group_max[group_a] - cost_a)[:, None] + step_cost[js[None, :], class_a[:, None]]  # [I, J]
    new_b = (state.group_max[group_b] - step_cost[js, class_b])[None, :] + step_cost[items[:, None], class_b[None, :]]
    score = np.maximum(new_a, new_b)
    # Under a cap the best few may lack room: try them in order of score, then of (item, partner).
    for _ in range(SWAP_TRIES if problem.cap is not None else 1):
        k, jj = divmod(int(np.argmin(score)), len(js))
        if score[k, jj] >= limit:
            return None
        i, j, a, b = int(items[k]), int(js[jj]), int(group_a[k]), int(group_b[jj])
        if problem.cap is None or _swap_fits(state, i, a, j, b):
            return int(score[k, jj]), [(i, b)] if j == len(problem.seq_lens) else [(i, b), (j, a)]
        score[k, jj] = BIG
    return None


def _spread_by_cost(costs: np.ndarray) -> np.ndarray:
    """Positions of ``SWAP_ITEMS`` of the (more) ``costs``, spread evenly over their sorted values."""
    by_cost = np.argsort(costs, kind="stable")
    return by_cost[np.arange(SWAP_ITEMS) * (len(costs) - 1) // (SWAP_ITEMS - 1)]


def _swap_fits(state: _State, i: int, a: int, j: int, b: int) -> bool:
    """Whether ``i`` in group ``b`` and ``j`` in group ``a`` (disjoint groups) keep the token cap; ``j``
    may be ``N``, the partner that holds nothing."""
    problem = state.problem
    len_i = int(problem.seq_lens[i])
    len_j = int(problem.seq_lens[j]) if j < len(problem.seq_lens) else 0  # the partner N holds nothing
    size_a, size_b = int(problem.bag_size[a]), int(problem.bag_size[b])
    tokens_a = state.tokens[state.span(a)] - chunk_tokens(len_i, size_a) + chunk_tokens(len_j, size_a)
    tokens_b = state.tokens[state.span(b)] - chunk_tokens(len_j, size_b) + chunk_tokens(len_i, size_b)
    return bool(tokens_a.max() <= problem.cap and tokens_b.max() <= problem.cap)


# ----------------------------------------------------------------------------------------------------
# Branch and bound for small steps.


def _exact_search(problem: Problem, levels: _Levels, incumbent: np.ndarray | None) -> np.ndarray | None:
    """The best assignment branch and bound finds within ``ELASTIC_EXACT_NODE_BUDGET`` nodes (it stops
    at one :func:`~deepspeed_knap.planner.search.elastic_good_enough` accepts), or ``incumbent`` (with none: any
    assignment that fits the memory cap, and the best of those, or ``None``).

    Sequences go in descending order of their cheapest cost over the classes allowed to them, each
    into every group of an allowed class. Besides the cuts of :class:`~deepspeed_knap.planner.search.BranchAndBound`, a branch is
    cut when a GPU reaches the incumbent's step time, or (with unequal speeds) when the least work at
    speed 1 of the remaining sequences cannot fit under it. Groups are tried once per symmetry class:
    two groups whose placement leads to mirror-image states (same place inside top-level groups with
    identical loads, tokens and speeds, or, without a cap, inside sibling halves whose contents are
    identical) give the same best completion; sequences of equal length go to groups in ascending
    order. When the remaining sequences fit on single GPUs (each where it finishes first) without
    raising the branch's step time, that completes the branch: no completion does better, and short
    sequences (which cost next to nothing anywhere) would otherwise multiply the branches. Only run
    for small balance groups (``S <= 64``), where a state is cheap to compare.
    """
    if problem.num_gpus > 64:
        return incumbent
    incumbent_max = BIG
    if incumbent is not None:
        state = _State(problem, levels)
        state.place_all(np.arange(len(problem.seq_lens)), incumbent)
        incumbent_max = int(state.loads.max())
    loads = problem.gpu_start_load.tolist()
    found = _GroupSearch(problem, levels, incumbent_max).solve(max(loads), sum(loads))
    return incumbent if found is None else found


class _GroupSearch(BranchAndBound):
    """The branch and bound of :func:`_exact_search`: a place is a group, and the state every GPU's
    load and tokens, as lists (read one entry at a time)."""

    def __init__(self, problem: Problem, levels: _Levels, incumbent_max: int):
        n = len(problem.seq_lens)
        order = np.lexsort((np.arange(n), -np.where(problem.allowed, problem.cost, BIG).min(axis=1)))
        # Stops where the starts do (elastic_good_enough): proving the last 0.1% took most of the
        # budget on small steps (kf_image_video x1/4 at 2 GPUs: 400-2,000 nodes, 12.8 against 1.5 ms
        # a solve, for at most 0.02% of the step), CPU each rank's plan worker took from training
        # where there is a core per rank (docs/notes/benchmarks-2026.md).
        super().__init__(problem, order, incumbent_max, ELASTIC_EXACT_NODE_BUDGET, elastic_good_enough(problem))
        self.cap = problem.cap
        # With unequal speeds, the GPU-seconds test on work at speed 1 too (a slow GPU does less of it
        # per load). [S] speeds, or None when all are equal (then they neither bound nor tell states apart).
        self.speeds = problem.gpu_speed.tolist() if problem.gpu_speed is not None else None
        if self.speeds is not None:
            least_work = np.where(problem.allowed, problem.speed_work, np.inf).min(axis=1)[order].tolist()
            # Plain Python sums in a fixed order (and math.fsum): the same on every rank's CPU.
            self.work_left = [*reversed(list(itertools.accumulate(reversed(least_work)))), 0.0]
            self.speed_sum = math.fsum(self.speeds)
        # What each sequence costs alone on each GPU (None: the cap bars it), and the least of it.
        single_class = problem.bag_class[levels.group_at[-1]]  # [S] the class of each GPU alone
        alone_cost = np.where(problem.allowed[:, single_class], problem.cost[:, single_class], -1)[order].tolist()
        self.alone_cost = [[None if c < 0 else c for c in row] for row in alone_cost]
        self.cheapest_alone = [min((c for c in row if c is not None), default=BIG) for row in self.alone_cost]
        self.seq_lens = seq_lens = problem.seq_lens[order].tolist()
        self.single_group = levels.group_at[-1].tolist()
        # Equal lengths cost the same everywhere: a run of them is placed in ascending group ids only
        # (run 2: not the run's first), which leaves one order of each placement. Mirror-image groups
        # are then skipped only for sequences outside runs (run 0): a mirror image could break the order.
        same = [False] + [seq_lens[k] == seq_lens[k - 1] for k in range(1, n)] + [False]
        self.run = [2 if same[k] else 1 if same[k + 1] else 0 for k in range(n)]
        # Per sequence of the order, every group it may go to: (group, first GPU, size, cost, [size]
        # tokens of each member, class).
        self.candidates = []
        for i in order.tolist():
            options = []
            for g in np.flatnonzero(problem.allowed[i, problem.bag_class]).tolist():
                first, size, c = int(problem.bag_first[g]), int(problem.bag_size[g]), int(problem.bag_class[g])
                options.append(
                    (g, first, size, int(problem.cost[i, c]), chunk_tokens(int(problem.seq_lens[i]), size).tolist(), c)
                )
            self.candidates.append(options)
        self.top_of_gpu = [None] * problem.num_gpus  # the (first GPU, size) of each GPU's top-level group
        for first, size in zip(problem.topology.bag_first_rank, problem.topology.bag_sizes, strict=True):
            for gpu in range(first, first + size):
                self.top_of_gpu[gpu] = (first, size)
        # [S] every GPU's load and tokens on the current branch.
        self.loads = problem.gpu_start_load.tolist()
        self.tokens = [0] * problem.num_gpus

    def _signature(self, lo: int, size: int) -> tuple:
        """What tells the GPUs ``lo .. lo + size - 1`` apart from others for the search."""
        hi = lo + size
        return (tuple(self.loads[lo:hi]), tuple(self.tokens[lo:hi]) if self.cap is not None else (),
                tuple(self.speeds[lo:hi]) if self.speeds is not None else ())  # fmt: skip

    def _canonical(self, first: int, size: int, c: int) -> tuple:
        """A key equal for two groups whose placement leads to mirror-image states."""
        signature, halves_mirror = self._signature, self.cap is None
        top_first, top_size = self.top_of_gpu[first]
        path, lo, span = [], top_first, top_size
        while span > size:
            half = span // 2
            right = first >= lo + half
            # Mirror-image halves: either one leads to the same completions, so name the left one.
            # Not under a cap: a group spanning both gives its first GPUs a sequence's odd tokens.
            mirror = halves_mirror and signature(lo, half) == signature(lo + half, half)
            path.append(0 if mirror else int(right))
            lo, span = (lo + half if right else lo), half
        return c, top_size, signature(top_first, top_size), tuple(path)

    def _spread(self, k: int) -> tuple[int, list[int]] | None:
        """The sequences from the ``k``-th on on single GPUs, each where it finishes first: the step
        time that gives and their groups (``None`` if the cap leaves one without room)."""
        loads, tokens, cap, num_gpus = self.loads, self.tokens, self.cap, self.problem.num_gpus
        extra, extra_tokens, placed, top = [0] * num_gpus, [0] * num_gpus, [], 0
        for costs, length in zip(self.alone_cost[k:], self.seq_lens[k:], strict=True):
            fitting = [g for g, cost in enumerate(costs) if cost is not None
                       and (cap is None or tokens[g] + extra_tokens[g] + length <= cap)]  # fmt: skip
            if not fitting:
                return None
            finish, gpu = min((loads[g] + extra[g] + costs[g], g) for g in fitting)
            extra[gpu] += costs[gpu]
            extra_tokens[gpu] += length
            placed.append(self.single_group[gpu])
            top = max(top, finish)
        return top, placed

    def completes(self, k: int, current_max: int) -> bool:
        """Short sequences on single GPUs complete the branch: no completion beats the step time so
        far, and a completion just above it is still a good incumbent that cuts other branches."""
        if self.cheapest_alone[k] + min(self.loads) < self.best_max:
            completion = self._spread(k)
            if completion is not None and max(current_max, completion[0]) < self.best_max:
                self.best_max, self.best_assign = max(current_max, completion[0]), self.assign[:k] + completion[1]
                return self.best_max == current_max
        return False

    def cuts(self, k: int) -> bool:
        """With unequal speeds: whether the least work of the sequences left cannot fit under the
        incumbent (rounded down: float error must not cut the best branch)."""
        if self.speeds is None:
            return False
        work = sum(load * v for load, v in zip(self.loads, self.speeds, strict=True))
        return math.floor((work + self.work_left[k]) / self.speed_sum) >= self.best_max

    def branches(self, k: int, current_max: int) -> Iterator[tuple[int, int, int]]:
        loads, tokens, cap, run, canonical = self.loads, self.tokens, self.cap, self.run[k], self._canonical
        best_max, previous = self.best_max, self.assign[k - 1]  # neither changes until the options are placed
        seen, options = set(), []
        for g, first, size, cost, chunks, c in self.candidates[k]:
            if run == 2 and g < previous:
                continue
            new_max = max(loads[first : first + size]) + cost
            if new_max >= best_max:
                continue
            if cap is not None and any(t + x > cap for t, x in zip(tokens[first : first + size], chunks, strict=True)):
                continue
            if run == 0:
                key = canonical(first, size, c)
                if key in seen:
                    continue
                seen.add(key)
            options.append((max(current_max, new_max), size * cost, g, first, size, cost, chunks))
        # Most promising first (lowest step time so far, then fewest GPU-seconds): a good incumbent
        # early cuts the most branches.
        for new_max, gpu_seconds, g, first, size, cost, chunks in sorted(options):
            if new_max >= self.best_max:
                continue
            for m in range(size):
                loads[first + m] += cost
                tokens[first + m] += chunks[m]
            yield g, new_max, gpu_seconds
            for m in range(size):
                loads[first + m] -= cost
                tokens[first + m] -= chunks[m]
