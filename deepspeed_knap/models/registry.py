"""The model families, one spec each, and what they bring: cost-model presets and data mixes by name.

    from deepspeed_knap.models.registry import SPECS, spec, checkpoint_spec
    spec("wan").presets                      # {"wan2.1-1.3b": {...}, ...}
    checkpoint_spec("/models/FLUX.2-dev")    # FLUX2, from transformer/config.json's _class_name
    default_cost_model("wan2.1-14b")         # the preset's FLOP model
    sample_mix("wan_image_video", 32)        # one step's lengths, per rank

A family is registered by the line that names its spec in :data:`SPECS` (docs/models.md, "Adding a
model family"). Pure: the specs import no torch; the packed models load on first use
(:mod:`deepspeed_knap.models.auto`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.data.mixes import SHARED_MIXES, Mix, SampleShape, draw_shapes
from deepspeed_knap.models.flux.spec import FLUX1, FLUX2
from deepspeed_knap.models.flux3.spec import FLUX3
from deepspeed_knap.models.qwenimage.spec import QWEN_IMAGE
from deepspeed_knap.models.spec import ModelSpec
from deepspeed_knap.models.wan.spec import WAN

SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (FLUX1, FLUX2, FLUX3, WAN, QWEN_IMAGE)}

CONFIG_NAME = "config.json"  # a diffusers model's config, beside its weights


def spec(family: str) -> ModelSpec:
    """The spec of a family name (``"flux"``, ``"wan"``, ...).

    Raises:
        ValueError: an unknown name, naming the registered ones.
    """
    if family not in SPECS:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(SPECS)}")
    return SPECS[family]


def family_names(having: str | None = None) -> list[str]:
    """The registered families' names, in registration order; with ``having``, those whose spec has
    that attribute set (``"generator"``, ``"block_timer"``, ``"pipeline"``): what a command that needs
    it offers as ``--family`` choices."""
    return [name for name, family in SPECS.items() if having is None or getattr(family, having)]


def transformer_dir(path: str | Path) -> Path:
    """``path`` itself when it holds ``config.json``, else its ``transformer/`` (a pipeline)."""
    path = Path(path)
    for directory in (path, path / "transformer"):
        if (directory / CONFIG_NAME).is_file():
            return directory
    raise FileNotFoundError(
        f"no {CONFIG_NAME} in {path} or {path / 'transformer'}; pass the directory of a diffusers transformer "
        f"checkpoint ({CONFIG_NAME} and its weights) or of a pipeline"
    )


def checkpoint_spec(path: str | Path) -> ModelSpec:
    """The family of a diffusers checkpoint (or pipeline) directory, from ``config.json``'s
    ``_class_name``.

    Raises:
        ValueError: a ``config.json`` that is not a JSON object, or a ``_class_name`` no family
            implements, or none.
        OSError: an unreadable ``config.json``.
    """
    config_path = transformer_dir(path) / CONFIG_NAME
    config = json.loads(config_path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds a JSON {type(config).__name__}, not a diffusers config (a JSON object)")
    class_name = config.get("_class_name")
    for family in SPECS.values():
        if family.diffusers_class == class_name:
            return family
    known = {family.diffusers_class: name for name, family in SPECS.items()}
    raise ValueError(f"{config_path} has _class_name {class_name!r}, which no model family implements; known: {known}")


# ---- cost-model presets ----

PRESETS: dict[str, tuple[ModelSpec, Mapping[str, float]]] = {
    name: (family, dims) for family in SPECS.values() for name, dims in family.presets.items()
}


def _formulas() -> list[tuple[Callable[..., CostModel], set[str]]]:
    """Each FLOP formula of the registered families (registration order) and the dims it takes:
    those of its families' presets and configs, and ``num_heads``."""
    formulas: dict[Callable[..., CostModel], set[str]] = {}
    for family in SPECS.values():
        keys = formulas.setdefault(family.cost_model, {"num_heads"})
        keys.update(key for dims in family.presets.values() for key in dims)
        keys.update(family.cost_dims(family.tiny_config))
    return list(formulas.items())


def default_cost_model(model: str | Mapping[str, float] = "flux-dev", **overrides: Any) -> CostModel:
    """The FLOP cost model of a preset (:data:`PRESETS`) or of a dict of model dims, priced by the
    formula that takes those dims (FLUX's ``hidden``, ``double_blocks``, ...; Wan's ``dim``,
    ``ffn_dim``, ...). ``overrides`` replace dims, or set ``tflops``, ``alltoall_gbps``,
    ``frozen_base`` and the like.

    Raises:
        ValueError: an unknown preset, dims the preset's formula does not take, or dims of two formulas.
    """
    formulas = _formulas()
    known_dims = set().union(*(keys for _, keys in formulas))
    if isinstance(model, str):
        if model not in PRESETS:
            raise ValueError(f"unknown model preset {model!r}; choose one of {', '.join(PRESETS)} or give dims")
        family, dims = PRESETS[model]
        takes = next(keys for formula, keys in formulas if formula is family.cost_model)
        foreign = sorted(key for key in overrides if key in known_dims and key not in takes)
        if foreign:
            raise ValueError(f"{', '.join(foreign)} are not dims of {family.title} preset {model!r}, which takes "
                             f"{', '.join(sorted(takes))}")  # fmt: skip
        return family.cost_model({**dims, **overrides})
    dims = {**model, **overrides}
    given = {key for key in dims if key in known_dims} - {"num_heads"}
    fitting = [formula for formula, keys in formulas if given <= keys]
    if not fitting:
        described = "; ".join(", ".join(sorted(keys - {"num_heads"})) for _, keys in formulas)
        raise ValueError(f"model dims {', '.join(sorted(given))} mix the dims of different models; one model's "
                         f"formula takes one of: {described}")  # fmt: skip
    return fitting[0](dims)


# ---- data mixes ----

MIXES: dict[str, Mix] = {**SHARED_MIXES}
for _family in SPECS.values():
    for _name, _mix in _family.mixes.items():
        if _name in MIXES:
            raise ValueError(f"data mix {_name!r} of family {_family.name!r} is already registered")
        MIXES[_name] = _mix
del _family, _name, _mix


def sample_shapes(name: str, num_gpus: int, seed: int | np.random.Generator = 0) -> list[list[SampleShape]]:
    """One step of a bundled mix: ``num_gpus`` lists of samples (text / visual split, latent frames,
    references), one per rank; the same seed gives the same samples.

    Raises:
        ValueError: an unknown mix name, or ``num_gpus < 1``.
    """
    if name not in MIXES:
        raise ValueError(f"unknown data mix {name!r}; choose one of {', '.join(MIXES)} or give --lengths FILE.json")
    return draw_shapes(MIXES[name], num_gpus, seed)


def sample_mix(name: str, num_gpus: int, seed: int | np.random.Generator = 0) -> list[list[int]]:
    """:func:`sample_shapes`' sequence lengths, one list per rank."""
    return [[shape.length for shape in rank] for rank in sample_shapes(name, num_gpus, seed)]


def sample_segments(name: str, num_gpus: int, seed: int | np.random.Generator = 0) -> list[list[tuple[int, int, int]]]:
    """:func:`sample_mix`'s sequences as attention segments, ``(text, image, reference)`` tokens each
    (:attr:`~deepspeed_knap.data.mixes.SampleShape.segments`; the planner's ``seq_segments_per_rank``)."""
    return [[shape.segments for shape in rank] for rank in sample_shapes(name, num_gpus, seed)]
