"""The balancer: plan -> route -> blocks -> reverse route, the glue a model's block stack runs in.

    balancer = KnapBalancer(groups, cost_model)
    out = balanced_forward(batch, blocks, balancer)  # blocks(routed: RoutedBatch) -> [T_routed, D]

``blocks`` sees the tokens this GPU runs (``routed.batch``) and passes ``routed`` to every
:class:`~deepspeed_knap.runtime.attention.KnapDistributedAttention`; the result comes back in the home
rank's token order, so the loss is computed exactly as without balancing. Collectives happen only in
:mod:`~deepspeed_knap.runtime.routing` and :mod:`~deepspeed_knap.runtime.attention`; this module only sequences them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger
from torch import Tensor

from deepspeed_knap.cost.model import CostModel, segment_square_sums
from deepspeed_knap.cost.online import OnlineCostModel, OnlineSettings
from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.route import moved_tokens
from deepspeed_knap.planner.solve import DEFAULT_REFINE_STEPS, DEFAULT_SOLVER, plan_loads, plan_routing
from deepspeed_knap.planner.worker import PlanWorker, PlanWorkerError, WorkerPlan
from deepspeed_knap.runtime.attention import balanced_backward_end, balanced_blocks, balanced_in_backward
from deepspeed_knap.runtime.groups import ProcessGroups
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.routing import (
    GatheredStep,
    RoutedBatch,
    check_step_inputs,
    gather_ints,
    gather_step_inputs,
    local_batch,
    reverse_route,
    route,
    time_exchanges,
)
from deepspeed_knap.runtime.timing import PLAN_PARTS, StepTimes, stamp

# The balancer's parts of a step (StepTimes.seconds) that are collectives: each rank's time in one
# includes its wait for the ranks that arrive later (a slow rank's extra compute, shown as a fast
# rank's route wait), so the overhead takes each one's least over ranks (the last to arrive waits
# least). The refit (recording the closed step's times, the online refit) and the solve (in the step,
# or the wait for the worker's plan) are each rank's own, back to back with no collective between.
OVERHEAD_COLLECTIVES = ("gather", "agree", "route", "reverse_route")
OVERHEAD_LOCAL = ("refit", "solve")
# What a rank ships of its closed step with the next lengths gather (microseconds, -1: unknown).
_REPORTED = ("compute", "ulysses", "step", *OVERHEAD_LOCAL, *OVERHEAD_COLLECTIVES)
_OVERHEAD_COLUMNS = [_REPORTED.index(part) for part in (*OVERHEAD_LOCAL, *OVERHEAD_COLLECTIVES)]


def balancer_overhead_s(phases_per_rank: Sequence[Mapping[str, float]]) -> float:
    """Seconds the balancer added to a step, from every rank's breakdown of it
    (:meth:`KnapBalancer.close_step`'s): the largest over ranks of a rank's refit and solve together
    (its own work, done back to back, which holds the other ranks back at the next collective),
    plus, per collective part (the lengths gather, the agreement on a prefetched plan, the route and
    the reverse route), its least time over ranks. A
    collective's time on one rank includes waiting for later ranks, which is their imbalance and not
    the balancer's cost; the last rank to arrive waits least, so the least is the nearest to the
    exchange itself (at worst, it still holds the last arrival's wait at another part). The plan
    parts are host seconds (``time.perf_counter``); the routes are timed by device events (the
    accelerator's clock, the host's on CPU)."""
    parts = (*OVERHEAD_LOCAL, *OVERHEAD_COLLECTIVES)
    seconds = np.array([[phases.get(part, 0.0) for part in parts] for phases in phases_per_rank], dtype=np.float64)
    return _overhead_s(seconds.reshape(-1, len(parts)))


def _overhead_s(seconds: np.ndarray) -> float:
    """:func:`balancer_overhead_s` of ``[S, P]`` seconds per rank of the parts ``(*OVERHEAD_LOCAL,
    *OVERHEAD_COLLECTIVES)``, in that order."""
    if not len(seconds):
        return 0.0
    local = float(seconds[:, : len(OVERHEAD_LOCAL)].sum(axis=1).max())
    return local + float(seconds[:, len(OVERHEAD_LOCAL) :].min(axis=0).sum())


# A step's plan with what it was made of: (lengths per rank, plan, solve seconds, solved ahead, the
# cost model it was solved with, solved by another rank's worker on this host).
_Planned = tuple[list[list[int]], RoutingPlan, float, bool, CostModel, bool]


# What a rank whose plan worker is still starting offers in the agreement on a prefetched plan (a
# plan's id otherwise, -1: none): every rank then plans the step itself, and warns only of what else
# it finds (a rank without the plan).
_WORKER_STARTING = -2

# Plans prefetched and not used yet that are kept, the oldest dropped first: one for the next
# forward and one for the forward after it, in the documented loop; more only after skipped forwards.
_MAX_AHEAD = 2
# The most integers of lengths and segments a rank pads into every lengths gather's header (8 KiB):
# a step with more (a validation pass of many short sequences) takes the second all-gather, sized to
# that step, rather than every later step paying for its size. A DiT step's rows are far fewer.
_MAX_GATHER_CAPACITY = 1024


@dataclasses.dataclass
class _PlanAhead:
    """A step's plan solving in the worker process since :meth:`KnapBalancer.prefetch`."""

    seq_lens_per_rank: list[list[int]]
    model: CostModel  # the cost model it is solved with
    ticket: int  # the worker's job
    seq_lens: list[int]  # this rank's: a forward whose batch has these lengths may use the plan
    segments_per_rank: list[list[list[int]]] | None = None  # every rank's attention segments, or None
    segments: list[list[int]] | None = None  # this rank's: a forward must give these too
    reply: WorkerPlan | str | None = None  # the worker's plan or the failure, once read

    def read(self, worker: PlanWorker, timeout_s: float) -> WorkerPlan | str:
        """The worker's plan for it, or why there is none; waits for the solve, at most ``timeout_s``."""
        if self.reply is None:
            try:
                self.reply = worker.result(self.ticket, timeout_s)
            except PlanWorkerError as error:
                self.reply = str(error)
        return self.reply


class KnapBalancer:
    """Balances one step's packed batches over a topology's bags.

    Every step it also times this rank's share (plan, route, compute, Ulysses all-to-alls, reverse
    route; :mod:`~deepspeed_knap.runtime.timing`) and ships the compute and Ulysses microseconds with the next
    step's lengths, in the same all-gather: every rank then knows every rank's measured times of the
    last step. With ``online`` settings the cost model is refit from them every step but the first
    measured one, whose one-time costs are not the model's (:mod:`~deepspeed_knap.cost.online`),
    identically on every rank. With :meth:`prefetch` the next
    step's plan is solved in a worker process while this step runs.

    Args:
        groups: from :func:`~deepspeed_knap.runtime.groups.create_process_groups`.
        cost_model: the cost model the planner balances (the prior, with ``online``).
        solver: planner solver (see :data:`~deepspeed_knap.planner.SOLVERS`).
        max_tokens_per_gpu: memory cap for the planner, or ``None``.
        log_interval: every this many plans, global rank 0 logs the metrics of its balance group
            (:meth:`metrics`); 0 never.
        monitor: a DeepSpeed ``MonitorMaster`` (``engine.monitor``) that gets the same numbers.
        online: refit the cost model from measured times with these settings; ``None``: never.
    """

    def __init__(
        self,
        groups: ProcessGroups,
        cost_model: CostModel,
        solver: str = DEFAULT_SOLVER,
        max_tokens_per_gpu: int | None = None,
        log_interval: int = 0,
        monitor: Any = None,
        online: OnlineSettings | None = None,
    ) -> None:
        self.groups = groups
        self.cost_model = cost_model
        self.solver = solver
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.log_interval = log_interval
        self.monitor = monitor
        self.online = None if online is None else OnlineCostModel(cost_model, groups.topology.group_size, online)
        self.steps = 0
        self.last_times: dict[str, float] | None = None  # this rank's breakdown of the last finished step
        self._last: _Planned | None = None
        self._last_segments: list[list[list[int]]] | None = None  # the attention segments _last was planned with
        # The step in flight and the step close_step() ended: plan, model, and the attention segments
        # per rank it was planned with (None: without), to price it.
        self._in_flight: tuple[StepTimes, RoutingPlan, CostModel, list | None] | None = None
        self._closed: tuple[RoutingPlan, CostModel, list | None] | None = None
        self._report = [-1] * len(_REPORTED)  # this rank's _REPORTED microseconds, shipped with the next lengths
        self._measured: tuple[list[int], list[float]] | None = None  # last step: measured us, predicted s
        self._measured_steps = 0  # recorded steps some rank measured (_record): the first is not learned from
        self._worker: PlanWorker | None = None  # started by the first prefetch
        self._prefetches = 0  # prefetch() calls so far: a prefetched plan's id, the same on every rank
        self._ahead: dict[int, _PlanAhead] = {}  # by id, oldest first; at most _MAX_AHEAD
        # Integers of lengths and segments that ride the lengths gather's header: the most a rank
        # has sent in a step of at most _MAX_GATHER_CAPACITY, rounded up to a power of two; the same
        # on every rank, so a step's lengths take one all-gather instead of two once a step has shown
        # their size (a larger step takes its own second gather and leaves the room as it was).
        self._gather_capacity = 0
        # What forward() was given for the step it plans (attention segments, the model's problem).
        self._step_inputs: tuple[np.ndarray | None, str | None] = (None, None)
        # Host seconds of the next forward's plan by part, until that forward takes them: a prefetch's
        # gather is charged to the step of the forward that runs after it (prefetch(k + 1) comes just
        # before forward(k), so step k carries the gather of the plan step k + 1 uses).
        self._plan_parts = dict.fromkeys(PLAN_PARTS, 0.0)
        self._last_close: float | None = None  # perf_counter at the last step's close: steps' wall time
        self._overhead: float | None = None  # the last measured step's balancer overhead over its wall time

    def plan_worker(self) -> PlanWorker:
        """This balancer's plan worker, started on first use (its process at the first job) and
        stopped with the balancer: training's prefetch and generation's plans ahead share it, and
        a balancer that serves several runs starts it once."""
        if self._worker is None:
            self._worker = PlanWorker()
            weakref.finalize(self, self._worker.close)
        return self._worker

    @property
    def _worker_timeout_s(self) -> float:
        """How long this rank waits for its plan worker, at a prefetch or a forward. The other ranks
        wait for this one in their next collective: ours (the groups' timeout) or, under ZeRO-3, a
        parameter gather (DeepSpeed's). A third of the shorter leaves room for both waits between
        two of ours: a stuck worker is given up on first, and every rank plans that step itself."""
        from deepspeed.constants import default_pg_timeout

        return min(self.groups.timeout, default_pg_timeout).total_seconds() / 3

    @property
    def model(self) -> CostModel:
        """The cost model the next step is planned with."""
        return self.online.model() if self.online is not None else self.cost_model

    def plan(self, batch: PackedBatch, segments: np.ndarray | None = None, problem: str | None = None) -> RoutingPlan:
        """Gather every rank's lengths (and last step's times) and solve; every rank gets the same
        plan. Collective. A plan :meth:`prefetch` solved for lengths equal to this batch's, on every
        rank, is used instead.

        Args:
            batch: this rank's packed batch.
            segments: ``[N, K]`` attention segments of the batch's sequences (FLUX.3's modes: text,
                image, references; see :func:`~deepspeed_knap.runtime.routing.gather_step_inputs`),
                gathered with the lengths and priced by the cost model's
                ``segment_attention_share``; ``None``: one segment each. Every rank gives ``K``
                columns, or none. Default: what :meth:`forward` was given.
            problem: why this rank's input is bad (e.g. a model's check of its samples, naming the
                sample), or ``None``. It rides the lengths gather, the step's first collective: every
                rank raises the same error naming it. Default: what :meth:`forward` was given.

        Raises:
            ValueError: on every rank, the same message, when any rank has a problem (its input's,
                or its batch's :meth:`PackedBatch.problem`).
        """
        pending, self._step_inputs = self._step_inputs, (None, None)
        segments = pending[0] if segments is None else segments
        problem = problem or pending[1] or batch.problem()
        self.close_step()
        found = self._plan_ahead(batch, segments, problem) if self._ahead else None  # the same keys on every rank
        if found is None:
            gathered = self._gather(batch.seq_lens, segments, problem, batch.tokens.device)
            model = self.model
            start = time.perf_counter()
            plan = plan_routing(gathered.seq_lens_per_rank, self.groups.topology, model, self.solver,
                                self.max_tokens_per_gpu, DEFAULT_REFINE_STEPS, gathered.segments_per_rank)  # fmt: skip
            found = (gathered.seq_lens_per_rank, plan, time.perf_counter() - start, False, model, False)
            self._plan_parts["solve"] += found[2]
            self._last_segments = gathered.segments_per_rank
        self._last = found
        self.steps += 1
        if self.log_interval and self.steps % self.log_interval == 0 and self.groups.rank == 0:
            self._log(self.metrics())
        return found[1]

    def prefetch(
        self,
        next_seq_lens: Sequence[int],
        device: torch.device | str | None = None,
        next_segments: np.ndarray | None = None,
    ) -> None:
        """Start planning the *next* step now: gather its lengths (of the batch the step after the
        one about to run will get, e.g. ``PackedBatch.seq_lens`` or ``FluxInputs.seq_lens``) and
        solve its plan in a worker process (:class:`~deepspeed_knap.planner.worker.PlanWorker`) while
        this step runs. Collective, over ``device`` (default: DeepSpeed's current accelerator
        device). Call it once per forward (per micro-batch under gradient accumulation), before the
        forward, with the lengths of the forward after it::

            balancer.prefetch(next_batch.seq_lens)
            out = model(batch, balancer)  # batch's plan was solved during the last step

        The plan is the one :meth:`plan` would solve, with the cost model as it stands now: with
        ``online``, one step older (the step about to run is not measured yet). A later forward uses
        it when every rank's batch has the lengths that rank prefetched (the oldest such plan, agreed
        in one small all-gather); otherwise every rank plans that forward itself, as without prefetch
        (the ranks concerned log why). So does a forward whose plan is unanswered by a worker that
        is still starting (:meth:`~deepspeed_knap.planner.worker.PlanWorker.waits_for_start`),
        silently: waiting would cost the step the worker's start-up. So a forward skipped after its
        prefetch, or an extra one (a validation loss through the balancer), costs that forward its
        plan ahead and nothing more.
        The last two prefetched plans not used yet are kept.

        ``next_segments``: that batch's attention segments (``[N, K]``, as :meth:`plan` takes them;
        FLUX.3: ``next_inputs.segments``), or ``None``. A forward uses the plan only if it gives
        the same segments.

        Raises:
            ValueError: on every rank, when any rank's lengths are not non-negative integers, or its
                segments do not cover them.
        """
        seq_lens = list(next_seq_lens)
        problem = None
        if not all(isinstance(n, numbers.Integral) and 0 <= n < 2**62 for n in seq_lens):
            problem = f"prefetch: next_seq_lens must be non-negative integers below 2**62; got {seq_lens}"
        device = torch.device(get_accelerator().current_device_name() if device is None else device)
        self.close_step()
        gathered = self._gather(seq_lens, next_segments, problem, device)
        model = self.model
        ticket = self.plan_worker().submit(gathered.seq_lens_per_rank, self.groups.topology, model, self.solver,
                                     self.max_tokens_per_gpu, DEFAULT_REFINE_STEPS, gathered.segments_per_rank,
                                     timeout_s=self._worker_timeout_s)  # fmt: skip
        self._ahead[self._prefetches] = _PlanAhead(
            gathered.seq_lens_per_rank,
            model,
            ticket,
            [int(n) for n in seq_lens],
            gathered.segments_per_rank,
            None if next_segments is None else np.asarray(next_segments, dtype=np.int64).tolist(),
        )
        self._prefetches += 1
        while len(self._ahead) > _MAX_AHEAD:
            self._worker.discard(self._ahead.pop(next(iter(self._ahead))).ticket)

    def _gather(
        self, seq_lens: Sequence[int], segments: np.ndarray | None, problem: str | None, device: torch.device
    ) -> GatheredStep:
        """Every rank's lengths and segments (:func:`~deepspeed_knap.runtime.routing.gather_step_inputs`),
        shipping this rank's times of the last closed step and recording every rank's (and the online
        refit). Collective."""
        previous, report = self._closed, self._report
        self._closed, self._report = None, [-1] * len(_REPORTED)
        start = time.perf_counter()
        gathered = gather_step_inputs(seq_lens, segments, problem, device, self.groups, report, self._gather_capacity)
        self._plan_parts["gather"] += time.perf_counter() - start
        if self._gather_capacity < gathered.row_ints <= _MAX_GATHER_CAPACITY:
            self._gather_capacity = 1 << (gathered.row_ints - 1).bit_length()
        if previous is not None:
            start = time.perf_counter()
            self._record(*previous, gathered.reports)
            self._plan_parts["refit"] += time.perf_counter() - start
        return gathered

    def _plan_ahead(self, batch: PackedBatch, segments: np.ndarray | None, problem: str | None) -> _Planned | None:
        """``(lengths, plan, solve seconds, True, model, shared)`` of the oldest plan prefetched for this
        batch's lengths on every rank, or ``None`` if the ranks find none (they log why) or a rank's
        plan worker is still starting (not waited for: :meth:`PlanWorker.waits_for_start`). The plans
        older than the newest any rank found are dropped, and the one used. Collective: which plan
        matches, and whether a worker failed, differ between ranks."""
        chosen, failure, bad_batch = -1, None, problem is not None  # a bad batch: the fallback raises
        seq_lens = list(batch.seq_lens)
        # Inputs the lengths gather would refuse (ragged rows, which converting here would raise on
        # this rank alone; floats; bools) match no plan: the fallback's gather names them on every rank.
        _, table, _, refused = check_step_inputs(batch.seq_lens, segments)
        bad_batch = bad_batch or refused is not None
        rows = None if table is None or bad_batch else table.tolist()
        match = next((i for i, ahead in self._ahead.items() if ahead.seq_lens == seq_lens and ahead.segments == rows),
                     None)  # fmt: skip
        start = time.perf_counter()
        ahead = None if match is None or bad_batch else self._ahead[match]
        if ahead is not None and ahead.reply is None and self._worker.waits_for_start(ahead.ticket):
            # Waiting for the worker's first plan would cost this step what is left of its start-up
            # (0.14-0.42 s on CPU hosts, where bench train's steps take 0.1 s) and first solve;
            # solving here takes the solve alone (milliseconds, at 1,024 GPUs up to ~1 s).
            chosen = _WORKER_STARTING
        elif ahead is not None:
            reply = ahead.read(self._worker, self._worker_timeout_s)
            chosen, failure = (match, None) if isinstance(reply, tuple) else (-1, reply)
        agree_start = time.perf_counter()
        self._plan_parts["solve"] += agree_start - start  # waiting for the worker's plan
        choices = gather_ints(chosen, batch.tokens.device, self.groups)
        self._plan_parts["agree"] += time.perf_counter() - agree_start
        agreed = min(choices) == max(choices) >= 0
        used, prefetched = self._ahead.get(chosen), [ahead.seq_lens for ahead in self._ahead.values()]
        # Agreed: the plans up to the one used are done with. Not: those older than the newest any
        # rank found; that one may be the next forward's (its lengths recurring on some rank).
        for i in [i for i in self._ahead if i < max(choices) or (agreed and i == chosen)]:  # the same on every rank
            self._worker.discard(self._ahead.pop(i).ticket)  # its reply, if read already, is dropped
        if agreed:
            plan, solve_s, shared = used.reply
            self._last_segments = used.segments_per_rank
            return used.seq_lens_per_rank, plan, solve_s, True, used.model, shared
        # A forward no rank prefetched for (the first, a validation loss) is planned in the step
        # silently; a worker's failure, or ranks finding different plans, is worth a line.
        # A worker still starting is expected (after each start) and not worth a line by itself.
        step, found = self.steps + 1, {choice for choice in choices if choice >= 0}
        if failure is not None:
            logger.warning(f"knapformer rank {self.groups.rank}: step {step} planned in the step: {failure}")
        elif chosen == -1 and found and not bad_batch:
            logger.warning(f"knapformer rank {self.groups.rank}: step {step} planned in the step: no plan was "
                           f"prefetched for a batch of lengths {seq_lens} (prefetched: {prefetched})")  # fmt: skip
        if self.groups.group_rank == 0 and found and (-1 in choices or len(found) > 1):
            logger.warning(f"knapformer: step {step} planned in the step; the prefetched plan each balance-group "
                           f"rank found for its batch (-1: none, -2: its worker still starting): {choices}")  # fmt: skip
        return None

    def close_step(self) -> dict[str, float] | None:
        """End the timing of the step in flight (once its backward is done) and return this rank's
        breakdown of it (:meth:`~deepspeed_knap.runtime.timing.StepTimes.seconds`), also kept as
        :attr:`last_times`; ``None`` when unknown (no step, no backward, a timer that failed). From
        the second step on it also holds ``step``, the wall seconds since the last step's close. The
        plan's parts (``gather``, ``refit``, ``solve``, ``agree``) are host seconds, the exchanges device-event
        seconds, and this rank's collectives among them include its waits for slower ranks, so the
        overhead budget is not this rank's sum: the next :meth:`plan` calls this if the training loop
        did not and ships the result to every rank, and each then computes the step's overhead from
        every rank's (:func:`balancer_overhead_s`, in :meth:`metrics`)."""
        if self._in_flight is None:
            return self.last_times
        times, plan, model, segments_per_rank = self._in_flight
        # A new step's report replaces any not shipped yet (a prefetched step gathers nothing).
        self._in_flight, self._closed = None, (plan, model, segments_per_rank)
        self._report = [-1] * len(_REPORTED)
        time_exchanges(None, times)
        try:
            seconds = times.seconds()
        except RuntimeError as error:  # a CUDA event that never recorded
            logger.warning(f"knapformer rank {self.groups.rank}: step timer failed ({error}); step not measured")
            seconds = None
        now = time.perf_counter()
        if seconds is not None and self._last_close is not None and now > self._last_close:
            seconds["step"] = now - self._last_close  # close to close: the whole loop's wall time
        self._last_close = now
        self.last_times = seconds
        if seconds is not None:
            values = [seconds.get(name, -1.0) for name in _REPORTED]  # no "step" on the first: -1
            if all(math.isfinite(v) for v in values) and seconds["compute"] >= 0 and seconds["ulysses"] >= 0:
                self._report = [round(v * 1e6) if v >= 0 else -1 for v in values]
            else:
                logger.warning(f"knapformer rank {self.groups.rank}: step timer read {seconds}; step not measured")
        return seconds

    def _record(self, plan: RoutingPlan, model: CostModel, segments_per_rank: list | None,
                reports: list[list[int]]) -> None:  # fmt: skip
        """Every rank's measured times of the step planned by ``plan`` (with ``model`` and
        ``segments_per_rank``, or ``None``)."""
        table = np.asarray(reports, dtype=np.int64).reshape(len(reports), len(_REPORTED))  # [S, R] microseconds
        compute_us = table[:, 0].tolist()
        self._overhead = None
        if len(table) and table.min() >= 0:
            step_s = table[:, _REPORTED.index("step")].max() / 1e6
            if step_s > 0:
                self._overhead = _overhead_s(table[:, _OVERHEAD_COLUMNS] / 1e6) / step_s
        # The first measured step carries one-time costs (allocator growth, lazy initialisation, the
        # first collectives' connections): on 2 CPU ranks a process's first step took a median 1.45x
        # (0.85x-2.8x) the next step's compute per token, which the refit would read as scatter (a
        # 2x slower rank called only at step 4) and as scale. It is priced, not learned from. (The
        # reports are all-gathered: every rank counts alike.)
        measured = any(us >= 0 for us in compute_us)
        self._measured_steps += measured
        # A forward no rank timed (no backward: a validation loss; a timer that failed) says nothing:
        # observing it would age the evidence (forgetting) and count towards warm-up and refits.
        if self.online is not None and measured and self._measured_steps > 1:
            squares = None
            if segments_per_rank is not None:
                squares = segment_square_sums([row for rows in segments_per_rank for row in rows]).tolist()
            route, reverse = table[:, _REPORTED.index("route")], table[:, _REPORTED.index("reverse_route")]
            route_us = np.where(np.minimum(route, reverse) >= 0, route + reverse, -1).tolist()
            predicted = self.online.observe(plan, compute_us, table[:, 1].tolist(), squares, route_us,
                                            moved_tokens(plan))  # fmt: skip
        else:
            compute_model = dataclasses.replace(model, alltoall_coef=0.0)
            predicted = plan_loads(plan, compute_model, segments_per_rank).tolist()
        self._measured = (compute_us, predicted)

    def metrics(self) -> dict[str, float]:
        """The last plan's numbers (of this rank's balance group): modeled imbalance (max/mean GPU
        load) without and with balancing, solve time (``planned_ahead`` 1: solved in the worker
        process, during the step before; ``plan_shared`` 1: by another rank's worker on this host,
        whose solve time it is), share of tokens moved; once a step has been
        measured, that step's measured imbalance (max/mean of the ranks' compute seconds), the model's
        median relative error over ranks, the balancer's overhead in it (``overhead``: from the
        second step, :func:`balancer_overhead_s` of every rank's times over the longest rank's step;
        waits for slower ranks left out), and with online refit the smallest and largest rank speed
        and, once refit from the route phases, ``route_coef`` and ``route_latency_s``.
        Local: no collective."""
        if self._last is None:
            raise RuntimeError("no step has been planned yet; call metrics() after the model's forward")
        seq_lens_per_rank, plan, solve_s, ahead, model, shared = self._last
        unbalanced = plan_routing(seq_lens_per_rank, self.groups.topology, model, "none", None, DEFAULT_REFINE_STEPS,
                                  self._last_segments)  # fmt: skip
        metrics = {
            "knapformer/imbalance_before": unbalanced.imbalance,
            "knapformer/imbalance_after": plan.imbalance,
            "knapformer/solve_ms": solve_s * 1e3,
            "knapformer/planned_ahead": float(ahead),
            "knapformer/plan_shared": float(shared),
            "knapformer/tokens_moved": plan.tokens_moved_fraction,
        }
        if self._measured is not None:
            measured = [t / 1e6 for t in self._measured[0] if t >= 0]
            errors = sorted(
                abs(p - t / 1e6) / (t / 1e6) for t, p in zip(*self._measured, strict=True) if t > 0 and p > 0
            )
            if measured and sum(measured) > 0:
                metrics["knapformer/measured_imbalance"] = max(measured) / (sum(measured) / len(measured))
            if errors:
                metrics["knapformer/prediction_error"] = errors[len(errors) // 2]
        if self._overhead is not None:
            metrics["knapformer/overhead"] = self._overhead
        if self.online is not None:
            metrics["knapformer/speed_min"] = min(self.online.speeds)
            metrics["knapformer/speed_max"] = max(self.online.speeds)
            if self.online.route_fitted:
                metrics["knapformer/route_coef"] = self.online.model().route_coef
                metrics["knapformer/route_latency_s"] = self.online.model().route_latency_s
        return metrics

    def _log(self, metrics: dict[str, float]) -> None:
        # A shared plan is one solved ahead (by a sibling's worker).
        solved = " (ahead, shared)" if metrics["knapformer/plan_shared"] else " (ahead)" if metrics[
            "knapformer/planned_ahead"] else ""  # fmt: skip
        line = (
            f"knapformer step {self.steps}: modeled imbalance {metrics['knapformer/imbalance_before']:.3f} -> "
            f"{metrics['knapformer/imbalance_after']:.3f}, solve {metrics['knapformer/solve_ms']:.1f} ms{solved}, "
            f"tokens moved {metrics['knapformer/tokens_moved']:.1%}"
        )
        if "knapformer/measured_imbalance" in metrics:
            line += f"; last step measured imbalance {metrics['knapformer/measured_imbalance']:.3f}"
        if "knapformer/prediction_error" in metrics:
            line += f", model error {metrics['knapformer/prediction_error']:.1%}"
        if "knapformer/overhead" in metrics:
            line += f", balancer overhead {metrics['knapformer/overhead']:.1%} of that step"
        if "knapformer/speed_min" in metrics:
            line += f", rank speeds {metrics['knapformer/speed_min']:.2f}..{metrics['knapformer/speed_max']:.2f}"
        if "knapformer/route_coef" in metrics:
            line += f", route {metrics['knapformer/route_coef'] * 1e9:.3g} ns/token"
            line += f" + {metrics['knapformer/route_latency_s'] * 1e3:.3g} ms once any token moves"
        logger.info(line)
        if self.monitor is not None and self.monitor.enabled:
            self.monitor.write_events([(name, value, self.steps) for name, value in metrics.items()])

    def route(self, batch: PackedBatch, plan: RoutingPlan) -> RoutedBatch:
        return route(batch, plan, self.groups)

    def forward(
        self,
        batch: PackedBatch,
        blocks: Callable[[RoutedBatch], Tensor],
        segments: np.ndarray | None = None,
        problem: str | None = None,
    ) -> Tensor:
        """Run ``blocks`` on the balanced tokens and return its ``[T_routed, ...]`` output as
        ``[T, ...]`` rows in ``batch``'s order. The block stack is stamped at both ends, forward and
        backward, for the step's measured compute time. ``segments`` and ``problem``: as
        :meth:`plan` takes them (the step's attention segments; why this rank's input is bad, raised
        on every rank by the first collective).

        Raises:
            RuntimeError: naming the step and this rank, when a collective fails (a rank died, or one
                stuck past the groups' timeout) or the blocks raise.
        """
        step = self.steps + 1
        try:
            self.close_step()  # the last step's record, before this one's starts
            times = StepTimes(batch.tokens.device)
            time_exchanges(times)
            times.mark("plan_start")
            self._step_inputs = (segments, problem)  # for plan(), which a subclass may override
            plan = self.plan(batch)  # a subclass may plan otherwise: the plan routed is the one timed
            times.mark("plan_end")
            times.plan_parts, self._plan_parts = self._plan_parts, dict.fromkeys(PLAN_PARTS, 0.0)
            # The segments the plan was made with (a subclass's own plan: none known).
            planned = self._last is not None and self._last[1] is plan
            # The model the plan was solved with (plan() may refit before solving; a subclass's own plan: now's).
            model = self._last[4] if planned else self.model
            self._in_flight = (times, plan, model, self._last_segments if planned else None)
            routed = self.route(batch, plan)
            tokens = balanced_backward_end(stamp(routed.batch.tokens, times, "blocks_start", "blocks_grad_end"))
            routed = routed.with_tokens(tokens)
            with balanced_blocks(routed):  # drop-in DistributedAttention modules balance it, forward
                out = blocks(routed)
            out = stamp(balanced_in_backward(out, routed), times, "blocks_end", "blocks_grad_start")  # and backward
            return reverse_route(out, routed)
        except RuntimeError as error:
            raise RuntimeError(f"knapformer step {step} failed on rank {self.groups.rank}: {error}") from error


def balanced_forward(
    batch: PackedBatch,
    blocks: Callable[[RoutedBatch], Tensor],
    balancer: KnapBalancer | None = None,
    segments: np.ndarray | None = None,
    problem: str | None = None,
) -> Tensor:
    """``balancer.forward(batch, blocks, segments, problem)``, or with ``balancer=None`` ``blocks`` on
    this rank's own sequences: the same model without balancing and without communication (a
    ``problem`` then raises here, there being no other rank to tell).

    The backward pass runs the route's all-to-alls in reverse, so every rank must backpropagate
    through its output, even a rank with no tokens: ``blocks`` must return a tensor computed by the
    layers (not a fresh ``zeros``), and the loss must depend on it (``(out * w).sum()`` of an empty
    ``out`` is 0 and still on the graph; a ``0 * sum(params)`` stand-in would leave the other ranks
    waiting in the backward all-to-all).
    """
    if balancer is None:
        if problem:
            raise ValueError(problem)
        return blocks(local_batch(batch))
    if segments is None and problem is None:  # a subclass's forward(batch, blocks) of before still runs
        return balancer.forward(batch, blocks)
    return balancer.forward(batch, blocks, segments, problem)
