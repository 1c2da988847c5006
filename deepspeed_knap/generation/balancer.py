"""The forward-only balancer of generation: one plan and one route per request set, reused every step.

In training each step has new lengths, so each step gathers them, solves, and prepares its route
(checks agreed in an all-gather, the GPU's layout, index tensors). In generation a request's
length is fixed over its denoising steps, and every rank knows the step's set from the
:class:`~deepspeed_knap.generation.schedule.StepBatcher`, so :class:`ReusingBalancer` takes the
batcher's plan, prepares the route at the set's first step (the training path, checks included),
and at the set's later steps only moves the tokens: the same index tensors, split sizes, layout
and attention index arrays, no planning collective. ``reuse=False`` is the training path at every
step (gather, solve, prepare), kept to measure what reuse saves.

:class:`WorkerPlanAhead` is the batcher's plan ahead: a set's plan solved in a
:class:`~deepspeed_knap.planner.worker.PlanWorker` process while the steps before the set run.

Forward only: the caller runs the model under ``torch.no_grad()``; nothing here keeps autograd state.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from deepspeed.utils import logger

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.models.registry import spec
from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.worker import PlanWorkerError
from deepspeed_knap.runtime.balancer import KnapBalancer
from deepspeed_knap.runtime.groups import ProcessGroups
from deepspeed_knap.runtime.packing import PackedBatch
from deepspeed_knap.runtime.routing import RoutedBatch, _exchange_columns, exchange, gather_ints


def forward_cost_model(family: str, config: dict, tflops: float = 400.0, alltoall_gbps: float = 150.0,
                       bytes_per_element: int = 2) -> CostModel:  # fmt: skip
    """The FLOP cost model of one *forward* of a ``family``'s transformer ``config`` (diffusers' names;
    the family's formula, :attr:`~deepspeed_knap.models.spec.ModelSpec.cost_dims`), for the planner:
    a training step's model counts forward and backward (3x the linear layers, 3.5x attention, twice
    the all-to-alls), which would price the Ulysses all-to-all too cheaply against compute here."""
    rates = dict(tflops=tflops, alltoall_gbps=alltoall_gbps, bytes_per_element=bytes_per_element, forward_only=True)
    return spec(family).config_cost_model(config, **rates)


@dataclasses.dataclass
class _PreparedRoute:
    """What the route of a set's first step left to reuse: its routed batch (layout, plan, groups,
    attention index arrays) and the index tensors that pick each destination's rows."""

    routed: RoutedBatch
    seq_lens: tuple[int, ...]  # this rank's home lengths the route was made for
    send_rows: torch.Tensor  # [T_home] home token rows, destination by destination
    sample_rows: torch.Tensor  # [copies] home sequence of each per-sample row sent


