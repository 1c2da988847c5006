"""The planner: per-rank sequence lengths + topology + workload model -> :class:`RoutingPlan`.

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
  modeled max load, and it honours ``max_tokens_per_gpu``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from deepspeed_knap.topology import Topology
from deepspeed_knap.workload import WorkloadModel

SOLVERS = ("none", "knapformer", "refine")
DEFAULT_SOLVER = "refine"
DEFAULT_REFINE_STEPS = 256
# Local search stops once the max load is within this fraction of the lower bound: the workload
# model is far coarser than that.
REFINE_TOLERANCE = 1e-3
# ... and once this many steps in a row (or B, if fewer bags) cut the max by less than that.
STALL_WINDOW = 32
# Swaps are tried with the sequences of the least-loaded bags, the likeliest partners, up to this many.
SWAP_CANDIDATES = 64
# Bags of a class are interchangeable for a move, so only the lightest few of each class are tried
# (more than one: under a memory cap the lightest may lack room).
MOVE_TARGETS_PER_CLASS = 4
# Two-step chains start from this many of the busiest bag's largest sequences (a chain costs a full
# step search per try).
CHAIN_STARTS = 4
# Steps with at most this many sequences are finished by an exact branch and bound (few sequences
# per GPU is where one bad placement costs the most), within a node budget.
EXACT_MAX_SEQUENCES = 16
EXACT_NODE_BUDGET = 20_000
# Largest quantised sequence cost. Sums of up to 2**20 such costs stay exact in float64 bincounts.
_COST_UNITS = 2**32


@dataclass(frozen=True, eq=False)
class RoutingPlan:
    """Where every token of one step goes, and the modeled loads that result.

    Sequence ``i``'s tokens are cut into contiguous chunks, one per GPU of its group, in rank order:
    chunk ``k`` in ``chunk_offsets[i]:chunk_offsets[i+1]`` holds tokens
    ``[chunk_start[k], chunk_start[k] + chunk_len[k])`` on rank ``chunk_gpu[k]``. A chunk may be empty
    when the sequence is shorter than its group. The group (``seq_group_start``, ``seq_group_size``)
    is the GPUs that run the sequence's attention together; for topology bags it is one bag.
    All ranks are positions inside the balance group (0 .. S-1).

    Attributes:
        topology_spec: topology the plan was made for.
        solver: solver name.
        seq_lens: ``[N]`` int64 token counts.
        seq_src_rank: ``[N]`` int64 rank that holds the sequence before routing.
        seq_group_start: ``[N]`` int64 first rank of the sequence's group.
        seq_group_size: ``[N]`` int64 GPUs in that group (the Ulysses degree).
        chunk_offsets: ``[N + 1]`` int64 CSR offsets into the chunk arrays.
        chunk_gpu, chunk_start, chunk_len: ``[K]`` int64 chunk placement.
        gpu_loads: ``[S]`` float64 modeled seconds per GPU.
        lower_bound: modeled seconds no plan can beat, over plans that use the topology's bags or keep
            every sequence alone on its home GPU (0.0 when ``N == 0``).
        max_tokens_per_gpu: the memory cap the plan was asked to honour, or ``None``.
    """

    topology_spec: str
    solver: str
    seq_lens: np.ndarray
    seq_src_rank: np.ndarray
    seq_group_start: np.ndarray
    seq_group_size: np.ndarray
    chunk_offsets: np.ndarray
    chunk_gpu: np.ndarray
    chunk_start: np.ndarray
    chunk_len: np.ndarray
    gpu_loads: np.ndarray
    lower_bound: float
    max_tokens_per_gpu: int | None

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_loads)

    @property
    def max_load(self) -> float:
        """Modeled step time: the busiest GPU's seconds."""
        return float(self.gpu_loads.max()) if self.gpu_loads.size else 0.0

    @property
    def imbalance(self) -> float:
        """Max over mean modeled GPU load (1.0 is perfect; 1.0 when every load is 0)."""
        mean = float(self.gpu_loads.mean()) if self.gpu_loads.size else 0.0
        return self.max_load / mean if mean > 0 else 1.0

    @property
    def gpu_tokens(self) -> np.ndarray:
        """``[S]`` int64 tokens each GPU holds after routing."""
        return np.bincount(self.chunk_gpu, weights=self.chunk_len, minlength=self.num_gpus).astype(np.int64)

    @property
    def tokens_moved(self) -> int:
        """Tokens that leave their home rank (each comes back in the reverse route)."""
        home = np.repeat(self.seq_src_rank, np.diff(self.chunk_offsets))
        return int(self.chunk_len[self.chunk_gpu != home].sum())

    @property
    def tokens_moved_fraction(self) -> float:
        """Fraction of all tokens that leave their home rank."""
        total = int(self.seq_lens.sum())
        return self.tokens_moved / total if total else 0.0

    @functools.cached_property
    def fingerprint(self) -> int:
        """A 63-bit digest of where every token goes: equal plans have equal fingerprints, and ranks
        compare them to catch one rank routing with a plan from another step."""
        digest = hashlib.blake2b(self.topology_spec.encode(), digest_size=8)
        for array in (self.seq_lens, self.seq_src_rank, self.seq_group_start, self.seq_group_size):
            digest.update(array.tobytes())
        return int.from_bytes(digest.digest(), "little") >> 1

    def __eq__(self, other: object) -> bool:
        """Bitwise equality of every field (arrays compared element by element, dtypes included)."""
        if not isinstance(other, RoutingPlan):
            return NotImplemented
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, np.ndarray):
                if mine.dtype != theirs.dtype or mine.shape != theirs.shape or mine.tobytes() != theirs.tobytes():
                    return False
            elif mine != theirs:
                return False
        return True

    __hash__ = None  # mutable-looking arrays inside: plans are compared, not hashed


