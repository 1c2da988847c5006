"""KnapFormer-style online balancing of DiT training for DeepSpeed.

Each step the ranks of a balance group gather their sequence lengths, solve the same assignment of
whole sequences to compute bags (groups of GPUs running DeepSpeed-Ulysses), route tokens there, run
the transformer blocks, and route them back. See ``README.md`` and ``docs/design.md``.

The package's layers, bottom up (docs/design.md, "Layout"): ``planner/``, ``cost/`` and ``data/``
are pure NumPy and Python; ``runtime/`` holds the torch and communication code; ``models/`` the
packed model families; ``engine`` and ``config`` the DeepSpeed integration; ``cli``, ``commands/``
and ``bench/`` the command line.

The planner names import eagerly (pure NumPy, fast). The names that need torch and DeepSpeed import
on first use, so ``deepspeed-knap plan`` and planner-only users do not pay for them.
"""

import importlib

from deepspeed_knap import _deprecated
from deepspeed_knap.cost.model import CostModel, fit_cost_model
from deepspeed_knap.models.registry import MIXES, default_cost_model, sample_mix
from deepspeed_knap.planner import (
    DEFAULT_SOLVER,
    SOLVERS,
    RoutingPlan,
    Topology,
    build_topology,
    lower_bound,
    parse_topology_spec,
    plan_loads,
    plan_routing,
)

__version__ = "0.1.0"

_deprecated.install()

_LAZY = {
    "initialize": "deepspeed_knap.engine",
    "token_mean_loss": "deepspeed_knap.engine",
    "global_mean_loss": "deepspeed_knap.engine",
    "KnapFormerConfig": "deepspeed_knap.runtime.config",
    "get_knapformer_config": "deepspeed_knap.runtime.config",
    "KnapBalancer": "deepspeed_knap.runtime.balancer",
    "balanced_forward": "deepspeed_knap.runtime.balancer",
    "KnapDistributedAttention": "deepspeed_knap.runtime.attention",
    "VarlenAttention": "deepspeed_knap.runtime.attention",
    "PackedBatch": "deepspeed_knap.runtime.packing",
    "pack_samples": "deepspeed_knap.runtime.packing",
    "unpack_tokens": "deepspeed_knap.runtime.packing",
    "RoutedBatch": "deepspeed_knap.runtime.routing",
    "gather_seq_lens": "deepspeed_knap.runtime.routing",
    "local_batch": "deepspeed_knap.runtime.routing",
    "reverse_route": "deepspeed_knap.runtime.routing",
    "route": "deepspeed_knap.runtime.routing",
    "ProcessGroups": "deepspeed_knap.runtime.groups",
    "create_process_groups": "deepspeed_knap.runtime.groups",
    "raise_together": "deepspeed_knap.runtime.groups",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _deprecated.RENAMED:
        return _deprecated.renamed(name)
    if f"deepspeed_knap.{name}" in _deprecated.MOVED_MODULES:  # an old submodule: deepspeed_knap.topology
        return importlib.import_module(f"deepspeed_knap.{name}")
    raise AttributeError(f"module 'deepspeed_knap' has no attribute {name!r}")


__all__ = [
    "DEFAULT_SOLVER",
    "MIXES",
    "SOLVERS",
    "CostModel",
    "RoutingPlan",
    "Topology",
    "build_topology",
    "default_cost_model",
    "fit_cost_model",
    "lower_bound",
    "parse_topology_spec",
    "plan_loads",
    "plan_routing",
    "sample_mix",
    *_LAZY,
]
