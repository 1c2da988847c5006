"""KnapFormer-style online balancing of DiT training for DeepSpeed.

Each step the ranks of a balance group gather their sequence lengths, solve the same assignment of
whole sequences to compute bags (groups of GPUs running DeepSpeed-Ulysses), route tokens there, run
the transformer blocks, and route them back. See ``README.md`` and ``DESIGN.md``.
"""

from deepspeed_knap.planner import DEFAULT_SOLVER, SOLVERS, RoutingPlan, plan_routing
from deepspeed_knap.topology import Topology, build_topology, parse_topology_spec
from deepspeed_knap.workload import WorkloadModel, default_workload, fit_workload
from deepspeed_knap.workloads import WORKLOADS, sample_workload

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SOLVER",
    "SOLVERS",
    "WORKLOADS",
    "RoutingPlan",
    "Topology",
    "WorkloadModel",
    "build_topology",
    "default_workload",
    "fit_workload",
    "parse_topology_spec",
    "plan_routing",
    "sample_workload",
]
