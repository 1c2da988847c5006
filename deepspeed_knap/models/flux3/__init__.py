"""FLUX.3 on packed, balanced batches (:class:`~deepspeed_knap.models.flux3.flux3.PackedFlux3Transformer`);
its spec in :mod:`.spec`. The names load on first use (reading the spec imports no torch)."""

import importlib

_EXPORTS = {
    "Flux3Inputs": "deepspeed_knap.models.flux3.flux3",
    "PackedFlux3Transformer": "deepspeed_knap.models.flux3.flux3",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