class ReusingBalancer(KnapBalancer):
    """A :class:`~deepspeed_knap.runtime.balancer.KnapBalancer` for the steps of a request set.

    Before each forward the generation loop calls :meth:`begin_step` with the step's set (the
    same on every rank) and the batcher's plan of it. ``plan_s`` and ``route_s`` list, per forward,
    this rank's seconds from the start of planning to the plan, and from the plan to the routed
    batch (preparation and the route's all-to-alls); ``solves`` counts the plans solved here.

    Args:
        groups, cost_model, solver, max_tokens_per_gpu: as :class:`KnapBalancer`'s.
        reuse: reuse the plan and the route while the set is unchanged; ``False``: gather, solve
            and prepare at every step, as training does.
    """

    def __init__(self, groups: ProcessGroups, cost_model: CostModel, solver: str = "refine",
                 max_tokens_per_gpu: int | None = None, reuse: bool = True) -> None:  # fmt: skip
        super().__init__(groups, cost_model, solver=solver, max_tokens_per_gpu=max_tokens_per_gpu)
        self.reuse = reuse
        self.solves = 0
        self.plan_s: list[float] = []
        self.route_s: list[float] = []
        self._set: tuple[int, ...] | None = None
        self._set_plan: tuple[list[list[int]], RoutingPlan] | None = None
        self._prepared: _PreparedRoute | None = None

    def begin_step(self, request_set: tuple[int, ...], plan: RoutingPlan, seq_lens_per_rank: list[list[int]]) -> None:
        """The next forward runs ``request_set`` (request indices, identical on every rank) under
        ``plan``, made from ``seq_lens_per_rank``. A set other than the last drops the prepared route."""
        if request_set != self._set:
            self._set, self._prepared = request_set, None
        self._set_plan = (seq_lens_per_rank, plan)

    def plan(self, batch: PackedBatch) -> RoutingPlan:
        """The step's plan: the batcher's (no collective), or with ``reuse=False`` gathered and solved
        here as in training (collective)."""
        start = time.perf_counter()
        if not self.reuse:
            plan = super().plan(batch)
            self.solves += 1
        else:
            if self._set_plan is None:
                raise RuntimeError("ReusingBalancer: call begin_step(request_set, plan, lengths) before each forward")
            self.close_step()
            seq_lens_per_rank, plan = self._set_plan
            self._last = (seq_lens_per_rank, plan, 0.0, True, self.cost_model, False)  # for metrics()
            self.steps += 1
        self.plan_s.append(time.perf_counter() - start)
        return plan

    def route(self, batch: PackedBatch, plan: RoutingPlan) -> RoutedBatch:
        """Route ``batch`` by ``plan``: prepared as in training at a set's first step (or every step
        without reuse), then only the exchanges of the tokens and their columns."""
        start = time.perf_counter()
        prepared = self._prepared
        if not self.reuse or prepared is None or prepared.routed.plan is not plan:
            routed = super().route(batch, plan)
            layout = routed.layout
            device = batch.tokens.device
            self._prepared = _PreparedRoute(routed, tuple(batch.seq_lens),
                                            torch.as_tensor(layout.send_rows).to(device),
                                            torch.as_tensor(layout.sample_send_index).to(device))  # fmt: skip
        else:
            routed = self._reroute(batch, prepared)
        self.route_s.append(time.perf_counter() - start)
        return routed

    def _reroute(self, batch: PackedBatch, prepared: _PreparedRoute) -> RoutedBatch:
        """The set's route again, for this step's tokens and columns: the three all-to-alls of
        :func:`~deepspeed_knap.runtime.routing.route` (tokens, per-token columns, per-sample rows)
        with its split sizes and index tensors. The attention index arrays of the first step's routed
        batch (``device_array``) are kept: they depend only on the layout."""
        if tuple(batch.seq_lens) != prepared.seq_lens:
            # The set is the same on every rank, so a rank's lengths can change only by a bug in the
            # loop that packs it; the others would wait in the exchange below, hence the clear error.
            raise RuntimeError(f"rank {self.groups.rank}: the request set {self._set} packed lengths "
                               f"{list(batch.seq_lens)} here, but its route was made for {list(prepared.seq_lens)}")  # fmt: skip
        layout, group, local = prepared.routed.layout, self.groups.balance_group, prepared.routed.stays_home
        send, recv = layout.send_counts, layout.recv_counts
        sample_counts = layout.sample_send_counts, layout.sample_recv_counts
        moved = PackedBatch(
            tokens=exchange(batch.tokens.index_select(0, prepared.send_rows), send, recv, group, "route", local),
            seq_lens=prepared.routed.batch.seq_lens,
            token_data=_exchange_columns(batch.token_data, prepared.send_rows, send, recv, group, local),
            sample_data=_exchange_columns(batch.sample_data, prepared.sample_rows, *sample_counts, group, local),
        )
        return dataclasses.replace(prepared.routed, batch=moved)

    def forward_seconds(self) -> dict[str, float]:
        """This rank's seconds in the forward just run: ``compute`` (the block stack less the
        exchanges inside it, Ulysses', the routes between blocks and the per-sample gathers, which
        include waiting for peers: :attr:`~deepspeed_knap.runtime.timing.StepTimes.inside`) and
        ``exchange`` (the exchanges of every kind). Local."""
        times = self._in_flight[0]
        marks = times.marks
        blocks = marks["blocks_start"].seconds_until(marks["blocks_end"])
        by_kind = {kind: sum(a.seconds_until(b) for a, b in pairs) for kind, pairs in times.spans.items()}
        inside = sum(a.seconds_until(b) for a, b in times.inside)
        return {"compute": blocks - inside, "exchange": float(sum(by_kind.values()))}