def plan_routing(
    seq_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    workload: WorkloadModel,
    solver: str = DEFAULT_SOLVER,
    max_tokens_per_gpu: int | None = None,
    refine_steps: int = DEFAULT_REFINE_STEPS,
) -> RoutingPlan:
    """Plan one step for one balance group.

    Args:
        seq_lens_per_rank: ``S`` lists, one per rank of the balance group, of that rank's sequence
            lengths (tokens). An empty list is a rank with nothing this step.
        topology: bag layout; only its balance group (``topology.group_size`` ranks) is planned.
        workload: cost model.
        solver: one of :data:`SOLVERS`.
        max_tokens_per_gpu: hard cap on tokens a GPU may hold after routing. ``refine`` honours it;
            ``none`` raises when a rank's own tokens exceed it; ``knapformer`` cannot honour it and
            raises when given one.
        refine_steps: local-search step budget of ``refine`` (a count, not a time, so plans stay
            deterministic).

    Raises:
        ValueError: wrong number of ranks, non-positive or non-integer lengths, an unknown solver, a
            sequence no bag can hold under the cap, or a cap the planner finds no assignment for.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if max_tokens_per_gpu is not None and (
        isinstance(max_tokens_per_gpu, bool)
        or not isinstance(max_tokens_per_gpu, (int, np.integer))
        or max_tokens_per_gpu <= 0
    ):
        raise ValueError(f"max_tokens_per_gpu must be a positive integer or None; got {max_tokens_per_gpu!r}")
    if refine_steps < 0:
        raise ValueError(f"refine_steps must be >= 0; got {refine_steps}")
    with _gc_paused():
        return _solve(seq_lens_per_rank, topology, workload, solver, max_tokens_per_gpu, refine_steps)


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


def _solve(seq_lens_per_rank, topology: Topology, workload: WorkloadModel, solver: str,
           max_tokens_per_gpu: int | None, refine_steps: int) -> RoutingPlan:  # fmt: skip
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
    problem = _Problem.build(seq_lens_per_rank, topology, workload, max_tokens_per_gpu)
    if solver == "none":
        if not problem.fits_cap_at_home():  # nothing moves: the cap holds or it is an error, never an OOM
            home_tokens = np.bincount(problem.src, weights=problem.seq_lens, minlength=problem.num_gpus)
            rank = int(np.argmax(home_tokens))
            raise ValueError(
                f"solver 'none' keeps every sequence home, and rank {rank} holds {int(home_tokens[rank])} tokens, over "
                f"max_tokens_per_gpu={max_tokens_per_gpu}; balance with solver 'refine', or raise the cap"
            )
        return problem.make_home_plan(solver)
    if topology.elastic:
        from deepspeed_knap.elastic import solve_elastic  # builds on this module's refine

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
        return problem.make_home_plan(solver)
    plan = problem.make_plan(solver, problem.bag_first[bag_of_seq], problem.bag_size[bag_of_seq])
    if home_fits and problem.home_max_load_s <= plan.max_load:
        return problem.make_home_plan(solver)
    return plan


def lower_bound(
    seq_lens_per_rank: Sequence[Sequence[int]],
    topology: Topology,
    workload: WorkloadModel,
    max_tokens_per_gpu: int | None = None,
) -> float:
    """Modeled seconds no plan over ``topology``'s groups (or keeping every sequence home) can beat:
    the ``lower_bound`` every plan of these lengths carries, without solving. With topology ``auto``
    it is the bound for giving every sequence its own Ulysses degree.

    Raises:
        ValueError: as :func:`plan_routing`, for bad lengths or a sequence no group holds under the cap.
    """
    with _gc_paused():
        return _Problem.build(seq_lens_per_rank, topology, workload, max_tokens_per_gpu).lower_bound_s


def plan_loads(plan: RoutingPlan, workload: WorkloadModel) -> np.ndarray:
    """``[S]`` modeled seconds per GPU of running ``plan`` under ``workload``, which may differ from
    the model the plan was solved with: what a plan made with a wrong model really costs.

    Raises:
        ValueError: ``workload.gpu_speed`` does not list one speed per GPU of the plan.
    """
    if workload.gpu_speed is not None and len(workload.gpu_speed) != plan.num_gpus:
        raise ValueError(
            f"gpu_speed has {len(workload.gpu_speed)} entries but the plan has {plan.num_gpus} GPUs; give one per GPU"
        )
    return _group_loads(workload, plan.seq_lens, plan.seq_group_start, plan.seq_group_size, plan.num_gpus)


def _group_loads(
    workload: WorkloadModel, seq_lens: np.ndarray, group_start: np.ndarray, group_size: np.ndarray, num_gpus: int
) -> np.ndarray:
    """``[S]`` modeled seconds: every GPU of a sequence's group spends the sequence's per-GPU time."""
    speeds: np.ndarray | float = 1.0
    if workload.gpu_speed is not None:  # a group runs at its slowest GPU's speed
        gpu_speed = np.asarray(workload.gpu_speed, dtype=np.float64)
        pairs, inverse = np.unique(np.stack([group_start, group_size]), axis=1, return_inverse=True)
        speeds = np.array([gpu_speed[s : s + g].min() for s, g in pairs.T])[inverse.ravel()]
    per_gpu_s = workload.per_gpu_time(seq_lens, group_size, speeds)
    gpu_of_member = np.repeat(group_start, group_size) + (
        np.arange(int(group_size.sum())) - np.repeat(np.cumsum(group_size) - group_size, group_size)
    )
    loads = np.bincount(gpu_of_member, weights=np.repeat(per_gpu_s, group_size), minlength=num_gpus)
    return loads + workload.gpu_overhead_s(num_gpus) if workload.overhead_s else loads


# ----------------------------------------------------------------------------------------------------
# The problem: flattened lengths, bag classes, quantised costs.


@dataclass(frozen=True)
class _Problem:
    topology: Topology
    workload: WorkloadModel
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
    # fixed overhead above the least one (WorkloadModel.overhead_s); None when all are equal.
    gpu_base: np.ndarray | None = None  # [S] int64

    @classmethod
    def build(cls, seq_lens_per_rank, topology: Topology, workload: WorkloadModel, cap: int | None) -> _Problem:
        seq_lens, src = _flatten_lengths(seq_lens_per_rank, topology)
        # Bags of a fixed topology; with ``auto``, every group a sequence may run in (they overlap).
        groups = np.asarray(topology.groups, dtype=np.int64).reshape(-1, 2)
        bag_first, bag_size = groups[:, 0].copy(), groups[:, 1].copy()
        bag_speed = workload.group_speeds(bag_first, bag_size, topology.group_size)
        keys = sorted(set(zip(bag_size.tolist(), bag_speed.tolist(), strict=True)))
        bag_class = np.array(
            [keys.index(k) for k in zip(bag_size.tolist(), bag_speed.tolist(), strict=True)], dtype=np.int64
        )
        class_size = np.array([k[0] for k in keys], dtype=np.int64)
        class_speed = np.array([k[1] for k in keys])
        class_count = np.bincount(bag_class, minlength=len(keys)).astype(np.int64)

        cost_s = workload.per_gpu_time(seq_lens[:, None], class_size[None, :], class_speed[None, :])
        scale = _COST_UNITS / cost_s.max() if seq_lens.size else 1.0
        # Rounding down keeps every quantised cost <= the true one, so bounds on them bound the truth.
        cost = np.floor(cost_s * scale).astype(np.int64)
        tokens = -(-seq_lens[:, None] // class_size[None, :])
        allowed = np.ones_like(tokens, dtype=bool) if cap is None else tokens <= cap
        across = class_size > (topology.gpus_per_node or topology.world_size)
        if topology.elastic and across.any():
            # The workload model prices no all-to-all between nodes: groups of whole nodes are only
            # for sequences that no group inside a node holds under the cap (none without a cap).
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
        gpu_base = _overhead_units(workload, topology.group_size, scale, int(cost.max(axis=1, initial=0).sum()))
        base_load = None
        if gpu_base is not None and not topology.elastic:  # a bag's GPUs wait for its slowest one
            base_load = np.array([gpu_base[f : f + g].max() for f, g in zip(bag_first, bag_size, strict=True)])
            gpu_base = None
        return cls(topology, workload, cap, seq_lens, src, bag_size, bag_first, bag_class,
                   class_size, class_count, cost, tokens, allowed, 1.0 / scale, base_load, None, gpu_base)  # fmt: skip

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
        speed = self.workload.gpu_speed
        return None if speed is None or len(set(speed)) == 1 else np.asarray(speed, dtype=np.float64)

    @functools.cached_property
    def speed_work(self) -> np.ndarray:
        """``[N, C]`` float64 work at speed 1 of each sequence in a bag of each class: its GPU-time
        times the class's speed (a bag runs at its slowest GPU's). A GPU of speed ``v`` does ``v``
        of it per unit of load, which bounds the step time where speeds differ."""
        class_speed = np.zeros(len(self.class_size))
        class_speed[self.bag_class] = self.workload.group_speeds(self.bag_first, self.bag_size, self.num_gpus)
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
                       base_tokens: np.ndarray) -> _Problem:  # fmt: skip
        """The sequences ``seqs`` over the disjoint groups ``bags`` (ids of this problem's groups) as
        the bags of a fixed topology, every GPU of bag ``k`` already holding ``base_load[k]`` and
        ``base_tokens[k]``: a stage of the elastic planner. Bag ``k`` of the result is group
        ``bags[k]``."""
        classes, bag_class = np.unique(self.bag_class[bags], return_inverse=True)
        bag_size, bag_first = self.bag_size[bags], self.bag_first[bags]
        topology = Topology(f"tiling of {self.topology.spec}", tuple(bag_size.tolist()), tuple(bag_first.tolist()),
                            self.num_gpus, None, True)  # fmt: skip
        return _Problem(topology, self.workload, self.cap, self.seq_lens[seqs], self.src[seqs], bag_size, bag_first,
                        bag_class.ravel().astype(np.int64), self.class_size[classes],
                        np.bincount(bag_class.ravel(), minlength=len(classes)).astype(np.int64),
                        self.cost[seqs][:, classes], self.tokens[seqs][:, classes], self.allowed[seqs][:, classes],
                        self.seconds_per_unit, base_load, base_tokens)  # fmt: skip

    def make_home_plan(self, solver: str) -> RoutingPlan:
        """Every sequence alone on its home GPU (Ulysses degree 1, no bag)."""
        return self.make_plan(solver, self.src, np.ones_like(self.src))

    def _gpu_loads(self, group_start: np.ndarray, group_size: np.ndarray) -> np.ndarray:
        return _group_loads(self.workload, self.seq_lens, group_start, group_size, self.topology.group_size)

    @functools.cached_property
    def home_max_load_s(self) -> float:
        """Modeled step time of keeping every sequence alone on its home GPU."""
        return float(self._gpu_loads(self.src, np.ones_like(self.src)).max()) if self.seq_lens.size else 0.0

    @functools.cached_property
    def lower_bound_s(self) -> float:
        """Seconds no plan of ours can beat: the topology bound, or running everything at home. The
        quantised loads leave out the overhead every GPU pays (the least one): it is added back."""
        least_overhead = float(self.workload.gpu_overhead_s(self.num_gpus).min()) if self.workload.overhead_s else 0.0
        return min(self.lower_bound * self.seconds_per_unit + least_overhead, self.home_max_load_s)

    def fits_cap_at_home(self) -> bool:
        home_tokens = np.bincount(self.src, weights=self.seq_lens, minlength=self.topology.group_size)
        return self.cap is None or bool(home_tokens.max(initial=0) <= self.cap)


def _overhead_units(workload: WorkloadModel, num_gpus: int, scale: float, total_cost: int) -> np.ndarray | None:
    """``[S]`` int64 each GPU's fixed overhead above the least one, in cost units of ``scale`` per
    second, or ``None`` when they are all equal (no speeds, or no overhead): a load every GPU pays
    alike changes no plan. Rounded down, so bounds on them stay bounds. In ascending order, each is
    held to the one before plus ``total_cost + 1`` (all of the step's work, each sequence at its
    costliest): a GPU further behind gets nothing in any plan and stays the busiest, so that changes
    no plan, and loads stay in the range the sequences' costs give them."""
    if not workload.overhead_s or workload.gpu_speed is None:
        return None
    overhead = workload.gpu_overhead_s(num_gpus)
    extra = np.floor((overhead - overhead.min()) * scale)
    capped, previous = np.zeros(num_gpus, dtype=np.int64), 0
    for gpu in np.argsort(extra, kind="stable").tolist():
        previous = capped[gpu] = int(min(extra[gpu], previous + total_cost + 1))
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
    """``[N]`` lengths and ``[N]`` home ranks, validated; errors name the rank and the bad value."""
    if len(seq_lens_per_rank) != topology.group_size:
        raise ValueError(
            f"got sequence lengths for {len(seq_lens_per_rank)} ranks, but topology {topology.spec!r} has "
            f"{topology.group_size} GPUs per balance group; pass one list per rank of the balance group"
        )
    per_rank = []
    for rank, lengths in enumerate(seq_lens_per_rank):
        try:
            array = np.asarray(lengths)
        except ValueError:  # ragged nesting
            array = np.asarray(lengths, dtype=object)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iuf"):
            raise ValueError(
                f"rank {rank}: sequence lengths must be a flat list of token counts, one per sequence; got {lengths!r}"
            )
        if array.size and array.dtype.kind == "f":
            fractional = np.flatnonzero(array != np.round(array))
            if fractional.size:
                index = int(fractional[0])
                raise ValueError(
                    f"rank {rank}: sequence {index} has length {lengths[index]!r}; lengths are whole token counts"
                )
            array = array.astype(np.int64)
        if array.size and array.min() <= 0:
            index = int(np.argmin(array))
            raise ValueError(
                f"rank {rank}: sequence {index} has length {int(array[index])}; every length must be a "
                "positive token count (drop empty samples before planning; a rank may have no sequences)"
            )
        per_rank.append(array.astype(np.int64))
    seq_lens = np.concatenate(per_rank) if per_rank else np.zeros(0, dtype=np.int64)
    src = np.repeat(np.arange(len(per_rank), dtype=np.int64), [len(a) for a in per_rank])
    return seq_lens, src


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


def _finish_time_greedy(problem: _Problem) -> np.ndarray | None:
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


def _knapformer_greedy(problem: _Problem) -> np.ndarray:
    """``[N]`` bag of each sequence by the KnapFormer greedy, as published.

    Workload ``w = a*s + b*s**2`` (no communication, no speeds); sequences by ``w`` descending; a bag's
    capacity is the mean per-GPU workload times its size ``G``; candidate bags have capacity ``>= w``
    and ``G <= s``, else all bags of the largest ``G``; the candidate with the lowest occupancy (used
    over capacity) wins, ties to the lower bag id. Exact integer arithmetic throughout.
    """
    n = len(problem.seq_lens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    w_s = problem.workload.per_gpu_time(problem.seq_lens, 1)  # at G=1 there is no all-to-all term
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


def _first_fit_decreasing(problem: _Problem) -> np.ndarray | None:
    """``[N]`` bag of each sequence packed for the memory cap alone, or ``None`` if it fails.

    Bin packing's first-fit decreasing: sequences by the tokens they need (their smallest per-GPU
    share) descending, each to the lowest-id bag with room. Load balance is left to local search.
    Used only when the cap (or :attr:`_Problem.allowed`) defeats every load-driven start.
    """
    # Without a cap only allowed matters (groups of whole nodes): room is endless.
    room = (
        np.full(problem.num_bags, np.iinfo(np.int64).max) if problem.cap is None else problem.cap - problem.start_tokens
    )
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


def _refine(problem: _Problem, steps: int) -> np.ndarray | None:
    """``[N]`` bag of each sequence (see the module docstring), or ``None`` if none found fits the cap."""
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
            packed = _exact_search(problem, None, EXACT_NODE_BUDGET)
        feasible = [packed] if packed is not None else []
    if not feasible:
        return None
    # min() keeps the first of equal loads: the home-bag start, which moves the fewest tokens.
    bag_of_seq = min(feasible, key=lambda s: int(problem.bag_loads(s).max())).copy()
    _local_search(problem, bag_of_seq, steps)
    if len(bag_of_seq) <= EXACT_MAX_SEQUENCES:
        bag_of_seq = _exact_search(problem, bag_of_seq, EXACT_NODE_BUDGET)
    return _keep_tokens_home(problem, bag_of_seq)


def _exact_search(problem: _Problem, incumbent: np.ndarray | None, node_budget: int) -> np.ndarray | None:
    """The best assignment found by branch and bound within ``node_budget`` nodes, or ``incumbent``.

    With no incumbent it looks for any assignment that fits the memory cap, and the best of those.

    Sequences go in descending cost order; of several empty bags of one class only the first is
    tried (they are interchangeable); a branch is cut when its busiest bag reaches the incumbent, or
    when even the cheapest placement of the remaining sequences cannot fit under it (GPU-seconds
    over ``S`` GPUs). Stops at the lower bound. Exact when the budget suffices.
    """
    n, num_bags = len(problem.seq_lens), problem.num_bags
    order = np.lexsort((np.arange(n), -problem.cost.min(axis=1)))
    cost, allowed, need = (problem.cost[order].tolist(), problem.allowed[order].tolist(),
                           problem.tokens[order].tolist())  # fmt: skip
    cheapest = np.where(problem.allowed, problem.gpu_seconds, np.iinfo(np.int64).max).min(axis=1)[order]
    cheapest_rest = np.concatenate([np.cumsum(cheapest[::-1])[::-1], [0]]).tolist()  # of sequences k..N-1
    bag_class, class_size = problem.bag_class.tolist(), problem.class_size.tolist()
    group_size, cap = problem.num_gpus, problem.cap
    loads, tokens = problem.start_load.tolist(), problem.start_tokens.tolist()
    counts, assign = [0] * num_bags, [0] * n
    interchangeable = problem.interchangeable.tolist()
    no_incumbent = np.iinfo(np.int64).max
    best_max = no_incumbent if incumbent is None else int(problem.bag_loads(incumbent).max())
    best_assign, nodes = None, 0

    def search(k: int, current_max: int, used: int) -> None:
        nonlocal best_max, best_assign, nodes
        if k == n:
            best_max, best_assign = current_max, list(assign)
            return
        if nodes >= node_budget or best_max <= problem.lower_bound:
            return
        if best_max != no_incumbent and -(-(used + cheapest_rest[k]) // group_size) >= best_max:
            return
        empty_classes_tried = set()
        for b in range(num_bags):
            c = bag_class[b]
            if counts[b] == 0:  # empty bags that are interchangeable: trying one is enough
                if interchangeable[b] in empty_classes_tried:
                    continue
                empty_classes_tried.add(interchangeable[b])
            new_load = loads[b] + cost[k][c]
            if not allowed[k][c] or new_load >= best_max or (cap is not None and tokens[b] + need[k][c] > cap):
                continue
            nodes += 1
            loads[b], tokens[b], counts[b], assign[k] = new_load, tokens[b] + need[k][c], counts[b] + 1, b
            search(k + 1, max(current_max, new_load), used + class_size[c] * cost[k][c])
            loads[b], tokens[b], counts[b] = loads[b] - cost[k][c], tokens[b] - need[k][c], counts[b] - 1

    search(0, max(loads), int((problem.start_load * problem.bag_size).sum()))
    if best_assign is None:
        return incumbent
    bag_of_seq = np.empty(n, dtype=np.int64)
    bag_of_seq[order] = best_assign
    return bag_of_seq


def _local_search(problem: _Problem, bag_of_seq: np.ndarray, steps: int) -> None:
    """Lower the busiest bag's load by moves, swaps and two-step chains, in place, for <= ``steps`` steps.

    A step takes the busiest bag ``A`` (lowest id among equals) and applies the best of: moving one of
    its sequences to a light bag of any class, or swapping one with a sequence of the least-loaded bags
    (up to ``SWAP_CANDIDATES`` of them), judged by the larger of the new loads. When neither helps, a
    chain: move a sequence of ``A`` into a bag ``B`` even if that overloads ``B``, then the best move or
    swap out of ``B`` (never back into ``A``). A step is applied only if every load it touches ends
    below ``A``'s load, so the sorted load vector decreases lexicographically: no cycles, and the max
    load never rises. Stops early within ``REFINE_TOLERANCE`` of the lower bound, when no step
    improves, or when ``min(B, STALL_WINDOW)`` steps in a row cut the max by less than
    ``REFINE_TOLERANCE``.
    """
    state = _Assignment(problem, bag_of_seq)
    good_enough = problem.lower_bound + int(problem.lower_bound * REFINE_TOLERANCE)
    window = min(problem.num_bags, STALL_WINDOW)
    window_start_max = int(state.loads.max())
    for step in range(steps):
        a = int(np.argmax(state.loads))
        load_a = int(state.loads[a])
        if load_a <= good_enough:
            return
        # A step lowers one busiest bag; a window of steps that did not cut the max by
        # REFINE_TOLERANCE means the search is stalled on small lexicographic gains.
        if step and step % window == 0:
            if window_start_max - load_a <= int(window_start_max * REFINE_TOLERANCE):
                return
            window_start_max = load_a
        found = state.best_step(a, load_a, exclude=(a,))
        if found is None:
            found = state.best_chain(a, load_a)
            if found is None:
                return
        for i, to_bag in found[1]:
            state.move(i, to_bag)


class _Assignment:
    """A mutable assignment of sequences to bags with its loads, for local search.

    ``bag_of_seq`` is updated in place; ``loads`` (quantised) and ``bag_tokens`` (tokens on each
    bag's busiest GPU) follow every move.
    """

    _BIG = np.iinfo(np.int64).max

    def __init__(self, problem: _Problem, bag_of_seq: np.ndarray):
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

    def best_step(self, a: int, limit: int, exclude: tuple[int, ...]) -> tuple[int, list[tuple[int, int]]] | None:
        """Best move or swap of a sequence of bag ``a`` with bags not in ``exclude``.

        Returns ``(score, [(sequence, to_bag), ...])`` when its score (the largest load it leaves on
        the bags it touches) is below ``limit``, else ``None``.
        """
        problem, loads, bag_tokens = self.problem, self.loads, self.bag_tokens
        bag_class, cost, tokens, cap, big = problem.bag_class, problem.cost, problem.tokens, problem.cap, self._BIG
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

        # Swaps: an item of a with sequence j of a light partner bag. A useful swap trades costs that
        # differ by about half the load gap, so a sample of a's items spread evenly by cost will do.
        swap_items = items
        if len(items) > SWAP_CANDIDATES:
            by_cost = np.argsort(cost[items, class_a], kind="stable")
            swap_items = items[by_cost[np.linspace(0, len(items) - 1, SWAP_CANDIDATES).astype(np.int64)]]
        js = []
        for b in np.argsort(loads, kind="stable")[: SWAP_CANDIDATES + len(exclude)].tolist():
            if len(js) >= SWAP_CANDIDATES:
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


def _keep_tokens_home(problem: _Problem, bag_of_seq: np.ndarray) -> np.ndarray:
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
