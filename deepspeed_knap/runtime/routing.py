"""Token routing: gather lengths, move every sequence's chunks to its group, and move them back.

The entry points, all collective over the balance group (every rank must call them, in the same
order):

* :func:`gather_seq_lens` all-gathers each rank's sequence lengths, the planner's input, and checks
  every rank's packed batch where all ranks see the result, so a bad batch raises on every rank.
* :func:`route` moves a :class:`~deepspeed_knap.runtime.packing.PackedBatch` to where a plan puts it: one
  variable-split all-to-all for the token states (differentiable), one for the per-token side
  columns (as raw bytes, so integers are never rounded), one per differentiable per-sample tensor
  and one for the rest. A plan that keeps every token home (:attr:`RoutedBatch.stays_home`) runs
  none of them, nor the other functions' exchanges of its step: every rank knows that alike.
* :func:`reverse_route` moves routed rows ``[T_routed, ...]`` back to their home rank and order;
  :func:`route_subset_rows` sends rows that only some tokens have (e.g. text states) the way the
  route sent those tokens; :func:`route_sample_rows` sends a sequence's own rows (e.g. the text a
  video's tokens cross-attend to) to every GPU that holds a chunk of it.

All of them run on :func:`exchange`, the one all-to-all primitive, whose backward is the reverse
exchange. Dimension names: ``T`` tokens, ``D`` model width, ``S`` GPUs of the balance group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deepspeed_knap.cost.model import index_ranges
from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.runtime.groups import ProcessGroups, text_digest
from deepspeed_knap.runtime.layout import GpuLayout, gpu_layout, local_layout
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.timing import StepTimes

# Bytes each kind of exchange sent to other ranks, while record_traffic() is active.
_traffic: dict[str, int] | None = None
# Where the exchanges of the step in flight are timed (forward and backward), set by the balancer.
_times: StepTimes | None = None
# The process groups (None: the world) this process has run an all-to-all on. NCCL connects a group's
# peers lazily, at the first send or receive between them (and makes the communicator then too where
# it was not made at start-up): 0.1 s or more where an exchange takes a millisecond. Timed, a group's first
# exchange would teach the online cost model that price for its link (or, inside the blocks, that
# compute), and for a group first used at a later step (topology auto's nested groups) the planner
# would then keep sequences out of it.
_connected: set = set()


def time_exchanges(times: StepTimes | None, stop: StepTimes | None = None) -> None:
    """Stamp both ends of every exchange started from now on into ``times`` (``None``: stop). With
    ``stop``, stop only if ``stop`` is the record in use (another balancer's may have replaced it).
    An exchange's backward is stamped into the record its forward used, whatever is current then."""
    global _times
    if stop is None or _times is stop:
        _times = times


@contextlib.contextmanager
def record_traffic() -> Iterator[dict[str, int]]:
    """Count the bytes this rank's exchanges send to *other* ranks, by kind (``"route"``,
    ``"reverse_route"``, ``"ulysses"``), forward and backward, while the block runs."""
    global _traffic
    outer, _traffic = _traffic, defaultdict(int)
    try:
        yield _traffic
    finally:
        _traffic = outer


def _dist():
    import deepspeed.comm as dist

    return dist


class _Exchange(torch.autograd.Function):
    """Variable-split all-to-all along dim 0; its gradient is the same exchange with the splits swapped
    (stamped into the same step record, ``times``)."""

    @staticmethod
    def forward(ctx, x: Tensor, send_counts: list[int], recv_counts: list[int], group: Any, kind: str,
                times: StepTimes | None) -> Tensor:  # fmt: skip
        ctx.args = (recv_counts, send_counts, group, kind, times)
        return _all_to_all(x, send_counts, recv_counts, group, kind, times)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _Exchange.apply(grad.contiguous(), *ctx.args), None, None, None, None, None


def _all_to_all(x: Tensor, send_counts: list[int], recv_counts: list[int], group: Any, kind: str,
                times: StepTimes | None) -> Tensor:  # fmt: skip
    dist = _dist()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    if _traffic is not None:
        me = dist.get_rank(group)
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        _traffic[kind] += row_bytes * (sum(send_counts) - send_counts[me])
    x = x.contiguous()
    if group not in _connected:  # every rank of the group gets here at the same exchange: all connect
        # The group's one-time set-up (_connected) in this exchange run once more, untimed, at the
        # sizes the timed one sends (NCCL may set up more of a link for larger ones), stamped as
        # "setup": inside the blocks (Ulysses', a route between blocks) the compute leaves it out
        # as it does the exchanges.
        _stamped_all_to_all(out, x, send_counts, recv_counts, group, times, "setup")
        _connected.add(group)
    _stamped_all_to_all(out, x, send_counts, recv_counts, group, times, kind)
    return out


def _stamped_all_to_all(out: Tensor, x: Tensor, send_counts: list[int], recv_counts: list[int], group: Any,
                        times: StepTimes | None, label: str) -> None:  # fmt: skip
    """``all_to_all_single`` of ``x`` into ``out``, its two ends stamped into ``times`` as ``label``
    (``None``: not timed)."""
    start = times.begin_exchange() if times is not None else None
    _dist().all_to_all_single(out, x, recv_counts, send_counts, group=group)
    if times is not None:
        times.end_exchange(label, start)


def exchange(x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: Any, kind: str,
             local: bool = False) -> Tensor:  # fmt: skip
    """All-to-all of rows of ``x``: ``send_counts[r]`` consecutive rows go to rank ``r`` of ``group``
    and ``recv_counts[r]`` rows come back from it, stacked in rank order.

    Args:
        x: ``[sum(send_counts), ...]``; differentiable when floating point.
        send_counts, recv_counts: one count per rank of ``group``; must mirror the peers' counts.
        group: a ``deepspeed.comm`` process group (``None``: the world).
        kind: label for :func:`record_traffic`.
        local: no rank of ``group`` sends a row to another this time, and every rank passes ``True``
            alike (:attr:`RoutedBatch.stays_home`): ``x`` is what would come back, returned as it is
            (the same tensor, where the collective makes a new one), without the collective.

    Returns:
        ``[sum(recv_counts), ...]`` rows from rank 0, then rank 1, ...
    """
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if x.shape[0] != sum(send_counts):
        raise ValueError(f"exchange got {x.shape[0]} rows to send but the split sizes add up to {sum(send_counts)}")
    if local:
        if send_counts != recv_counts or sum(1 for count in send_counts if count) > 1:
            raise ValueError(f"a local exchange sends and receives rows of this rank only; got send counts "
                             f"{send_counts} and receive counts {recv_counts}")  # fmt: skip
        return x
    if x.requires_grad:
        return _Exchange.apply(x, send_counts, recv_counts, group, kind, _times)
    return _all_to_all(x, send_counts, recv_counts, group, kind, _times)


@dataclass(frozen=True, eq=False)
class RoutedBatch:
    """What one GPU holds after routing, and how to send it back.

    Attributes:
        batch: the routed tokens: one "sequence" per non-empty chunk held, ascending global sequence
            id; ``batch.seq_lens`` are the chunk lengths, ``batch.sample_data`` one row per chunk.
        layout: this GPU's layout under the plan (sequence ids, chunk offsets, attention groups).
        plan: the plan routed by, or ``None`` for a :func:`local_batch`.
        groups: the process groups, or ``None`` for a :func:`local_batch` (no communication).
    """

    batch: PackedBatch
    layout: GpuLayout
    plan: RoutingPlan | None
    groups: ProcessGroups | None
    _device_arrays: dict = field(default_factory=dict, repr=False)

    @property
    def seq_ids(self) -> np.ndarray:
        """``[n]`` global sequence id of every chunk held."""
        return self.layout.seq_ids

    @property
    def stays_home(self) -> bool:
        """Whether the plan keeps every token on its home GPU. Every exchange of the step's routes
        then sends nothing to another rank, and skips its collective: every rank knows it alike from
        the plan, which :func:`route` checked is the same on every rank. (Ulysses exchanges inside
        a group still run: a sequence shorter than its group may sit whole on its home GPU.)"""
        return self.plan is not None and self.plan.tokens_moved == 0

    def with_tokens(self, tokens: Tensor) -> RoutedBatch:
        """The same routed batch holding ``tokens`` (``[T_routed, ...]``, e.g. a stamped view)."""
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, tokens=tokens))

    def subset(self, keep: np.ndarray) -> tuple[RoutedBatch, np.ndarray]:
        """The part of this batch that belongs to the step's sequences ``keep`` marks (``[N]`` bool
        by sequence id, the same on every rank; a :func:`local_batch`'s: by local order), and the
        rows of this batch it holds (``[T']`` int64, in order). The part has a layout of its own (the
        sub-plan's, :meth:`~deepspeed_knap.planner.plan.RoutingPlan.subset`), so its attention runs
        the groups of those sequences only, and its per-sample routes carry their rows only: a
        model whose samples run through different weights (two experts) runs each set on its own
        part. Communicates nothing; every rank derives the same part layouts."""
        keep = np.asarray(keep, dtype=bool)
        held = keep[self.layout.seq_ids]  # [n] per chunk held
        lens = np.asarray(self.batch.seq_lens, dtype=np.int64)
        rows = index_ranges((np.cumsum(lens) - lens)[held], lens[held])
        index = self.device_array(("subset_rows", keep.tobytes()), rows)
        chunks = self.device_array(("subset_chunks", keep.tobytes()), np.flatnonzero(held))
        batch = self.batch
        part = PackedBatch(
            tokens=batch.tokens.index_select(0, index),
            seq_lens=tuple(lens[held].tolist()),
            token_data={key: t.index_select(0, index) for key, t in batch.token_data.items()},
            sample_data={key: t.index_select(0, chunks) for key, t in batch.sample_data.items()},
        )
        if self.plan is None:
            return RoutedBatch(part, local_layout(part.seq_lens), None, None), rows
        plan = self.plan.subset(keep)
        return RoutedBatch(part, gpu_layout(plan, self.layout.gpu), plan, self.groups), rows

    def device_array(self, key: Any, array: np.ndarray, dtype: torch.dtype = torch.int64) -> Tensor:
        """``array`` as a tensor on the batch's device, made once per step (attention layers reuse it)."""
        if key not in self._device_arrays:
            self._device_arrays[key] = torch.as_tensor(array, dtype=dtype).to(self.batch.tokens.device)
        return self._device_arrays[key]


