"""One step's planning problem: flattened lengths, bag classes, quantised costs (:class:`Problem`).

Determinism: modeled costs are quantised once to int64 units (rounded down; the largest sequence
cost is 2**32 units), and every load, comparison and tie-break after that is exact integer
arithmetic ordered by ids. Float noise, such as a SIMD reduction order that differs between two
CPUs, cannot change a plan. Guarantees about max loads hold exactly in these units, so in
seconds to within one unit (2**-32 of the largest cost) per sequence. Lengths are integers taken
as they are, within limits that keep every sum exact (``MAX_STEP_TOKENS``), or refused.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from deepspeed_knap.cost.model import CostModel, index_ranges
from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.topology import Topology

# Largest quantised sequence cost. Sums of up to 2**20 such costs stay exact in float64 bincounts.
_COST_UNITS = 2**32
# The most tokens and sequences one step may hold, so that every sum the planner takes is exact: it
# sums token counts in int64 and in float64 (np.bincount, exact below 2**53), squares lengths in
# float64 (b * s**2, at most b * 2**80: far from overflow), and sums quantised costs, in float64
# bincounts too, of at most 2**20 sequences. 2**40 tokens (10**12) is some 10**5 times a large step.
MAX_STEP_TOKENS = 2**40
MAX_STEP_SEQUENCES = 2**20
_STEP_LIMIT = "the most the planner takes in a step (its sums stay exact below it)"


def _group_loads(
    cost_model: CostModel,
    seq_lens: np.ndarray,
    group_start: np.ndarray,
    group_size: np.ndarray,
    num_gpus: int,
    segment_squares: np.ndarray | None = None,
    gpus_per_node: int | None = None,
) -> np.ndarray:
    """``[S]`` modeled seconds: every GPU of a sequence's group spends the sequence's per-GPU time
    (``segment_squares`` ``[N]``: :meth:`CostModel.per_gpu_time`'s, or ``None``; ``gpus_per_node``:
    where nodes end, for the inter-node all-to-all, ``None``: one node)."""
    speeds: np.ndarray | float = 1.0
    across = None
    if cost_model.gpu_speed is not None:  # a group runs at its slowest GPU's speed
        gpu_speed = np.asarray(cost_model.gpu_speed, dtype=np.float64)
        if (gpu_speed == gpu_speed[0]).all():  # the online model's speeds before a rank is found slow
            speeds = float(gpu_speed[0])
        else:  # per distinct group, keyed by one integer (a 1-D unique: np.unique over columns is slow)
            keys, inverse = np.unique(group_start * (num_gpus + 1) + group_size, return_inverse=True)
            starts, sizes = np.divmod(keys, num_gpus + 1)
            speeds = np.array([gpu_speed[s : s + g].min() for s, g in zip(starts.tolist(), sizes.tolist(),
                                                                           strict=True)])[inverse]  # fmt: skip
    if gpus_per_node is not None and cost_model.prices_inter_node_alltoall:
        across = cost_model.cross_node_peers(group_start, group_size, gpus_per_node)
    per_gpu_s = cost_model.per_gpu_time(seq_lens, group_size, speeds, segment_squares, across)
    gpu_of_member = index_ranges(group_start, group_size)
    loads = np.bincount(gpu_of_member, weights=np.repeat(per_gpu_s, group_size), minlength=num_gpus)
    return loads + cost_model.gpu_overhead_s(num_gpus) if cost_model.overhead_s else loads


# ----------------------------------------------------------------------------------------------------
# The problem: flattened lengths, bag classes, quantised costs.


@dataclass(frozen=True)
class Problem:
    topology: Topology
    cost_model: CostModel
    cap: int | None
    seq_lens: np.ndarray  # [N] int64
    src: np.ndarray  # [N] int64 home rank
    bag_size: np.ndarray  # [B] int64
    bag_first: np.ndarray  # [B] int64
    bag_class: np.ndarray  # [B] int64
    class_size: np.ndarray  # [C] int64
    class_count: np.ndarray  # [C] int64 bags per class
    cost: np.ndarray  # [N, C] int64 quantised per-GPU cost of sequence i in a bag of class c
    tokens: np.ndarray  # [N, C] int64 tokens on the busiest GPU of the bag: ceil(s / G)
    allowed: np.ndarray  # [N, C] bool: the sequence fits a bag of the class under the cap
    seconds_per_unit: float  # modeled seconds of one quantised cost unit
    # Load and tokens every GPU of a bag holds before any sequence of this problem (work placed
    # elsewhere, the elastic planner's wide sequences; a slow GPU's larger fixed overhead); zero for
    # a plain problem.
    base_load: np.ndarray | None = None  # [B] int64
    base_tokens: np.ndarray | None = None  # [B] int64
    # With topology auto (whose groups overlap): the load every GPU holds before any sequence, its
    # fixed overhead above the least one (CostModel.overhead_s); None when all are equal.
    gpu_base: np.ndarray | None = None  # [S] int64
    # sum_k l_k**2 over each sequence's attention segments, what the cost model prices its attention
    # by (CostModel.per_gpu_time); None when no segments were given (every sequence one segment).
    segment_squares: np.ndarray | None = None  # [N] float64

    @classmethod
    def build(cls, seq_lens_per_rank, topology: Topology, cost_model: CostModel, cap: int | None,
              seq_segments_per_rank=None) -> Problem:  # fmt: skip
        """The step's problem. ``seq_segments_per_rank``: ``None``, or per rank (as the lengths) one
        ``[K]`` row of attention-segment lengths per sequence, summing to its length
        (:func:`_flatten_segments`)."""
        seq_lens, src = _flatten_lengths(seq_lens_per_rank, topology)
        segment_squares = None if seq_segments_per_rank is None else _flatten_segments(
            seq_segments_per_rank, seq_lens, src, topology.group_size)  # fmt: skip
        # Bags of a fixed topology; with ``auto``, every group a sequence may run in (they overlap).
        groups = np.asarray(topology.groups, dtype=np.int64).reshape(-1, 2)
        bag_first, bag_size = groups[:, 0].copy(), groups[:, 1].copy()
        bag_speed = cost_model.group_speeds(bag_first, bag_size, topology.group_size)
        # A class is bags of one size, speed and share of peers on other nodes (0 within a node).
        bag_across = cost_model.cross_node_peers(bag_first, bag_size, topology.gpus_per_node)
        bag_keys = list(zip(bag_size.tolist(), bag_speed.tolist(), bag_across.tolist(), strict=True))
        keys = sorted(set(bag_keys))
        bag_class = np.array([keys.index(k) for k in bag_keys], dtype=np.int64)
        class_size = np.array([k[0] for k in keys], dtype=np.int64)
        class_speed = np.array([k[1] for k in keys])
        class_across = np.array([k[2] for k in keys], dtype=np.int64)
        class_count = np.bincount(bag_class, minlength=len(keys)).astype(np.int64)

        # Every (length, degree) pair is priced here, and in _group_loads (a plan's loads), by the same
        # per_gpu_time: heads a degree does not divide (cost_model.num_heads), per-sequence work
        # every member repeats (sequence_coef) and the all-to-all to other nodes included.
        cost_s = cost_model.per_gpu_time(seq_lens[:, None], class_size[None, :], class_speed[None, :],
                                         None if segment_squares is None else segment_squares[:, None],
                                         class_across[None, :] if class_across.any() else None)  # fmt: skip
        scale = _COST_UNITS / cost_s.max() if seq_lens.size else 1.0
        # Rounding down keeps every quantised cost <= the true one, so bounds on them bound the truth.
        cost = np.floor(cost_s * scale).astype(np.int64)
        tokens = -(-seq_lens[:, None] // class_size[None, :])
        allowed = np.ones_like(tokens, dtype=bool) if cap is None else tokens <= cap
        across = class_size > (topology.gpus_per_node or topology.world_size)
        if topology.elastic and across.any() and not cost_model.prices_inter_node_alltoall:
            # A model without an inter-node all-to-all price would price crossing nodes as NVLink:
            # then groups of whole nodes are only for sequences that no group inside a node holds
            # under the cap (none without a cap). With the price, they are chosen where they pay.
            allowed[:, across] &= ~allowed[:, ~across].any(axis=1, keepdims=True)
        if cap is not None and seq_lens.size and not allowed.any(axis=1).all():
            i = int(np.flatnonzero(~allowed.any(axis=1))[0])
            rank, index = int(src[i]), i - int(np.searchsorted(src, src[i]))
            larger = "raise max_degree (above a node: groups of whole nodes)" if topology.elastic else (
                "use a topology with larger bags")  # fmt: skip
            raise ValueError(
                f"sequence {index} of rank {rank} has {seq_lens[i]} tokens: even the largest bag "
                f"({class_size.max()} GPUs) leaves {tokens[i].min()} tokens on one GPU, over "
                f"max_tokens_per_gpu={cap}. Raise max_tokens_per_gpu to at least {tokens[i].min()}, "
                f"{larger}, or drop sequences this long"
            )
        gpu_base = _overhead_units(cost_model, topology.group_size, scale, int(cost.max(axis=1, initial=0).sum()))
        base_load = None
        if gpu_base is not None and not topology.elastic:  # a bag's GPUs wait for its slowest one
            base_load = np.array([gpu_base[f : f + g].max() for f, g in zip(bag_first, bag_size, strict=True)])
            gpu_base = None
        return cls(topology, cost_model, cap, seq_lens, src, bag_size, bag_first, bag_class,
                   class_size, class_count, cost, tokens, allowed, 1.0 / scale, base_load, None, gpu_base,
                   segment_squares)  # fmt: skip

    @property
    def num_bags(self) -> int:
        return len(self.bag_size)

    @property
    def num_gpus(self) -> int:
        """``S``, GPUs of the balance group."""
        return self.topology.group_size

    @functools.cached_property
    def home_bag(self) -> np.ndarray:
        """``[N]`` the bag holding each sequence's home rank (bags are in rank order; a stage of the
        elastic planner may cover only some GPUs, and a home outside them gets the bag before it)."""
        return np.maximum(np.searchsorted(self.bag_first, self.src, side="right") - 1, 0)

    @functools.cached_property
    def home_covered(self) -> np.ndarray:
        """``[N]`` bool: the home rank lies in ``home_bag`` (always, unless the bags leave GPUs out)."""
        return self.src < self.bag_first[self.home_bag] + self.bag_size[self.home_bag]

    @functools.cached_property
    def gpu_seconds(self) -> np.ndarray:
        """``[N, C]`` quantised GPU-time of each sequence in a bag of each class: cost times G."""
        return self.cost * self.class_size[None, :]

    def bags_by_class(self) -> list[list[int]]:
        return [np.flatnonzero(self.bag_class == c).tolist() for c in range(len(self.class_size))]

    def bag_loads(self, bag_of_seq: np.ndarray) -> np.ndarray:
        """``[B]`` int64 quantised per-GPU load of each bag (exact: the sums stay below 2**53)."""
        cost = self.cost[np.arange(len(bag_of_seq)), self.bag_class[bag_of_seq]]
        return np.bincount(bag_of_seq, weights=cost, minlength=self.num_bags).astype(np.int64) + self.start_load

    def bag_tokens(self, bag_of_seq: np.ndarray) -> np.ndarray:
        """``[B]`` int64 tokens on each bag's busiest GPU (its first: near-equal chunks put the extra
        token of every sequence there)."""
        tokens = self.tokens[np.arange(len(bag_of_seq)), self.bag_class[bag_of_seq]]
        return np.bincount(bag_of_seq, weights=tokens, minlength=self.num_bags).astype(np.int64) + self.start_tokens

    @functools.cached_property
    def start_load(self) -> np.ndarray:
        """``[B]`` int64 ``base_load``, or zeros."""
        return np.zeros(self.num_bags, dtype=np.int64) if self.base_load is None else self.base_load

    @functools.cached_property
    def gpu_start_load(self) -> np.ndarray:
        """``[S]`` int64 ``gpu_base``, or zeros."""
        return np.zeros(self.num_gpus, dtype=np.int64) if self.gpu_base is None else self.gpu_base

    @functools.cached_property
    def start_tokens(self) -> np.ndarray:
        """``[B]`` int64 ``base_tokens``, or zeros."""
        return np.zeros(self.num_bags, dtype=np.int64) if self.base_tokens is None else self.base_tokens

    @functools.cached_property
    def interchangeable(self) -> np.ndarray:
        """``[B]`` int64 ids: bags with equal ids (same class, base load and base tokens) can trade
        their whole contents without changing any load."""
        # The rank of each bag's (class, base load, base tokens) among the distinct ones, as
        # np.unique(axis=0) numbers them, by a lexsort (np.unique on rows is slow for 1,024 bags).
        order = np.lexsort((self.start_tokens, self.start_load, self.bag_class))
        keys = np.stack([self.bag_class, self.start_load, self.start_tokens], axis=1)[order]
        rank = np.concatenate([[0], np.cumsum((keys[1:] != keys[:-1]).any(axis=1))])
        interchangeable = np.empty(self.num_bags, dtype=np.int64)
        interchangeable[order] = rank
        return interchangeable

    @functools.cached_property
    def barred_within_cap(self) -> bool:
        """Whether :attr:`allowed` bars a sequence from a class whose share fits the cap (``auto``'s
        groups of whole nodes): the searches that check only tokens against the cap must then check
        :attr:`allowed` too."""
        fits = np.ones_like(self.allowed) if self.cap is None else self.tokens <= self.cap
        return bool((fits & ~self.allowed).any())

    def fits_cap(self, bag_of_seq: np.ndarray) -> bool:
        """Whether every bag stays under the cap and every sequence is in a class it is allowed in."""
        if self.barred_within_cap and not self.allowed[np.arange(len(bag_of_seq)), self.bag_class[bag_of_seq]].all():
            return False
        return self.cap is None or bool(np.all(self.bag_tokens(bag_of_seq) <= self.cap))

    @functools.cached_property
    def lower_bound(self) -> int:
        """Quantised load no assignment of sequences to bags can beat.

        For a makespan ``T``, sequence ``i`` may only use classes where its cost is ``<= T`` (and that
        fit the cap). Any assignment with makespan ``T`` then (1) spends at least
        ``sum_i min_c G_c * cost[i, c]`` GPU-seconds over allowed ``c``, which cannot exceed ``S * T``,
        and (2) puts the sequences allowed in one class only into that class, whose ``n_c`` bags hold
        at most ``n_c * T``. Both tests get easier as ``T`` grows, so the smallest ``T`` passing both
        is a lower bound. Within test (2), ``n_c`` bags holding the ``t * n_c + 1`` largest forced
        sequences put ``t + 1`` of them in one bag. The allowed sets only change at cost values
        (breakpoints): binary search for the interval, inside which both tests are linear in ``T``.

        With unequal speeds test (1) also counts work at speed 1: GPU ``g`` does at most
        ``(T - base_g) * speed_g`` of it by ``T``, and a sequence in a bag of class ``c`` takes
        ``G_c * cost[i, c] * speed_c`` (a bag runs at its slowest GPU's speed). Without it, a slow
        GPU counts as a fast one and the bound is loose wherever speeds differ.
        """
        if not self.seq_lens.size:
            return 0
        group_size = self.num_gpus
        masked = np.iinfo(np.int64).max
        gpu_time = np.where(self.allowed, self.gpu_seconds, masked)
        gpu_base = self.gpu_start_load
        base = int((self.start_load * self.bag_size).sum() + gpu_base.sum())  # GPU-seconds already placed
        speed = self.gpu_speed
        if speed is not None:  # work at speed 1: of each sequence in each class, and already placed
            work = np.where(self.allowed, self.speed_work, np.inf)
            # Float sums with math.fsum, exactly rounded: NumPy's summation order may differ between
            # CPUs, and every rank must compute the same bound.
            bag_speed_sum = [
                math.fsum(speed[f : f + g].tolist()) for f, g in zip(self.bag_first, self.bag_size, strict=True)
            ]
            base_work = math.fsum([*(load * v for load, v in zip(self.start_load.tolist(), bag_speed_sum, strict=True)),
                                   *(b * v for b, v in zip(gpu_base.tolist(), speed.tolist(), strict=True))])  # fmt: skip
            speed_sum = math.fsum(speed.tolist())

        def enough_for(usable: np.ndarray) -> int:
            """Smallest ``T`` test (1) allows with the classes ``usable`` ``[N, C]``."""
            need = -(-(base + int(np.where(usable, gpu_time, masked).min(axis=1).sum())) // group_size)
            if speed is not None:  # rounded down: float error must not lift a bound over the optimum
                least_work = np.where(usable, work, np.inf).min(axis=1).tolist()
                need = max(need, math.floor(math.fsum([base_work, *least_work]) / speed_sum))
            return need

        # No T below these passes: some sequence fits nowhere, a bag or GPU is already over, or even
        # the cheapest choices overflow.
        floor = max(int(np.where(self.allowed, self.cost, masked).min(axis=1).max()), int(self.start_load.max()),
                    int(gpu_base.max()), enough_for(self.allowed))  # fmt: skip
        breakpoints = np.concatenate([[floor], np.unique(self.cost[self.allowed & (self.cost > floor)])])

        def smallest_within(t: int) -> float:
            """Smallest T >= t passing both tests with the allowed sets of t (inf if none covers)."""
            usable = self.allowed & (self.cost <= t)
            if not usable.any(axis=1).all():
                return np.inf
            need = max(t, enough_for(usable))
            single = usable.sum(axis=1) == 1
            if single.any():
                only_class = usable[single].argmax(axis=1)
                forced_cost = self.cost[single, only_class]
                for c in np.unique(only_class).tolist():
                    need = max(need, _pigeonhole_bound(forced_cost[only_class == c], int(self.class_count[c])))
            return need

        # Smallest index whose breakpoint passes; len(breakpoints) if none does (then the sets are final).
        lo, hi = 0, len(breakpoints)
        while lo < hi:
            mid = (lo + hi) // 2
            if smallest_within(int(breakpoints[mid])) <= breakpoints[mid]:
                hi = mid
            else:
                lo = mid + 1
        if lo == 0:
            return int(breakpoints[0])
        beyond = smallest_within(int(breakpoints[lo - 1]))
        return int(beyond if lo == len(breakpoints) else min(beyond, breakpoints[lo]))

    @functools.cached_property
    def gpu_speed(self) -> np.ndarray | None:
        """``[S]`` each GPU's speed, or ``None`` when they are all equal."""
        speed = self.cost_model.gpu_speed
        return None if speed is None or len(set(speed)) == 1 else np.asarray(speed, dtype=np.float64)

    @functools.cached_property
    def speed_work(self) -> np.ndarray:
        """``[N, C]`` float64 work at speed 1 of each sequence in a bag of each class: its GPU-time
        times the class's speed (a bag runs at its slowest GPU's). A GPU of speed ``v`` does ``v``
        of it per unit of load, which bounds the step time where speeds differ."""
        class_speed = np.zeros(len(self.class_size))
        class_speed[self.bag_class] = self.cost_model.group_speeds(self.bag_first, self.bag_size, self.num_gpus)
        return self.gpu_seconds * class_speed[None, :]

    def make_plan(self, solver: str, group_start: np.ndarray, group_size: np.ndarray) -> RoutingPlan:
        """Cut every sequence into near-equal contiguous chunks over its group and price the result."""
        n = len(self.seq_lens)
        chunk_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(group_size, out=chunk_offsets[1:])
        seq_of_chunk = np.repeat(np.arange(n), group_size)
        position = np.arange(chunk_offsets[-1]) - chunk_offsets[seq_of_chunk]
        base = (self.seq_lens // group_size)[seq_of_chunk]
        extra = (self.seq_lens % group_size)[seq_of_chunk]
        chunk_len = base + (position < extra)
        chunk_start = position * base + np.minimum(position, extra)
        chunk_gpu = group_start[seq_of_chunk] + position

        gpu_loads = self._gpu_loads(group_start, group_size)
        arrays = [self.seq_lens, self.src, group_start.astype(np.int64), group_size.astype(np.int64), chunk_offsets,
                  chunk_gpu, chunk_start, chunk_len, gpu_loads]  # fmt: skip
        for array in arrays:
            array.setflags(write=False)
        return RoutingPlan(self.topology.spec, solver, *arrays, self.lower_bound_s, self.cap)

    def tiling_problem(self, seqs: np.ndarray, bags: np.ndarray, base_load: np.ndarray,
                       base_tokens: np.ndarray) -> Problem:  # fmt: skip
        """The sequences ``seqs`` over the disjoint groups ``bags`` (ids of this problem's groups) as
        the bags of a fixed topology, every GPU of bag ``k`` already holding ``base_load[k]`` and
        ``base_tokens[k]``: a stage of the elastic planner. Bag ``k`` of the result is group
        ``bags[k]``."""
        classes, bag_class = np.unique(self.bag_class[bags], return_inverse=True)
        bag_size, bag_first = self.bag_size[bags], self.bag_first[bags]
        topology = Topology(f"tiling of {self.topology.spec}", tuple(bag_size.tolist()), tuple(bag_first.tolist()),
                            self.num_gpus, self.topology.gpus_per_node, True)  # fmt: skip
        return Problem(topology, self.cost_model, self.cap, self.seq_lens[seqs], self.src[seqs], bag_size, bag_first,
                        bag_class.ravel().astype(np.int64), self.class_size[classes],
                        np.bincount(bag_class.ravel(), minlength=len(classes)).astype(np.int64),
                        self.cost[seqs][:, classes], self.tokens[seqs][:, classes], self.allowed[seqs][:, classes],
                        self.seconds_per_unit, base_load, base_tokens, None,
                        None if self.segment_squares is None else self.segment_squares[seqs])  # fmt: skip

    def make_home_plan(self, solver: str) -> RoutingPlan:
        """Every sequence alone on its home GPU (Ulysses degree 1, no bag)."""
        return self.make_plan(solver, self.src, np.ones_like(self.src))

    def _gpu_loads(self, group_start: np.ndarray, group_size: np.ndarray) -> np.ndarray:
        return _group_loads(self.cost_model, self.seq_lens, group_start, group_size, self.topology.group_size,
                            self.segment_squares, self.topology.gpus_per_node)  # fmt: skip

    @functools.cached_property
    def home_max_load_s(self) -> float:
        """Modeled step time of keeping every sequence alone on its home GPU."""
        return float(self._gpu_loads(self.src, np.ones_like(self.src)).max()) if self.seq_lens.size else 0.0

    @functools.cached_property
    def lower_bound_s(self) -> float:
        """Seconds no plan of ours can beat: the topology bound, or running everything at home, or,
        where moving tokens is priced on a fixed topology, keeping some sequences home and the rest
        in bags (:meth:`_mixed_bound_s`: ``refine`` brings home what moving does not pay). The
        quantised loads leave out the overhead every GPU pays (the least one): it is added back."""
        least_overhead = (
            float(self.cost_model.gpu_overhead_s(self.num_gpus).min()) if self.cost_model.overhead_s else 0.0
        )
        bound = min(self.lower_bound * self.seconds_per_unit + least_overhead, self.home_max_load_s)
        if self.cost_model.prices_routes and not self.topology.elastic:  # auto's groups of 1 hold home already
            bound = min(bound, self._mixed_bound_s())
        return bound

    def _mixed_bound_s(self) -> float:
        """Seconds no plan can beat that keeps each sequence home or puts it in a bag: the costliest
        sequence at its cheapest, and the GPU-seconds of every sequence at its cheapest spread over
        every GPU, with the GPUs' overheads (moving tokens costs more, never less: left out)."""
        if not self.seq_lens.size:
            return 0.0
        home_speed = self.cost_model.group_speeds(self.src, np.ones_like(self.src), self.num_gpus)  # alone at home
        home = self.cost_model.per_gpu_time(self.seq_lens, 1, home_speed, self.segment_squares)  # [N]
        in_bags = np.where(self.allowed, self.cost, np.iinfo(np.int64).max)  # quantised down: at most the truth
        piece = np.minimum(home, in_bags.min(axis=1) * self.seconds_per_unit)
        bag_gpu_s = np.where(self.allowed, self.gpu_seconds, np.iinfo(np.int64).max).min(axis=1) * self.seconds_per_unit
        overhead = self.cost_model.gpu_overhead_s(self.num_gpus) if self.cost_model.overhead_s else np.zeros(1)
        spread = math.fsum([*overhead.tolist(), *np.minimum(home, bag_gpu_s).tolist()]) / self.num_gpus
        return max(float(piece.max()) + float(overhead.min()), spread)

    def fits_cap_at_home(self) -> bool:
        home_tokens = np.bincount(self.src, weights=self.seq_lens, minlength=self.topology.group_size)
        return self.cap is None or bool(home_tokens.max(initial=0) <= self.cap)


def _overhead_units(cost_model: CostModel, num_gpus: int, scale: float, total_cost: int) -> np.ndarray | None:
    """``[S]`` int64 each GPU's fixed overhead above the least one, in cost units of ``scale`` per
    second, or ``None`` when they are all equal (no speeds, or no overhead): a load every GPU pays
    alike changes no plan. Rounded down, so bounds on them stay bounds. In ascending order, each gap
    to the one before is held to ``total_cost + 1`` (all of the step's work, each sequence at its
    costliest): a GPU further behind gets nothing in any plan and stays the busiest, so that changes
    no plan, and loads stay in the range the sequences' costs give them. Equal overheads stay equal
    (held values, not gaps, gave the second of two equally slow GPUs a step of work more than the
    first, which then took work for free and became the busiest)."""
    if not cost_model.overhead_s or cost_model.gpu_speed is None:
        return None
    overhead = cost_model.gpu_overhead_s(num_gpus)
    extra = np.floor((overhead - overhead.min()) * scale)
    capped, held, before = np.zeros(num_gpus, dtype=np.int64), 0, 0.0
    for gpu in np.argsort(extra, kind="stable").tolist():
        held = capped[gpu] = held + int(min(extra[gpu] - before, total_cost + 1))
        before = extra[gpu]
    return capped if capped.any() else None


def _pigeonhole_bound(costs: np.ndarray, bags: int) -> int:
    """Load some bag must reach when ``costs`` all go to ``bags`` identical bags.

    Total over bags (rounded up), and for every ``t >= 1``: the ``t * bags + 1`` largest costs put
    ``t + 1`` of them in one bag, which carries at least the ``t + 1`` smallest of those.
    """
    descending = np.sort(costs)[::-1]
    prefix = np.concatenate([[0], np.cumsum(descending)])
    bound = -(-int(prefix[-1]) // bags)
    t = np.arange(1, (len(costs) - 1) // bags + 1)
    if t.size:
        bound = max(bound, int(np.max(prefix[t * bags + 1] - prefix[t * bags - t])))
    return bound


def _flatten_lengths(seq_lens_per_rank, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """``[N]`` int64 lengths and ``[N]`` home ranks, validated: every length an integer (a Python or
    NumPy one: a float or a bool is refused, never cast) from 1 to ``MAX_STEP_TOKENS``, and at most
    ``MAX_STEP_TOKENS`` tokens and ``MAX_STEP_SEQUENCES`` sequences in all. An error names the rank,
    the index and the value, on one line."""
    if len(seq_lens_per_rank) != topology.group_size:
        raise ValueError(
            f"got sequence lengths for {len(seq_lens_per_rank)} ranks, but topology {topology.spec!r} has "
            f"{topology.group_size} GPUs per balance group; pass one list per rank of the balance group"
        )
    per_rank, num_tokens, num_seqs = [], 0, 0
    for rank, lengths in enumerate(seq_lens_per_rank):
        values = _rank_lengths(rank, lengths)
        if num_seqs + len(values) > MAX_STEP_SEQUENCES:
            raise ValueError(
                f"rank {rank}: sequence {MAX_STEP_SEQUENCES - num_seqs} brings the step to {MAX_STEP_SEQUENCES + 1} "
                f"sequences, over 2**{MAX_STEP_SEQUENCES.bit_length() - 1}, {_STEP_LIMIT}; plan fewer sequences per step"
            )
        num_seqs += len(values)
        # Exact: Python ints, or at most 2**20 NumPy integers of at most 2**40.
        rank_tokens = int(values.sum()) if isinstance(values, np.ndarray) else sum(values)
        if num_tokens + rank_tokens > MAX_STEP_TOKENS:
            running = num_tokens + np.cumsum(values, dtype=np.int64)
            index = int(np.argmax(running > MAX_STEP_TOKENS))
            raise ValueError(
                f"rank {rank}: sequence {index} brings the step to {int(running[index])} tokens, over "
                f"2**{MAX_STEP_TOKENS.bit_length() - 1}, {_STEP_LIMIT}; plan fewer or shorter sequences per step"
            )
        num_tokens += rank_tokens
        per_rank.append(values)
    # One conversion for all ranks: each value is an integer of at most 2**40, so none is cast.
    seq_lens = np.fromiter(itertools.chain.from_iterable(per_rank), dtype=np.int64, count=num_seqs)
    src = np.repeat(np.arange(len(per_rank), dtype=np.int64), [len(values) for values in per_rank])
    return seq_lens, src


def _flatten_segments(seq_segments_per_rank, seq_lens: np.ndarray, src: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[N]`` float64 ``sum_k l_k**2`` of every sequence's attention segments, validated: one row
    per sequence of each rank (a list or an ``[N_r, K]`` integer array), each row of non-negative
    integers that sums to the sequence's length. An error names the rank, the index and the row."""
    if len(seq_segments_per_rank) != num_gpus:
        raise ValueError(
            f"got attention segments for {len(seq_segments_per_rank)} ranks, but the balance group has {num_gpus} "
            "GPUs; pass one list of segment rows per rank, as the lengths"
        )
    squares = np.empty(len(seq_lens), dtype=np.float64)
    counts = np.bincount(src, minlength=num_gpus)
    first = 0
    for rank, rows in enumerate(seq_segments_per_rank):
        rows = list(rows)
        if len(rows) != counts[rank]:
            raise ValueError(
                f"rank {rank}: {len(rows)} rows of attention segments for {counts[rank]} sequences; give one row "
                "(the sequence's segment lengths) per sequence"
            )
        for index, row in enumerate(rows):
            values = list(row) if np.ndim(row) else [row]
            if not values or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0
                                 for v in values):  # fmt: skip
                raise ValueError(
                    f"rank {rank}: sequence {index} has attention segments {values!r}; a row is one or more "
                    "non-negative integer token counts (0 for an absent segment)"
                )
            length = int(seq_lens[first + index])
            if sum(int(v) for v in values) != length:
                raise ValueError(
                    f"rank {rank}: sequence {index} has attention segments {[int(v) for v in values]} summing to "
                    f"{sum(int(v) for v in values)}, but its length is {length}; the segments must cover the "
                    "sequence exactly"
                )
            # As segment_square_sums: exact Python integers, rounded once to float64.
            squares[first + index] = float(sum(int(v) * int(v) for v in values))
        first += len(rows)
    return squares


def _rank_lengths(rank: int, lengths) -> list | np.ndarray:
    """One rank's lengths, each checked to be an integer from 1 to ``MAX_STEP_TOKENS`` before any
    cast: a NumPy integer array as it is (compared in its own dtype), anything else as a list."""
    if isinstance(lengths, np.ndarray) and lengths.ndim == 1 and lengths.dtype.kind in "iu":
        values = lengths
        out_of_range = bool(values.size) and (values.min() < 1 or values.max() > MAX_STEP_TOKENS)
    else:
        try:
            values = lengths if isinstance(lengths, list) else list(lengths)
        except TypeError:  # not a list at all
            raise _nesting_error(rank, lengths) from None
        if set(map(type, values)) - {int}:  # not all Python ints: the first that is no integer is refused
            for index, value in enumerate(values):
                if isinstance(value, (list, tuple, np.ndarray)):
                    raise _nesting_error(rank, lengths)
                if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                    raise _not_an_integer_error(rank, index, value)
        out_of_range = bool(values) and (min(values) < 1 or max(values) > MAX_STEP_TOKENS)
    if out_of_range:
        index = next(k for k, value in enumerate(values) if not 1 <= value <= MAX_STEP_TOKENS)
        value = int(values[index])
        if value < 1:
            raise ValueError(
                f"rank {rank}: sequence {index} has length {value}; every length must be a positive token count "
                "(drop empty samples before planning; a rank may have no sequences)"
            )
        raise ValueError(
            f"rank {rank}: sequence {index} has length {value}, over 2**{MAX_STEP_TOKENS.bit_length() - 1} tokens, "
            f"{_STEP_LIMIT}; split or drop this sequence"
        )
    return values


def _not_an_integer_error(rank: int, index: int, value) -> ValueError:
    shown = value.item() if isinstance(value, np.generic) else value
    if isinstance(shown, bool):
        fix = " (a bool is none): pass the sequence's token count"
    elif isinstance(shown, float) and shown.is_integer() and 1 <= shown <= MAX_STEP_TOKENS:
        fix = f" (a float is refused, not cast): pass int(length), {int(shown)}"
    else:
        fix = ": fix what computed it"
    return ValueError(
        f"rank {rank}: sequence {index} has length {shown!r} (a {type(value).__name__}); a length must be an integer "
        f"token count (int or NumPy integer) from 1 to 2**{MAX_STEP_TOKENS.bit_length() - 1}{fix}"
    )


def _nesting_error(rank: int, lengths) -> ValueError:
    shown = " ".join(repr(lengths).split())  # on one line, at most 80 characters
    return ValueError(
        f"rank {rank}: sequence lengths must be a flat list of token counts, one per sequence; got "
        f"{shown if len(shown) <= 80 else shown[:77] + '...'}"
    )
