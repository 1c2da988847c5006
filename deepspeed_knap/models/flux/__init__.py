"""The FLUX families: FLUX.1 (:mod:`.flux1`) and FLUX.2 (:mod:`.flux2`) on a shared base
(:mod:`.base`, :mod:`.layers`), their prepared data (:mod:`.data`) and fine-tuning helpers
(:mod:`.finetune`)."""

from deepspeed_knap.models.flux.base import FluxInputs, PackedFluxBase
from deepspeed_knap.models.flux.flux1 import PackedFluxTransformer, latent_ids, rope_axes
from deepspeed_knap.models.flux.flux2 import PackedFlux2Transformer

__all__ = ["FluxInputs", "PackedFlux2Transformer", "PackedFluxBase", "PackedFluxTransformer", "latent_ids", "rope_axes"]
