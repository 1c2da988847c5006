"""Model families by name, and the family of a checkpoint from its ``config.json``.

    model = from_pretrained("/models/FLUX.2-dev", ds_config=ds_config)  # a PackedFlux2Transformer
    model = FAMILIES["flux"](**config)

A third family is a module with a :class:`~deepspeed_knap.models.flux.base.PackedFluxBase` subclass
(its ``family`` name and ``diffusers_class``) and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deepspeed_knap.models.flux.base import PackedFluxBase
from deepspeed_knap.models.flux.flux1 import PackedFluxTransformer
from deepspeed_knap.models.flux.flux2 import PackedFlux2Transformer
from deepspeed_knap.models.flux3.flux3 import PackedFlux3Transformer
from deepspeed_knap.models.loading import CONFIG_NAME, CheckpointError, checked, plain_ds_config, transformer_dir
from deepspeed_knap.models.wan.wan import PackedWanTransformer

FAMILIES: dict[str, type[PackedFluxBase | PackedWanTransformer]] = {
    cls.family: cls
    for cls in (PackedFluxTransformer, PackedFlux2Transformer, PackedFlux3Transformer, PackedWanTransformer)
}


def family_class(family: str) -> type[PackedFluxBase]:
    """The model class of a family name (``"flux"``, ``"flux2"``)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def checkpoint_family(path: str | Path) -> str:
    """The family of a diffusers checkpoint (or pipeline) directory, from ``config.json``'s
    ``_class_name``.

    Raises:
        CheckpointError: a ``_class_name`` no family implements, or none.
    """
    config_path = transformer_dir(path) / CONFIG_NAME
    class_name = json.loads(config_path.read_text()).get("_class_name")
    for family, cls in FAMILIES.items():
        if cls.diffusers_class == class_name:
            return family
    known = {cls.diffusers_class: family for family, cls in FAMILIES.items()}
    raise CheckpointError(
        f"{config_path} has _class_name {class_name!r}, which no model family implements; known: {known}"
    )


def from_pretrained(path: str | Path, ds_config: Any = None, **kwargs: Any) -> PackedFluxBase:
    """``from_pretrained`` of the checkpoint's family (:func:`checkpoint_family`); arguments as
    :meth:`~deepspeed_knap.models.flux.base.PackedFluxBase.from_pretrained`'s. With ``ds_config``,
    collective: every rank raises the same error when any rank cannot tell the family."""
    plain = None if ds_config is None else plain_ds_config(ds_config)
    family = checked(plain, "reading a checkpoint's model family", lambda: checkpoint_family(path))
    return family_class(family).from_pretrained(path, ds_config=ds_config, **kwargs)
