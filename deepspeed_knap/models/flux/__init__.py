"""The FLUX families: FLUX.1 (:mod:`.flux1`) and FLUX.2 (:mod:`.flux2`) on a shared base
(:mod:`.base`, :mod:`.layers`), their specs (:mod:`.spec`), prepared data (:mod:`.data`) and
fine-tuning hooks (:mod:`.finetune`).

``from deepspeed_knap.models.flux import PackedFluxTransformer`` works as before; the names load on
first use, so that reading the family's spec (:mod:`deepspeed_knap.models.registry`) imports no torch.
"""

import importlib

_EXPORTS = {
    "FluxInputs": "deepspeed_knap.models.flux.base",
    "PackedFluxBase": "deepspeed_knap.models.flux.base",
    "PackedFluxTransformer": "deepspeed_knap.models.flux.flux1",
    "latent_ids": "deepspeed_knap.models.flux.flux1",
    "rope_axes": "deepspeed_knap.models.flux.flux1",
    "PackedFlux2Transformer": "deepspeed_knap.models.flux.flux2",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
