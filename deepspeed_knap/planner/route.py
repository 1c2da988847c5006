"""The price of moving tokens: the route and reverse route of a plan, and the pass that keeps a
sequence home when moving it costs more than it saves.

A plan's modeled step is its compute (the busiest GPU's load) plus its route phase::

    step = max_g load[g]  +  [any token moves] * route_latency_s  +  max_g max(send[g], receive[g]),
    send[g] = intra_sent[g] * route_coef + inter_sent[g] * inter_node_route_coef

(``receive`` alike), where ``intra_sent[g]`` counts the tokens GPU ``g`` sends to other GPUs of its
node and ``inter_sent[g]`` those it sends to other nodes. The route is one all-to-all: every GPU
sends and receives at once over full-duplex links, and the phase ends with the GPU that has the
most to move. :attr:`~deepspeed_knap.cost.model.CostModel.route_coef` is the seconds of one token's
round trip (the route and the reverse route, forward and backward), so one term prices all four
exchanges. :attr:`~deepspeed_knap.cost.model.CostModel.route_latency_s` is what the route phase
costs once anything moves, however little: the all-to-alls' fixed cost, which a plan that keeps
every token home skips (:attr:`~deepspeed_knap.runtime.routing.RoutedBatch.stays_home`). With all
three 0 the step is the compute alone and nothing here runs: plans are those of the compute-only
planner, bit for bit.

Determinism: token counts are exact integers; loads are the planner's quantised integer units
(:class:`~deepspeed_knap.planner.problem.Problem`); a route time is two float products and a sum
per GPU, the same bits on every machine. Dimension names: ``S`` GPUs, ``N`` sequences.
"""

from __future__ import annotations

import numpy as np

from deepspeed_knap.cost.model import CostModel, index_ranges
from deepspeed_knap.planner.plan import RoutingPlan


