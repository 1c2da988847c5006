"""Old import paths and names, kept for one release with a ``DeprecationWarning``.

The package was reorganised into layers (``planner/``, ``cost/``, ``data/``, ``runtime/``,
``models/``; docs/design.md). ``import deepspeed_knap.routing`` still works: it gives a stand-in
module whose names are those of ``deepspeed_knap.runtime.routing`` (the same objects), and
``from deepspeed_knap.workload import WorkloadModel`` gives
:class:`~deepspeed_knap.cost.model.CostModel`; both warn, naming the new place. Old pickles load
the same way. A stand-in is its own module object: setting an attribute on it (a monkeypatch)
does not reach the new module; patch the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

_GROUP_NAMES = ("ProcessGroups", "create_process_groups", "check_same_on_every_rank", "text_digest",
                "raise_together", "all_gather_bytes")  # fmt: skip

# Old module path -> (new module path, {old or moved name: (module, its name there)}). Names not listed
# are looked up in the new module.
MOVED_MODULES: dict[str, tuple[str, dict[str, tuple[str, str]]]] = {
    "deepspeed_knap.config": (
        "deepspeed_knap.runtime.config",
        {"KnapWorkloadConfig": ("deepspeed_knap.runtime.config", "KnapCostModelConfig")},
    ),
    "deepspeed_knap.elastic": ("deepspeed_knap.planner.elastic", {}),
    # topology.py was split: the grammar went to the planner, the process groups to the runtime.
    "deepspeed_knap.topology": (
        "deepspeed_knap.planner.topology",
        {name: ("deepspeed_knap.runtime.groups", name) for name in _GROUP_NAMES},
    ),
    "deepspeed_knap.plan_worker": ("deepspeed_knap.planner.worker", {}),
    "deepspeed_knap.workload": (
        "deepspeed_knap.cost.model",
        {
            "WorkloadModel": ("deepspeed_knap.cost.model", "CostModel"),
            "default_workload": ("deepspeed_knap.models.registry", "default_cost_model"),
            "fit_workload": ("deepspeed_knap.cost.model", "fit_cost_model"),
        },
    ),
    "deepspeed_knap.online": (
        "deepspeed_knap.cost.online",
        {"OnlineWorkload": ("deepspeed_knap.cost.online", "OnlineCostModel")},
    ),
    "deepspeed_knap.bench.calibrate": ("deepspeed_knap.cost.calibrate", {}),
    "deepspeed_knap.workloads": (
        "deepspeed_knap.data.mixes",
        {
            "WORKLOADS": ("deepspeed_knap.models.registry", "MIXES"),
            "sample_workload": ("deepspeed_knap.models.registry", "sample_mix"),
        },
    ),
    "deepspeed_knap.doctor": ("deepspeed_knap.commands.doctor", {}),
    "deepspeed_knap.models.flux2": (
        "deepspeed_knap.models.flux.flux2",
        {"text_ids": ("deepspeed_knap.models.flux.base", "text_ids")},
    ),
    "deepspeed_knap.models.flux_base": (
        "deepspeed_knap.models.flux.base",
        {name: ("deepspeed_knap.models.loading", name) for name in ("EXTRA_ARGS",)},
    ),
    "deepspeed_knap.models.flux_layers": ("deepspeed_knap.models.flux.layers", {}),
    "deepspeed_knap.models.flux_data": ("deepspeed_knap.models.flux.data", {}),
    "deepspeed_knap.models.flux_finetune": ("deepspeed_knap.models.flux.finetune", {}),
    **{
        f"deepspeed_knap.{name}": (f"deepspeed_knap.runtime.{name}", {})
        for name in ("attention", "balancer", "layout", "packing", "routing", "shm_buffers", "timing")
    },
}

# Old top-level name -> (module, new name).
RENAMED = {
    "WorkloadModel": ("deepspeed_knap.cost.model", "CostModel"),
    "default_workload": ("deepspeed_knap.models.registry", "default_cost_model"),
    "fit_workload": ("deepspeed_knap.cost.model", "fit_cost_model"),
    "WORKLOADS": ("deepspeed_knap.models.registry", "MIXES"),
    "sample_workload": ("deepspeed_knap.models.registry", "sample_mix"),
}


def _warn(old: str, module: str, new: str) -> None:
    warnings.warn(f"{old} is now {module}.{new}; the old name goes in the next release", DeprecationWarning,
                  stacklevel=3)  # fmt: skip


def renamed(name: str):
    """The object an old top-level ``name`` now has, with a ``DeprecationWarning``."""
    module, new = RENAMED[name]
    _warn(f"deepspeed_knap.{name}", module, new)
    return getattr(importlib.import_module(module), new)


class MovedModule(types.ModuleType):
    """The stand-in for an old module path: its names resolve in the module now at the new path,
    old and moved names through their table (with a warning)."""

    def __init__(self, name: str, target: str, names: dict[str, tuple[str, str]]) -> None:
        super().__init__(name, f"Deprecated: moved to {target}.")
        self._target, self._names = target, names

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._names:
            module, new = self._names[name]
            _warn(f"{self.__name__}.{name}", module, new)
            return getattr(importlib.import_module(module), new)
        return getattr(importlib.import_module(self._target), name)

    def __dir__(self) -> list[str]:
        return sorted({*dir(importlib.import_module(self._target)), *self._names})


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as a :class:`MovedModule`, with a warning naming the new path."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        target, names = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {target}; import it from there (the old path goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        importlib.import_module(target)  # an error in the new module shows at the import, as before
        return MovedModule(spec.name, target, names)

    def exec_module(self, module) -> None:  # the stand-in resolves names on use
        pass


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
