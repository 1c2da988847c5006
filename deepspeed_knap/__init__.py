"""KnapFormer-style online balancing of DiT training for DeepSpeed.

Each step the ranks of a balance group gather their sequence lengths, solve the same assignment of
whole sequences to compute bags (groups of GPUs running DeepSpeed-Ulysses), route tokens there, run
the transformer blocks, and route them back. See ``README.md`` and ``DESIGN.md``.

The planner names import eagerly (pure NumPy, fast). The names that need torch and DeepSpeed import
on first use, so ``deepspeed-knap plan`` and planner-only users do not pay for them.
"""

import importlib

from deepspeed_knap.planner import DEFAULT_SOLVER, SOLVERS, RoutingPlan, lower_bound, plan_loads, plan_routing
from deepspeed_knap.topology import Topology, build_topology, parse_topology_spec
from deepspeed_knap.workload import WorkloadModel, default_workload, fit_workload
from deepspeed_knap.workloads import WORKLOADS, sample_workload

__version__ = "0.1.0"

_LAZY = {
    "initialize": "deepspeed_knap.engine",
    "token_mean_loss": "deepspeed_knap.engine",
    "global_mean_loss": "deepspeed_knap.engine",
    "KnapFormerConfig": "deepspeed_knap.config",
    "get_knapformer_config": "deepspeed_knap.config",
    "KnapBalancer": "deepspeed_knap.balancer",
    "balanced_forward": "deepspeed_knap.balancer",
    "KnapDistributedAttention": "deepspeed_knap.attention",
    "VarlenAttention": "deepspeed_knap.attention",
    "PackedBatch": "deepspeed_knap.packing",
    "pack_samples": "deepspeed_knap.packing",
    "unpack_tokens": "deepspeed_knap.packing",
    "RoutedBatch": "deepspeed_knap.routing",
    "gather_seq_lens": "deepspeed_knap.routing",
    "local_batch": "deepspeed_knap.routing",
    "reverse_route": "deepspeed_knap.routing",
    "route": "deepspeed_knap.routing",
    "ProcessGroups": "deepspeed_knap.topology",
    "create_process_groups": "deepspeed_knap.topology",
    "raise_together": "deepspeed_knap.topology",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deepspeed_knap' has no attribute {name!r}")


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
    "lower_bound",
    "parse_topology_spec",
    "plan_loads",
    "plan_routing",
    "sample_workload",
    *_LAZY,
]
