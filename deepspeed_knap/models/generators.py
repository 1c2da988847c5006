"""Each generation family's generator by name: a tiny random one, or one loaded from a diffusers
pipeline directory by its transformer's family (:func:`~deepspeed_knap.models.registry.checkpoint_family`).
The families are :data:`~deepspeed_knap.generation.requests.FAMILIES`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepspeed_knap.models.flux.generate import load_flux_generator, tiny_flux_generator
from deepspeed_knap.models.registry import checkpoint_family
from deepspeed_knap.models.wan.generate import load_wan_generator, tiny_wan_generator


def tiny_generator(family: str, dtype: Any, device: Any, seed: int = 0, config: dict | None = None) -> Any:
    """A tiny random generator of ``family`` (its ``TINY_*`` transformer, or ``config``, and tiny
    pipeline parts), the same on every rank for a ``seed``: for CPU runs, tests and benchmarks.

    Raises:
        ValueError: a family generation does not run.
    """
    if family == "wan":
        return tiny_wan_generator(dtype, device, seed, config)
    return tiny_flux_generator(dtype, device, seed, config, family=family)


def load_generator(path: str | Path, dtype: Any, device: Any) -> Any:
    """A diffusers pipeline directory as its family's generator (by its transformer's family).

    Raises:
        ValueError: a checkpoint generation cannot run (FLUX.3, Wan I2V or A14B).
    """
    if checkpoint_family(path) == "wan":
        return load_wan_generator(path, dtype, device)
    return load_flux_generator(path, dtype, device)
