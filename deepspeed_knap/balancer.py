"""The balancer: plan -> route -> blocks -> reverse route, the glue a model's block stack runs in.

    balancer = KnapBalancer(groups, workload)
    out = balanced_forward(batch, blocks, balancer)  # blocks(routed: RoutedBatch) -> [T_routed, D]

``blocks`` sees the tokens this GPU runs (``routed.batch``) and passes ``routed`` to every
:class:`~deepspeed_knap.attention.KnapDistributedAttention`; the result comes back in the home
rank's token order, so the loss is computed exactly as without balancing. Collectives happen only in
:mod:`~deepspeed_knap.routing` and :mod:`~deepspeed_knap.attention`; this module only sequences them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from deepspeed.utils import logger
from torch import Tensor

from deepspeed_knap.packing import PackedBatch
from deepspeed_knap.planner import DEFAULT_SOLVER, RoutingPlan, plan_routing
from deepspeed_knap.routing import RoutedBatch, gather_seq_lens, local_batch, reverse_route, route
from deepspeed_knap.topology import ProcessGroups
from deepspeed_knap.workload import WorkloadModel


class KnapBalancer:
    """Balances one step's packed batches over a topology's bags.

    Args:
        groups: from :func:`~deepspeed_knap.topology.create_process_groups`.
        workload: the cost model the planner balances.
        solver: planner solver (see :data:`~deepspeed_knap.planner.SOLVERS`).
        max_tokens_per_gpu: memory cap for the planner, or ``None``.
        log_interval: every this many plans, global rank 0 logs the modeled imbalance before and after,
            the solve time and the share of tokens moved (of its balance group); 0 never.
        monitor: a DeepSpeed ``MonitorMaster`` (``engine.monitor``) that gets the same numbers.
    """

    def __init__(
        self,
        groups: ProcessGroups,
        workload: WorkloadModel,
        solver: str = DEFAULT_SOLVER,
        max_tokens_per_gpu: int | None = None,
        log_interval: int = 0,
        monitor: Any = None,
    ) -> None:
        self.groups = groups
        self.workload = workload
        self.solver = solver
        self.max_tokens_per_gpu = max_tokens_per_gpu
        self.log_interval = log_interval
        self.monitor = monitor
        self.steps = 0
        self._last: tuple[list[list[int]], RoutingPlan, float] | None = None

    def plan(self, batch: PackedBatch) -> RoutingPlan:
        """Gather every rank's lengths and solve; every rank gets the same plan. Collective."""
        seq_lens_per_rank = gather_seq_lens(batch, self.groups)
        start = time.perf_counter()
        plan = plan_routing(
            seq_lens_per_rank, self.groups.topology, self.workload, self.solver, self.max_tokens_per_gpu
        )
        self._last = (seq_lens_per_rank, plan, time.perf_counter() - start)
        self.steps += 1
        if self.log_interval and self.steps % self.log_interval == 0 and self.groups.rank == 0:
            self._log(self.metrics())
        return plan

    def metrics(self) -> dict[str, float]:
        """The last plan's numbers (of this rank's balance group): modeled imbalance (max/mean GPU
        load) without and with balancing, solve time, share of tokens moved. Local: no collective."""
        if self._last is None:
            raise RuntimeError("no step has been planned yet; call metrics() after the model's forward")
        seq_lens_per_rank, plan, solve_s = self._last
        unbalanced = plan_routing(seq_lens_per_rank, self.groups.topology, self.workload, "none")
        return {
            "knapformer/imbalance_before": unbalanced.imbalance,
            "knapformer/imbalance_after": plan.imbalance,
            "knapformer/solve_ms": solve_s * 1e3,
            "knapformer/tokens_moved": plan.tokens_moved_fraction,
        }

    def _log(self, metrics: dict[str, float]) -> None:
        logger.info(
            f"knapformer step {self.steps}: modeled imbalance {metrics['knapformer/imbalance_before']:.3f} -> "
            f"{metrics['knapformer/imbalance_after']:.3f}, solve {metrics['knapformer/solve_ms']:.1f} ms, "
            f"tokens moved {metrics['knapformer/tokens_moved']:.1%}"
        )
        if self.monitor is not None and self.monitor.enabled:
            self.monitor.write_events([(name, value, self.steps) for name, value in metrics.items()])

    def route(self, batch: PackedBatch, plan: RoutingPlan) -> RoutedBatch:
        return route(batch, plan, self.groups)

    def forward(self, batch: PackedBatch, blocks: Callable[[RoutedBatch], Tensor]) -> Tensor:
        """Run ``blocks`` on the balanced tokens and return its ``[T_routed, ...]`` output as
        ``[T, ...]`` rows in ``batch``'s order.

        Raises:
            RuntimeError: naming the step and this rank, when a collective fails (a rank died, or one
                stuck past the groups' timeout) or the blocks raise.
        """
        step = self.steps + 1
        try:
            routed = self.route(batch, self.plan(batch))
            return reverse_route(blocks(routed), routed)
        except RuntimeError as error:
            raise RuntimeError(f"knapformer step {step} failed on rank {self.groups.rank}: {error}") from error


def balanced_forward(
    batch: PackedBatch, blocks: Callable[[RoutedBatch], Tensor], balancer: KnapBalancer | None = None
) -> Tensor:
    """``balancer.forward(batch, blocks)``, or with ``balancer=None`` ``blocks`` on this rank's own
    sequences: the same model without balancing and without communication.

    The backward pass runs the route's all-to-alls in reverse, so every rank must backpropagate
    through its output, even a rank with no tokens: ``blocks`` must return a tensor computed by the
    layers (not a fresh ``zeros``), and the loss must depend on it (``(out * w).sum()`` of an empty
    ``out`` is 0 and still on the graph; a ``0 * sum(params)`` stand-in would leave the other ranks
    waiting in the backward all-to-all).
    """
    if balancer is None:
        return blocks(local_batch(batch))
    return balancer.forward(batch, blocks)
