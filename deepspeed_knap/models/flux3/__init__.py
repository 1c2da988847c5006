"""FLUX.3 on packed, balanced batches (:class:`~deepspeed_knap.models.flux3.flux3.PackedFlux3Transformer`)."""

from deepspeed_knap.models.flux3.flux3 import Flux3Inputs, PackedFlux3Transformer

__all__ = ["Flux3Inputs", "PackedFlux3Transformer"]
