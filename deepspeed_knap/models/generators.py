"""Each family's generator by name: a tiny random one, or one loaded from a diffusers pipeline
directory by its transformer's family. The families are those whose spec names a ``generator``
(:func:`~deepspeed_knap.models.registry.family_names` with ``"generator"``); the generator class gives
``tiny(dtype, device, seed, config)`` and ``load(path, dtype, device)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepspeed_knap.models.registry import checkpoint_spec, family_names, spec
from deepspeed_knap.models.spec import ModelSpec


def _generator_class(family: ModelSpec) -> Any:
    if family.generator is None:
        raise ValueError(f"deepspeed-knap generate does not run {family.title} ({family.name!r}); it runs "
                         f"{', '.join(family_names('generator'))}")  # fmt: skip
    return family.load("generator")


def tiny_generator(family: str, dtype: Any, device: Any, seed: int = 0, config: dict | None = None) -> Any:
    """A tiny random generator of ``family`` (its spec's ``tiny_config``, or ``config``, and tiny
    pipeline parts), the same on every rank for a ``seed``: for CPU runs, tests and benchmarks.

    Raises:
        ValueError: a family generation does not run.
    """
    return _generator_class(spec(family)).tiny(dtype, device, seed, config)


def load_generator(path: str | Path, dtype: Any, device: Any) -> Any:
    """A diffusers pipeline directory as its family's generator (by its transformer's family).

    Raises:
        ValueError: a checkpoint generation cannot run.
    """
    return _generator_class(checkpoint_spec(path)).load(path, dtype, device)