def local_batch(batch: PackedBatch) -> RoutedBatch:
    """``batch`` unrouted: every sequence runs on this GPU alone. Use it to run the same model without
    balancing; nothing communicates."""
    return RoutedBatch(batch, local_layout(batch.seq_lens), None, None)


def gather_seq_lens(batch: PackedBatch, groups: ProcessGroups) -> list[list[int]]:
    """All-gather every rank's ``batch.seq_lens`` over the balance group.

    Returns:
        ``S`` lists of lengths, one per rank of the balance group: the planner's input.

    Raises:
        ValueError: on every rank, when any rank's batch is inconsistent (:meth:`PackedBatch.problem`).
    """
    return gather_step(batch, groups, ())[0]


def gather_step(
    batch: PackedBatch, groups: ProcessGroups, report: Sequence[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """:func:`gather_seq_lens`, with ``report`` (a few integers every rank gives, e.g. the last
    step's measured microseconds) riding in the same collective.

    Returns:
        ``(lengths, reports)``: ``S`` lists of lengths and ``S`` reports, by rank of the balance group.
    """
    return gather_lengths(batch.seq_lens, batch.problem(), batch.tokens.device, groups, report)


def gather_lengths(
    seq_lens: Sequence[int], problem: str | None, device: torch.device, groups: ProcessGroups, report: Sequence[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """:func:`gather_step` of a batch known by its lengths and ``problem`` (why it is inconsistent, or
    ``None``), with collectives on ``device``.

    Raises:
        ValueError: on every rank, the same message, when any rank has a ``problem``.
    """
    gathered = gather_step_inputs(seq_lens, None, problem, device, groups, report)
    return gathered.seq_lens_per_rank, gathered.reports


@dataclass(frozen=True)
class GatheredStep:
    """What :func:`gather_step_inputs` gathered, by rank of the balance group.

    Attributes:
        seq_lens_per_rank: ``S`` lists of sequence lengths: the planner's input.
        segments_per_rank: ``S`` lists of ``[K]`` attention-segment rows, one per sequence (the
            planner's ``seq_segments_per_rank``), or ``None`` when no rank gave segments.
        reports: ``S`` reports.
        row_ints: the integers the rank with the most sequences sent (its lengths and segments):
            the ``capacity`` a later :func:`gather_step_inputs` needs to take them in one all-gather.
    """

    seq_lens_per_rank: list[list[int]]
    segments_per_rank: list[list[list[int]]] | None
    reports: list[list[int]]
    row_ints: int = 0


def check_step_inputs(
    seq_lens: Sequence[int], segments: np.ndarray | None, problem: str | None = None
) -> tuple[np.ndarray, np.ndarray | None, int, str | None]:
    """:func:`gather_step_inputs`' checks of this rank's lengths and attention segments, which never
    raise: whatever a rank was given must reach the header gather, where a check or conversion that
    raised before it would leave the other ranks waiting. Local.

    Returns:
        ``(lengths, table, width, problem)``: ``[N, 1]`` int64 lengths; the segments as given, or as
        ``[N, K]`` int64 once they pass (``None``: none given, or ragged rows); ``K`` (-1: none
        given, 0: not a table); and what is wrong with them, or the ``problem`` given, or ``None``.
    """
    problem, width, table = problem or None, -1, None
    lengths = np.zeros((0, 1), dtype=np.int64)  # [N, 1]: this rank's lengths, once they pass
    if problem is None:
        try:
            values = np.asarray(seq_lens)
        except (ValueError, TypeError) as error:
            values = error
        if isinstance(values, Exception) or values.ndim != 1 or (values.size and (
                values.dtype.kind not in "iu" or values.min() < 0 or values.max() >= 2**62)):  # fmt: skip
            problem = f"sequence lengths must be a list of integers from 0 to 2**62; got {str(seq_lens)[:200]}"
        else:
            lengths = values.astype(np.int64).reshape(-1, 1)
    if segments is not None:
        try:
            table = np.asarray(segments)
        except (ValueError, TypeError) as error:  # ragged rows
            table = None
            problem = problem or f"attention segments are not an [N, K] table, one row per sequence ({error})"
        width = int(table.shape[1]) if table is not None and table.ndim == 2 else 0
        if table is not None and problem is None:
            if table.ndim != 2 or table.shape[0] != len(lengths) or (table.size and (
                    table.dtype.kind not in "iu" or table.max() >= 2**62)):  # fmt: skip
                problem = (f"attention segments of shape {table.shape} ({table.dtype}); expected an [N, K] integer "
                           f"table below 2**62, one row per sequence ({len(lengths)})")  # fmt: skip
            else:
                table = table.astype(np.int64)  # exact: integers below 2**62, or none
                bad_rows = (table < 0).any(axis=1) | (table.sum(axis=1) != lengths[:, 0])
                if bad_rows.any():
                    bad = int(np.flatnonzero(bad_rows)[0])
                    problem = (f"sequence {bad} has attention segments {table[bad].tolist()}, which do not sum to "
                               f"its length {int(lengths[bad, 0])} with non-negative counts")  # fmt: skip
    return lengths, table, width, problem


def gather_step_inputs(
    seq_lens: Sequence[int],
    segments: np.ndarray | None,
    problem: str | None,
    device: torch.device,
    groups: ProcessGroups,
    report: Sequence[int],
    capacity: int = 0,
) -> GatheredStep:
    """Every rank's lengths, attention segments and report, and every rank's ``problem``: the
    step's first collective. On the good path one all-gather of a header (counts, report) with
    ``capacity`` integers of rows beside it, when every rank's lengths and segments fit there;
    otherwise a second all-gather of the rows, whatever ``K``. A problem anywhere costs another, on
    the failure path only, where every rank is: the problems' text, so every rank raises the same
    error, naming the rank and what it found (e.g. FLUX.3's bad sample), together and before any
    other collective.

    Args:
        seq_lens: ``[N]`` this rank's sequence lengths.
        segments: ``[N, K]`` non-negative integer lengths of each sequence's attention segments
            (summing to its length; e.g. ``Flux3Inputs.segments``), or ``None``. Every rank must
            give segments of the same ``K``, or none (a rank with no sequences gives ``[0, K]``).
        problem: why this rank's input is bad (a message naming the sample), or ``None``.
        device: where the collectives run.
        groups: the process groups.
        report: a few integers every rank gives (the same count on every rank).
        capacity: how many integers of rows ride the header (the same on every rank; a caller
            that gathers every step passes the ``row_ints`` it keeps room for, so the lengths cost
            one collective, not two). 0: the rows always take their own all-gather.

    Raises:
        ValueError: on every rank, the same message, when any rank has a problem, or the ranks
            disagree on ``K``.
    """
    lengths, table, width, problem = check_step_inputs(seq_lens, segments, problem)
    encoded = (problem or "").encode(errors="backslashreplace")  # a lone surrogate (a path's byte) must not raise
    mine = lengths if width <= 0 or problem else np.concatenate([lengths, table], axis=1)
    inline = np.zeros(capacity, dtype=np.int64)  # this rank's rows, if they fit and are good
    if problem is None and mine.size <= capacity:
        inline[: mine.size] = mine.ravel()
    head = [len(lengths) if problem is None else 0, len(encoded), width, *report]  # a count only read on the good path
    gathered_head = _all_gather_ints(head + inline.tolist(), device, groups.balance_group)
    header = [row[: len(head)] for row in gathered_head]
    widths = sorted({w for _, _, w, *_ in header})
    if any(size for _, size, *_ in header):
        longest = max(size for _, size, *_ in header)
        texts = _all_gather_ints(list(encoded) + [0] * (longest - len(encoded)), device, groups.balance_group)
        by_message: dict[str, list[int]] = {}
        for rank, (row, (_, size, *_)) in enumerate(zip(texts, header, strict=True)):
            if size:
                by_message.setdefault(bytes(row[:size]).decode(errors="replace"), []).append(rank)
        details = "; ".join(f"balance-group rank(s) {ranks}: {message}" for message, ranks in by_message.items())
        raise ValueError(f"invalid input, so no rank runs this step: {details}")
    if len(widths) > 1:
        raise ValueError(
            f"ranks disagree on attention segments (columns per sequence by balance-group rank, -1: none): "
            f"{[w for _, _, w, *_ in header]}; every rank must give segments of the same width, or none"
        )
    width = widths[0]
    per_row = 1 + max(width, 0)
    count = max(n for n, *_ in header)
    if count * per_row <= capacity:  # every rank's rows came with the header
        gathered = [row[len(head) : len(head) + count * per_row] for row in gathered_head]
    else:
        rows = np.zeros((count, per_row), dtype=np.int64)
        rows[: len(mine)] = mine
        gathered = _all_gather_ints(rows.ravel().tolist(), device, groups.balance_group)
    tables = [np.array(row, dtype=np.int64).reshape(-1, per_row)[:n] for row, (n, *_) in zip(gathered, header, strict=True)]  # fmt: skip
    return GatheredStep(
        seq_lens_per_rank=[table[:, 0].tolist() for table in tables],
        segments_per_rank=None if width < 0 else [table[:, 1:].tolist() for table in tables],
        reports=[list(rest) for _, _, _, *rest in header],
        row_ints=count * per_row,
    )


def gather_ints(value: int, device: torch.device, groups: ProcessGroups) -> list[int]:
    """Every balance-group rank's ``value``, by group rank. Collective: for a rank-local finding (a
    file, a worker process, which prefetched plan fits) that every rank must act on alike."""
    return [row[0] for row in _all_gather_ints([value], device, groups.balance_group)]


def _all_gather_ints(values: list[int], device: torch.device, group: Any) -> list[list[int]]:
    dist = _dist()
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return [t.tolist() for t in gathered]


def gather_sample_ints(rows: np.ndarray, routed: RoutedBatch) -> np.ndarray:
    """A few integers per home sequence (e.g. the lengths of its attention segments), for every
    sequence of the step, by sequence id. Collective over the balance group when ``routed`` was
    routed (every rank calls it); local otherwise.

    Per-sample rows of :func:`route` reach only the GPUs holding a non-empty chunk of a sequence,
    but a member of a group with an empty chunk still runs attention over the whole sequence, so
    what attention needs of a sequence travels to everyone: one small all-gather.

    Args:
        rows: ``[N_home, K]`` integers of this rank's sequences, in order.
        routed: the step's routed batch.

    Returns:
        ``[N, K]`` int64: the rows of every sequence of the step (local: ``rows``).
    """
    rows = np.asarray(rows, dtype=np.int64)
    if routed.groups is None:
        return rows
    plan, width = routed.plan, rows.shape[1]
    home_counts = np.bincount(plan.seq_src_rank, minlength=plan.num_gpus)  # every rank knows them from the plan
    padded = np.zeros((int(home_counts.max(initial=0)), width), dtype=np.int64)
    padded[: len(rows)] = rows
    if padded.size == 0:
        return np.zeros((0, width), dtype=np.int64)
    # Stamped as an exchange: between blocks, its wait for a slower rank is not this rank's compute.
    times = _times
    start = times.begin_exchange() if times is not None else None
    gathered = _all_gather_ints(padded.ravel().tolist(), routed.batch.tokens.device, routed.groups.balance_group)
    if times is not None:
        times.end_exchange("sample_ints", start)
    return np.concatenate(
        [np.array(g, dtype=np.int64).reshape(-1, width)[:count] for g, count in zip(gathered, home_counts, strict=True)]
    )


def route(batch: PackedBatch, plan: RoutingPlan, groups: ProcessGroups) -> RoutedBatch:
    """Move this rank's sequences to the GPUs ``plan`` gives them. Collective over the balance group.

    Args:
        batch: this rank's packed batch, the one whose lengths ``plan`` was made from.
        plan: the step's plan, identical on every rank.
        groups: the process groups of ``plan``'s topology.

    Returns:
        The chunks this GPU holds, with their per-token columns and per-sample rows.

    Raises:
        ValueError: on every rank, when any rank's batch is inconsistent, was not planned by ``plan``,
            or ranks hold different plans (e.g. one reused last step's).
    """
    problem = _route_problem(batch, plan, groups)
    signature = batch.signature()
    checks = _all_gather_ints(
        [problem is not None, plan.fingerprint, text_digest(signature)], batch.tokens.device, groups.balance_group
    )
    bad_ranks = [r for r, (bad, _, _) in enumerate(checks) if bad]
    if bad_ranks:
        raise ValueError(
            f"cannot route: the batch on balance-group rank(s) {bad_ranks} does not match the plan"
            + (f"; here (rank {groups.group_rank}): {problem}" if problem else "; see those ranks' errors")
        )
    if len({fingerprint for _, fingerprint, _ in checks}) > 1:
        raise ValueError(
            "cannot route: ranks hold different plans (fingerprints by rank: "
            f"{[f for _, f, _ in checks]}); every rank must route this step with the plan made from this "
            "step's gathered lengths"
        )
    if len({digest for _, _, digest in checks}) > 1:
        odd = [r for r, (_, _, digest) in enumerate(checks) if digest != checks[0][2]]
        raise ValueError(
            f"cannot route: the batches of balance-group ranks 0 and {odd} carry different tokens or columns "
            f"(here, rank {groups.group_rank}: {signature}); every rank must pack the same columns with the same "
            "dtypes, trailing shapes and requires_grad, even a rank with no samples"
        )
    layout = gpu_layout(plan, groups.group_rank)
    group, send, recv = groups.balance_group, layout.send_counts, layout.recv_counts
    local = plan.tokens_moved == 0  # RoutedBatch.stays_home: the plan is the same on every rank (checked above)
    send_rows = torch.as_tensor(layout.send_rows).to(batch.tokens.device)
    sample_rows = torch.as_tensor(layout.sample_send_index).to(batch.tokens.device)
    routed = PackedBatch(
        tokens=exchange(batch.tokens.index_select(0, send_rows), send, recv, group, "route", local),
        seq_lens=layout.chunk_lens.tolist(),
        token_data=_exchange_columns(batch.token_data, send_rows, send, recv, group, local),
        sample_data=_exchange_columns(
            batch.sample_data, sample_rows, layout.sample_send_counts, layout.sample_recv_counts, group, local
        ),
    )
    return RoutedBatch(routed, layout, plan, groups)


def _route_problem(batch: PackedBatch, plan: RoutingPlan, groups: ProcessGroups) -> str | None:
    problem = batch.problem()
    if problem:
        return problem
    if plan.topology_spec != groups.topology.spec or plan.num_gpus != groups.topology.group_size:
        return (
            f"the plan is for topology {plan.topology_spec!r} ({plan.num_gpus} GPUs) but the process groups are "
            f"for {groups.topology.spec!r}; plan with the topology the groups were made from"
        )
    planned = plan.seq_lens[plan.seq_src_rank == groups.group_rank].tolist()
    if planned != list(batch.seq_lens):
        return (
            f"the plan has sequence lengths {planned} for this rank but the batch has {list(batch.seq_lens)}; "
            "plan each step from that step's gathered lengths"
        )
    return None


def reverse_route(rows: Tensor, routed: RoutedBatch) -> Tensor:
    """Move routed rows back to their home rank and order. Collective over the balance group.

    Args:
        rows: ``[T_routed, ...]`` one row per token of ``routed.batch`` (e.g. the blocks' output, or a
            per-token column); differentiable when floating point.
        routed: what :func:`route` returned.

    Returns:
        ``[T_home, ...]`` rows in the order of the batch that was routed.
    """
    if rows.shape[0] != routed.batch.num_tokens:
        raise ValueError(
            f"reverse_route got {rows.shape[0]} rows but this GPU holds {routed.batch.num_tokens} routed tokens"
        )
    if routed.groups is None:
        return rows
    layout = routed.layout
    arrived = exchange(rows, layout.recv_counts, layout.send_counts, routed.groups.balance_group, "reverse_route",
                       routed.stays_home)  # fmt: skip
    home_order = routed.device_array("home_order", np.argsort(layout.send_rows, kind="stable"))
    return arrived.index_select(0, home_order)


def _exchange_columns(
    columns: Mapping[str, Tensor], send_rows: Tensor, send_counts, recv_counts, group: Any, local: bool
) -> dict[str, Tensor]:
    """Exchange the ``send_rows`` of every column. Columns that need a gradient go one by one through
    the differentiable exchange; the others travel together as raw bytes, so integers arrive bit-exact
    in one all-to-all."""
    out: dict[str, Tensor] = {}
    as_bytes = {}
    for name, column in columns.items():
        if column.requires_grad:
            out[name] = exchange(column.index_select(0, send_rows), send_counts, recv_counts, group, "route", local)
        else:
            as_bytes[name] = column
    if as_bytes:
        packed = torch.cat([_row_bytes(column.index_select(0, send_rows)) for column in as_bytes.values()], dim=1)
        arrived = exchange(packed, send_counts, recv_counts, group, "route", local)
        offset = 0
        for name, column in as_bytes.items():
            width = _row_bytes(column[:0]).shape[1]
            out[name] = _from_row_bytes(arrived[:, offset : offset + width], column)
            offset += width
    return {name: out[name] for name in columns}


def _row_bytes(column: Tensor) -> Tensor:
    """``[R, ...]`` -> ``[R, bytes per row]`` uint8, reinterpreting the bits."""
    # contiguous() keeps an empty tensor's strides (torch.as_tensor of an empty NumPy array has
    # stride 0), which view() to a narrower dtype rejects.
    column = column.clone(memory_format=torch.contiguous_format) if column.numel() == 0 else column.contiguous()
    flat = column.reshape(column.shape[0], math.prod(column.shape[1:]))
    return flat.view(torch.uint8)


def _from_row_bytes(raw: Tensor, like: Tensor) -> Tensor:
    """Inverse of :func:`_row_bytes` for rows shaped and typed like ``like``."""
    dtype = torch.uint8 if like.dtype == torch.bool else like.dtype
    # A fresh copy: a column slice of the byte rows has the offset and row stride of the whole row,
    # which view() to a wider dtype rejects.
    values = raw.clone(memory_format=torch.contiguous_format).view(dtype).reshape(raw.shape[0], *like.shape[1:])
    return values.bool() if like.dtype == torch.bool else values


def route_subset_rows(rows: Tensor, home_selected: np.ndarray, routed: RoutedBatch, routed_selected: Tensor) -> Tensor:
    """Rows that only some tokens have, sent to wherever the route sent those tokens. Collective
    over the balance group when ``routed`` was routed (every rank calls it); local otherwise.

    The route sends home rows destination by destination (``layout.send_rows``) and a GPU receives
    them source by source, in that order; the selected tokens keep their relative order on both
    sides, so one all-to-all with the selected rows' counts delivers them in routed order.

    Args:
        rows: ``[R, W]`` one row per selected home token, in home token order (differentiable).
        home_selected: ``[T_home]`` bool, which home tokens have a row.
        routed: the step's routed batch.
        routed_selected: ``[R_routed]`` int64 routed token rows that are selected, ascending.

    Returns:
        ``[R_routed, W]`` rows in the order of ``routed_selected``.
    """
    if routed.groups is None:
        return rows
    layout = routed.layout
    gpus = np.arange(layout.num_gpus)
    row_of_token = np.full(len(home_selected), -1, dtype=np.int64)
    row_of_token[home_selected] = np.arange(int(home_selected.sum()))
    sent = row_of_token[layout.send_rows]  # [T_home] in send order; -1 where not selected
    keep = sent >= 0
    send_counts = np.bincount(np.repeat(gpus, layout.send_counts)[keep], minlength=layout.num_gpus)
    source_of_routed = np.repeat(gpus, layout.recv_counts)
    recv_counts = np.bincount(source_of_routed[routed_selected.cpu().numpy()], minlength=layout.num_gpus)
    send = rows.index_select(0, torch.as_tensor(sent[keep], device=rows.device))
    return exchange(send, send_counts, recv_counts, routed.groups.balance_group, "route", routed.stays_home)


def route_sample_rows(rows: Tensor, row_counts: np.ndarray, routed: RoutedBatch, routed_counts: np.ndarray) -> Tensor:
    """A variable number of rows per sequence (e.g. the text tokens a video's tokens cross-attend
    to), sent to every GPU that holds a chunk of the sequence: a sequence split over a group of
    ``G`` GPUs has its rows on each of the ``G``. Collective over the balance group when ``routed``
    was routed (every rank calls it); local otherwise.

    They travel like the per-sample rows of :func:`route` (one copy per sequence and destination,
    destination by destination), each copy ``row_counts[i]`` rows long, so what arrives is in the
    order of the chunks held.

    Args:
        rows: ``[sum(row_counts), W]`` the home sequences' rows, sequence after sequence (differentiable).
        row_counts: ``[N_home]`` rows of each home sequence.
        routed: the step's routed batch.
        routed_counts: ``[n]`` rows of the sequence of each chunk held (e.g. a count routed as
            ``sample_data``), in held order.

    Returns:
        ``[sum(routed_counts), W]`` rows, chunk after chunk in held order.
    """
    if routed.groups is None:
        return rows
    layout = routed.layout
    row_counts, routed_counts = np.asarray(row_counts, dtype=np.int64), np.asarray(routed_counts, dtype=np.int64)
    gpus = np.arange(layout.num_gpus)
    sent = layout.sample_send_index  # home sequence of every copy sent, destination by destination
    send_rows = index_ranges((np.cumsum(row_counts) - row_counts)[sent], row_counts[sent])
    send_counts = np.bincount(np.repeat(gpus, layout.sample_send_counts), row_counts[sent], layout.num_gpus)
    recv_counts = np.bincount(np.repeat(gpus, layout.sample_recv_counts), routed_counts, layout.num_gpus)
    send = rows.index_select(0, torch.as_tensor(send_rows, device=rows.device))
    return exchange(send, send_counts.astype(np.int64), recv_counts.astype(np.int64), routed.groups.balance_group,
                    "route", routed.stays_home)  # fmt: skip
