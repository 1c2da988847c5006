"""The planner: per-rank sequence lengths + topology + cost model -> :class:`RoutingPlan`.

Pure NumPy and Python, no torch: every rank of a balance group calls :func:`plan_routing` on the
same gathered lengths and gets a bit-identical plan, and the planner can be tested and benchmarked
for 1,024 simulated GPUs on a laptop.

* :mod:`~deepspeed_knap.planner.topology`: the topology grammar (``g8n4``, ``auto``) and bags.
* :mod:`~deepspeed_knap.planner.plan`: :class:`RoutingPlan`, the output.
* :mod:`~deepspeed_knap.planner.problem`: :class:`Problem`, one step's lengths, bags and quantised costs.
* :mod:`~deepspeed_knap.planner.search`: the exact and local search both solvers share.
* :mod:`~deepspeed_knap.planner.fixed` and :mod:`~deepspeed_knap.planner.elastic`: the solvers for
  fixed bags and for topology ``auto``.
* :mod:`~deepspeed_knap.planner.route`: the price of the tokens a plan moves, and keeping home what does not pay.
* :mod:`~deepspeed_knap.planner.solve`: the entry points, :func:`plan_routing` and :func:`lower_bound`.
* :mod:`~deepspeed_knap.planner.worker`: :class:`PlanWorker`, which solves the next step in a child process.
"""

from deepspeed_knap.planner.plan import RoutingPlan
from deepspeed_knap.planner.solve import (
    DEFAULT_REFINE_STEPS,
    DEFAULT_SOLVER,
    SOLVERS,
    lower_bound,
    plan_loads,
    plan_route_s,
    plan_routing,
)
from deepspeed_knap.planner.topology import AUTO, Topology, build_topology, parse_topology_spec

__all__ = [
    "AUTO",
    "DEFAULT_REFINE_STEPS",
    "DEFAULT_SOLVER",
    "SOLVERS",
    "RoutingPlan",
    "Topology",
    "build_topology",
    "lower_bound",
    "parse_topology_spec",
    "plan_loads",
    "plan_route_s",
    "plan_routing",
]
