"""Wan 2.x (:mod:`.wan`, diffusers' ``WanTransformer3DModel``) on packed, balanced batches; its
layers in :mod:`.layers`."""

from deepspeed_knap.models.wan.wan import PackedWanTransformer, WanInputs, output_rows, patchify, unpatchify

__all__ = ["PackedWanTransformer", "WanInputs", "output_rows", "patchify", "unpatchify"]