class WorkerPlanAhead:
    """The :class:`~deepspeed_knap.generation.schedule.StepBatcher`'s plan ahead on the balancer's
    planner: :meth:`submit` sends a set's lengths to a :class:`~deepspeed_knap.planner.worker.PlanWorker`
    process (``plan_routing`` with the balancer's topology, cost model, solver and budget: the plan
    the batcher's in-step ``solve`` makes, bit for bit) and returns; :meth:`collect`, at the step the
    set starts, takes its plan.

    Every rank runs the same batcher and so submits the same sets at the same steps, to the same
    deterministic planner; but a worker may fail on one rank only (it died, could not start, or gave
    no plan within the balancer's worker timeout), so :meth:`collect` agrees in one small all-gather
    over ``device``: the worker's plan on every rank, or ``None`` on every rank, and the batcher
    solves the set in the step as without plan ahead (a set the planner refused in the worker is
    refused again there, and backs off). Training's prefetch agrees the same way
    (:meth:`~deepspeed_knap.runtime.balancer.KnapBalancer.prefetch`).

    Attributes:
        wait_s: seconds :meth:`collect` waited for the worker's plans (not the agreement).

    Args:
        balancer: whose planner settings, worker timeout and groups to use.
        device: the accelerator device the agreement's tensor goes on (gloo: ``cpu``).
    """

    def __init__(self, balancer: ReusingBalancer, device: torch.device | str) -> None:
        self.balancer = balancer
        self.device = torch.device(device)
        self.wait_s = 0.0
        self._worker = balancer.plan_worker()  # the balancer's: a balancer serving several runs starts one
        self._ticket: int | None = None  # the job submitted and not collected

    def submit(self, seq_lens_per_rank: list[list[int]]) -> None:
        """Start solving the plan of ``seq_lens_per_rank`` (one list of sequence lengths per rank) in
        the worker. Local; returns once the job is sent (at once unless the worker's pipe is full;
        replies the worker has written are read first)."""
        balancer = self.balancer
        if self._ticket is not None:  # never collected (the batcher collects each): its reply is dropped
            self._worker.discard(self._ticket)
        self._ticket = self._worker.submit(seq_lens_per_rank, balancer.groups.topology, balancer.cost_model,
                                           balancer.solver, balancer.max_tokens_per_gpu,
                                           timeout_s=balancer._worker_timeout_s)  # fmt: skip

    def collect(self) -> RoutingPlan | None:
        """The plan of the last :meth:`submit`, or ``None`` on every rank when any rank's worker gave
        none (the failure is logged on that rank). Collective."""
        ticket, self._ticket = self._ticket, None
        start = time.perf_counter()
        try:
            plan, failure = self._worker.result(ticket, self.balancer._worker_timeout_s)[0], None
        except PlanWorkerError as error:
            plan, failure = None, str(error)
        self.wait_s += time.perf_counter() - start
        groups = self.balancer.groups
        ready = gather_ints(int(failure is None), self.device, groups)
        if all(ready):
            return plan
        # Each rank names what it got instead of a plan (the planner's refusal, before a back-off, is
        # named on every rank); rank 0 adds which ranks had the plan when only some had.
        if failure is not None:
            logger.warning(f"knapformer generate rank {groups.rank}: a request set planned in the step: {failure}")
        if groups.group_rank == 0 and any(ready):
            logger.warning(f"knapformer generate: a request set planned in the step on every rank; its plan came "
                           f"ahead by rank (1: yes, 0: no): {ready}")  # fmt: skip
        return None

    def close(self) -> None:
        """Drop a plan not collected (a run that ended early); the worker stays with the balancer."""
        if self._ticket is not None:
            self._worker.discard(self._ticket)
            self._ticket = None
