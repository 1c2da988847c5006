"""The packed model of a family name or of a checkpoint directory (the family from its ``config.json``).

model = from_pretrained("/models/FLUX.2-dev", ds_config=ds_config)  # a PackedFlux2Transformer
model = model_class("wan")(**config)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepspeed_knap.models.loading import CheckpointError, checked, plain_ds_config
from deepspeed_knap.models.registry import checkpoint_spec, spec


def model_class(family: str) -> type:
    """The packed model class of a family name (``"flux"``, ``"wan"``, ...).

    Raises:
        ValueError: an unknown name.
    """
    return spec(family).model_class


def checkpoint_family(path: str | Path) -> str:
    """The family name of a diffusers checkpoint (or pipeline) directory.

    Raises:
        CheckpointError: a ``_class_name`` no family implements, or no ``config.json``.
    """
    try:
        return checkpoint_spec(path).name
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def from_pretrained(path: str | Path, ds_config: Any = None, **kwargs: Any) -> Any:
    """``from_pretrained`` of the checkpoint's family (:func:`checkpoint_family`); arguments as
    :meth:`~deepspeed_knap.models.loading.DiffusersCheckpoint.from_pretrained`'s. With ``ds_config``,
    collective: every rank raises the same error when any rank cannot tell the family."""
    from deepspeed_knap.runtime.config import read_ds_config

    if ds_config is not None:  # read once, agreed by every rank (a file one rank cannot read is one error)
        ds_config = read_ds_config(ds_config)
    plain = None if ds_config is None else plain_ds_config(ds_config)
    family = checked(plain, "reading the checkpoint's model family", lambda: checkpoint_family(path),
                     "the checkpoint's model family")  # fmt: skip
    return model_class(family).from_pretrained(path, ds_config=ds_config, **kwargs)
