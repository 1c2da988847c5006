"""Old import paths and names, kept for one release with a ``DeprecationWarning``.

The package was reorganised into layers (``planner/``, ``cost/``, ``data/``, ``runtime/``,
``models/``; docs/design.md). ``import deepspeed_knap.routing`` still works and gives the module now
at ``deepspeed_knap.runtime.routing`` (the same module object), and ``deepspeed_knap.WorkloadModel``
gives :class:`~deepspeed_knap.cost.model.CostModel`; both warn, naming the new place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

# Old module path -> new. ``deepspeed_knap.topology`` was split: the grammar went to the planner,
# the process groups to ``deepspeed_knap.runtime.groups`` (also exported as ``deepspeed_knap.ProcessGroups``).
MOVED_MODULES = {
    "deepspeed_knap.config": "deepspeed_knap.runtime.config",
    "deepspeed_knap.elastic": "deepspeed_knap.planner.elastic",
    "deepspeed_knap.topology": "deepspeed_knap.planner.topology",
    "deepspeed_knap.plan_worker": "deepspeed_knap.planner.worker",
    "deepspeed_knap.workload": "deepspeed_knap.cost.model",
    "deepspeed_knap.online": "deepspeed_knap.cost.online",
    "deepspeed_knap.bench.calibrate": "deepspeed_knap.cost.calibrate",
    "deepspeed_knap.workloads": "deepspeed_knap.data.mixes",
    "deepspeed_knap.doctor": "deepspeed_knap.commands.doctor",
    "deepspeed_knap.models.flux2": "deepspeed_knap.models.flux.flux2",
    "deepspeed_knap.models.flux_base": "deepspeed_knap.models.flux.base",
    "deepspeed_knap.models.flux_layers": "deepspeed_knap.models.flux.layers",
    "deepspeed_knap.models.flux_data": "deepspeed_knap.models.flux.data",
    "deepspeed_knap.models.flux_finetune": "deepspeed_knap.models.flux.finetune",
    **{
        f"deepspeed_knap.{name}": f"deepspeed_knap.runtime.{name}"
        for name in ("attention", "balancer", "layout", "packing", "routing", "shm_buffers", "timing")
    },
}

# Old top-level name -> (module, new name).
RENAMED = {
    "WorkloadModel": ("deepspeed_knap.cost.model", "CostModel"),
    "default_workload": ("deepspeed_knap.cost.model", "default_cost_model"),
    "fit_workload": ("deepspeed_knap.cost.model", "fit_cost_model"),
    "WORKLOADS": ("deepspeed_knap.data.mixes", "MIXES"),
    "sample_workload": ("deepspeed_knap.data.mixes", "sample_mix"),
}


def renamed(name: str):
    """The object an old top-level ``name`` now has, with a ``DeprecationWarning``."""
    module, new = RENAMED[name]
    warnings.warn(
        f"deepspeed_knap.{name} is now {module}.{new} (also deepspeed_knap.{new}); the old name goes in the next "
        "release",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(module), new)


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as the module at its new path (the same object), with a warning."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old path goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:  # the module at the new path is already executed
        pass


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