def sequence_traffic(
    seq_len: int, src: int, group_start: int, group_size: int, gpus_per_node: int | None
) -> list[tuple[int, int, bool]]:
    """``(GPU, tokens, crosses nodes)`` of every chunk of a sequence that leaves its home GPU ``src``:
    the near-equal contiguous chunks of :meth:`~deepspeed_knap.planner.problem.Problem.make_plan`
    (the first ``seq_len % group_size`` chunks one token longer), the home GPU's own chunk left out."""
    base, extra = divmod(seq_len, group_size)
    moved = []
    for position in range(group_size):
        gpu = group_start + position
        tokens = base + (position < extra)
        if gpu != src and tokens:
            moved.append((gpu, tokens, gpus_per_node is not None and gpu // gpus_per_node != src // gpus_per_node))
    return moved


def gpu_traffic(
    seq_lens: np.ndarray, src: np.ndarray, group_start: np.ndarray, group_size: np.ndarray, num_gpus: int,
    gpus_per_node: int | None,
) -> np.ndarray:  # fmt: skip
    """``[4, S]`` int64 tokens each GPU sends within its node, sends to other nodes, receives within
    its node and receives from other nodes, under a plan of groups ``(group_start, group_size)``
    ``[N]`` for sequences ``seq_lens`` ``[N]`` of home GPUs ``src`` ``[N]``."""
    seq_lens, src = np.asarray(seq_lens, dtype=np.int64), np.asarray(src, dtype=np.int64)
    group_start, group_size = np.asarray(group_start, dtype=np.int64), np.asarray(group_size, dtype=np.int64)
    # Every chunk of every sequence (sequence_traffic's, vectorised): [sum of group sizes] each.
    gpu, home = index_ranges(group_start, group_size), np.repeat(src, group_size)
    tokens = _chunk_lengths(seq_lens, group_size)
    moves = (gpu != home) & (tokens > 0)
    gpu, home, tokens = gpu[moves], home[moves], tokens[moves]
    across = np.zeros(len(gpu), dtype=bool) if gpus_per_node is None else gpu // gpus_per_node != home // gpus_per_node
    # Token counts sum exactly in float64 (a step holds at most 2**40 tokens).
    sent = np.bincount(across * num_gpus + home, weights=tokens, minlength=2 * num_gpus)
    received = np.bincount(across * num_gpus + gpu, weights=tokens, minlength=2 * num_gpus)
    return np.concatenate((sent, received)).astype(np.int64).reshape(4, num_gpus)


def moved_tokens(plan: RoutingPlan) -> list[int]:
    """``[S]`` the tokens each GPU moves under ``plan``: the larger of what it sends and receives (the
    online refit's route evidence)."""
    traffic = gpu_traffic(plan.seq_lens, plan.seq_src_rank, plan.seq_group_start, plan.seq_group_size,
                          plan.num_gpus, None)  # fmt: skip
    return np.maximum(traffic[0], traffic[2]).tolist()


def route_seconds(cost_model: CostModel, traffic: np.ndarray) -> float:
    """Modeled seconds of the route phase (the module docstring) of a plan's ``traffic`` ``[4, S]``
    (:func:`gpu_traffic`)."""
    return _route_phase(traffic, cost_model.route_coef, cost_model.inter_node_route, cost_model.route_latency_s)


def _route_phase(traffic: np.ndarray, intra: float, inter: float, latency: float) -> float:
    """The route phase of ``traffic`` ``[4, S]`` at ``intra`` and ``inter`` per token and ``latency``
    once anything moves, in the units they are given in (seconds, or the planner's load units)."""
    send = traffic[0] * intra + traffic[1] * inter
    receive = traffic[2] * intra + traffic[3] * inter
    return (latency if traffic.any() else 0.0) + float(np.maximum(send, receive).max(initial=0.0))


def keep_home(
    cost_model: CostModel,
    seq_lens: np.ndarray,
    src: np.ndarray,
    group_start: np.ndarray,
    group_size: np.ndarray,
    load_units: np.ndarray,
    home_units: np.ndarray,
    seconds_per_unit: float,
    gpu_base_units: np.ndarray,
    gpus_per_node: int | None,
    cap: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The plan with the sequences brought home (alone on their home GPU) whose moves cost more
    than they save: ``(group_start, group_size)`` ``[N]``.

    First the best of the plans that bring home every moved sequence of at most ``t`` moved
    tokens, over every ``t`` (one at a time the route phase rarely shrinks: it is the busiest GPU's
    and many GPUs move about as much; and a short sequence saves the least compute per token
    moved, attention growing as the square). Then passes over the moved sequences, most tokens
    first (ties by id), each brought home when the modeled step (the module docstring) with it
    home is no longer, until a pass brings none: no moved sequence of the result could come home
    without lengthening the step. Sequences whose tokens do not fit the home GPU under ``cap`` stay.
    Every change lowers or keeps the step, so the result is never slower than the plan given.

    Args:
        load_units: ``[N]`` int64 quantised per-GPU cost of each sequence in its group.
        home_units: ``[N]`` int64 quantised cost of each sequence alone on its home GPU.
        seconds_per_unit: seconds of one unit (the route times are converted into units).
        gpu_base_units: ``[S]`` int64 load every GPU holds before any sequence (fixed overheads).
    """
    state = _HomeState(cost_model, seq_lens, src, group_start, group_size, load_units, home_units,
                       seconds_per_unit, gpu_base_units, gpus_per_node, cap)  # fmt: skip
    # Prefixes by moved tokens, fewest first: the step after each, and the best prefix's length.
    ascending = sorted((tokens, i) for i, tokens in state.moved())
    trial = state.copy()
    best_step, best_count = state.step, 0
    for k, (tokens, i) in enumerate(ascending):
        trial.bring_home(i)
        last_of_threshold = k + 1 == len(ascending) or ascending[k + 1][0] != tokens
        if last_of_threshold and trial.step <= best_step:
            best_step, best_count = trial.step, k + 1
    for _, i in ascending[:best_count]:
        state.bring_home(i)
    while True:
        brought = 0
        for _, i in sorted(((tokens, i) for i, tokens in state.moved()), key=lambda item: (-item[0], item[1])):
            brought += state.bring_home(i, only_if_no_slower=True)
        if not brought:
            return state.group_start, state.group_size


class _HomeState:
    """A plan being brought home: every GPU's load (units) and traffic, and the step they give."""

    def __init__(self, cost_model, seq_lens, src, group_start, group_size, load_units, home_units, seconds_per_unit,
                 gpu_base_units, gpus_per_node, cap) -> None:  # fmt: skip
        num_gpus = len(gpu_base_units)
        self.seq_lens, self.src, self.load_units, self.home_units = seq_lens, src, load_units, home_units
        self.gpus_per_node, self.cap = gpus_per_node, cap
        self.group_start, self.group_size = group_start.copy(), group_size.copy()
        members = index_ranges(group_start, group_size)
        # Exact: bincount sums integers below 2**53.
        self.loads = gpu_base_units + np.bincount(members, weights=np.repeat(load_units, group_size),
                                                  minlength=num_gpus).astype(np.int64)  # fmt: skip
        self.tokens = np.bincount(members, weights=_chunk_lengths(seq_lens, group_size),
                                  minlength=num_gpus).astype(np.int64)  # fmt: skip
        self.traffic = gpu_traffic(seq_lens, src, group_start, group_size, num_gpus, gpus_per_node)
        # Route seconds per token in load units: one float product each, the same on every rank.
        self.intra = cost_model.route_coef / seconds_per_unit
        self.inter = cost_model.inter_node_route / seconds_per_unit
        self.latency = cost_model.route_latency_s / seconds_per_unit
        self.step = self._step(self.loads, self.traffic)

    def copy(self) -> _HomeState:
        other = object.__new__(_HomeState)
        other.__dict__.update(self.__dict__)
        for name in ("group_start", "group_size", "loads", "tokens", "traffic"):
            setattr(other, name, getattr(self, name).copy())
        return other

    def _step(self, loads: np.ndarray, traffic: np.ndarray) -> float:
        return float(loads.max(initial=0)) + _route_phase(traffic, self.intra, self.inter, self.latency)

    def moved(self) -> list[tuple[int, int]]:
        """``(sequence, tokens it moves)`` of every sequence not alone at home."""
        return [(i, s - _home_chunk(s, h, start, size)) for i, (s, h, start, size) in
                enumerate(zip(self.seq_lens.tolist(), self.src.tolist(), self.group_start.tolist(),
                              self.group_size.tolist(), strict=True)) if not (size == 1 and start == h)]  # fmt: skip

    def bring_home(self, i: int, only_if_no_slower: bool = False) -> int:
        """Put sequence ``i`` alone on its home GPU if it fits the cap there (and, with
        ``only_if_no_slower``, if the step does not grow); 1 if it did, else 0."""
        s, home = int(self.seq_lens[i]), int(self.src[i])
        start, size = int(self.group_start[i]), int(self.group_size[i])
        chunks = sequence_traffic(s, home, start, size, self.gpus_per_node)
        moved = sum(tokens for _, tokens, _ in chunks)
        if self.cap is not None and self.tokens[home] + moved > self.cap:
            return 0
        loads, traffic = self.loads.copy(), self.traffic.copy()
        loads[start : start + size] -= self.load_units[i]
        loads[home] += self.home_units[i]
        for gpu, tokens, across in chunks:
            traffic[int(across), home] -= tokens
            traffic[2 + int(across), gpu] -= tokens
        step = self._step(loads, traffic)
        if only_if_no_slower and step > self.step:
            return 0
        self.loads, self.traffic, self.step = loads, traffic, step
        for gpu, tokens, _ in chunks:
            self.tokens[gpu] -= tokens
        self.tokens[home] += moved
        self.group_start[i], self.group_size[i] = home, 1
        return 1


def _home_chunk(seq_len: int, src: int, group_start: int, group_size: int) -> int:
    """Tokens of the sequence its group leaves on its home GPU (0 when the group leaves it out)."""
    position = src - group_start
    if not 0 <= position < group_size:
        return 0
    base, extra = divmod(seq_len, group_size)
    return base + (position < extra)


def _chunk_lengths(seq_lens: np.ndarray, group_size: np.ndarray) -> np.ndarray:
    """``[sum G]`` the tokens of every chunk, sequence by sequence, in rank order within a group."""
    offsets = np.repeat(np.cumsum(group_size) - group_size, group_size)
    position = np.arange(int(group_size.sum())) - offsets
    return np.repeat(seq_lens // group_size, group_size) + (position < np.repeat(seq_lens % group_size, group_size))
