"""Qwen-Image (:mod:`.qwenimage`, diffusers' ``QwenImageTransformer2DModel``) on packed, balanced batches;
its layers in :mod:`.layers`, its spec in :mod:`.spec`. The names load on first use (reading the spec
imports no torch)."""

import importlib

_EXPORTS = {
    name: "deepspeed_knap.models.qwenimage.qwenimage"
    for name in ("PackedQwenImageTransformer", "QwenImageInputs", "image_positions")
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
