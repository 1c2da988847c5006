"""The FLUX.1 and FLUX.2 families: what the package knows of each, in one place (pure: no torch).

Both run on the same packed base (:mod:`.base`, :mod:`.layers`) and share this folder; each is its
own spec (:data:`FLUX1`, :data:`FLUX2`) in :mod:`deepspeed_knap.models.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.data.mixes import SampleShape, bucket_tokens, fill_ranks
from deepspeed_knap.models.spec import ModelSpec

# A FLUX small enough for CPU ranks (``train_dit.py --tiny``): every kind of block and guidance, 4
# heads for bags of up to 4; finetune.tiny_pipeline_components fits it.
TINY_FLUX = dict(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))  # fmt: skip

# A FLUX.2 small enough for CPU ranks (``--tiny --family flux2``): every kind of block, guidance, 4
# position axes, 4 heads for bags of up to 4.
TINY_FLUX2 = dict(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                  joint_attention_dim=48, timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4),
                  guidance_embeds=True)  # fmt: skip
# TINY_FLUX2 as FLUX.2 [klein]'s transformer has it: without a guidance embedding (Flux2KleinPipeline
# guides by classifier-free guidance; finetune.tiny_flux2_klein_pipeline_components fits it).
TINY_FLUX2_KLEIN = {**TINY_FLUX2, "guidance_embeds": False}

# Every attention projection of both streams of a double-stream block, by diffusers' names (the same
# in FLUX.1 and FLUX.2): the start of each family's default LoRA targets.
JOINT_ATTENTION_PROJECTIONS = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
)  # fmt: skip


def flux_cost_model(dims: Mapping[str, Any], **rates: Any) -> CostModel:
    """The FLOP model of a FLUX-style DiT (:meth:`~deepspeed_knap.cost.model.CostModel.from_model_dims`):
    ``hidden``, ``double_blocks``, ``single_blocks``, ``mlp_ratio`` (a gated MLP counts its gate),
    optionally ``mode_blocks`` and ``num_heads``."""
    return CostModel.from_model_dims(**dims, **rates)


def flux_cost_dims(config: Mapping[str, Any]) -> dict[str, float]:
    """A FLUX.1 transformer config's FLOP dims: a GELU MLP 4x wide (FLUX.1 has no ``mlp_ratio`` key)."""
    return {"hidden": config["num_attention_heads"] * config["attention_head_dim"],
            "double_blocks": config["num_layers"], "single_blocks": config["num_single_layers"],
            "mlp_ratio": config.get("mlp_ratio", 4.0), "num_heads": config["num_attention_heads"]}  # fmt: skip


def swiglu_cost_dims(config: Mapping[str, Any]) -> dict[str, float]:
    """A FLUX.2 (or FLUX.3) config's FLOP dims: its SwiGLU MLP ``mlp_ratio`` wide is three matrices,
    ``1.5 * mlp_ratio`` of a plain MLP's two (3.0 -> 4.5)."""
    return {**flux_cost_dims(config), "mlp_ratio": 1.5 * config.get("mlp_ratio", 3.0)}


def flux_buckets(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    """FLUX fine-tuning with aspect-ratio buckets. Each rank draws one bucket per step (a bucketed
    loader gives a batch one shape): base resolution 512 / 768 / 1024 (weights 0.3 / 0.3 / 0.4) times
    one of nine aspect ratios from 1:1 to 12:5 either way, sides rounded to 64 px; the batch holds as
    many images as fit 16,384 image tokens (at least one); text U{64..512} per sample."""
    shapes = []
    for _ in range(num_gpus):
        visual = bucket_tokens(rng)
        batch = max(1, 16384 // visual)
        shapes.append([SampleShape(int(text), visual, 1) for text in rng.integers(64, 513, size=batch)])
    return shapes


# FLUX.2's text encoder output is padded to 512 tokens, and its transformer attends to all of them.
FLUX2_TEXT_TOKENS = 512


def flux2_buckets(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    """``flux_buckets`` for FLUX.2, whose image tokens are the same (its VAE is 8x and latents are
    patched 2x2) but whose text is always 512 tokens: the pipeline pads the Mistral prompt to 512 and
    the transformer attends to the padding too."""
    return [[SampleShape(FLUX2_TEXT_TOKENS, visual, 1) for _ in range(max(1, 16384 // visual))]
            for visual in (bucket_tokens(rng) for _ in range(num_gpus))]  # fmt: skip


def flux2_edit(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    """FLUX.2 multi-reference editing. A sample is a target image (a bucket as above), 1 to 4
    reference images (each a bucket, at most 1024x1024 px as the pipeline resizes them: 4,096 tokens)
    and 512 text tokens; ``frames`` counts the images. Each rank holds samples until its image tokens
    reach 16,384."""

    def draw(rng: np.random.Generator) -> SampleShape:
        references = int(rng.integers(1, 5))
        visual = bucket_tokens(rng) + sum(min(4096, bucket_tokens(rng)) for _ in range(references))
        return SampleShape(FLUX2_TEXT_TOKENS, visual, 1 + references)

    return fill_ranks(num_gpus, rng, draw)


# FLUX.1 [dev]'s transformer (diffusers' FluxTransformer2DModel defaults; [schnell] has no guidance).
FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56))  # fmt: skip
# FLUX.2 [dev]'s (Flux2Transformer2DModel defaults): 8 + 48 blocks, 48 heads of 128, SwiGLU 3x wide.
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True)  # fmt: skip

FLUX1 = ModelSpec(
    block_counts=("num_layers", "num_single_layers"),
    name="flux",
    title="FLUX.1",
    diffusers_class="FluxTransformer2DModel",
    lora_loader="FluxPipeline",
    pipeline="FluxPipeline",
    model="deepspeed_knap.models.flux.flux1:PackedFluxTransformer",
    tiny_config=TINY_FLUX,
    # FLUX.1-dev and -schnell share the transformer shape.
    presets={
        "flux-dev": {"hidden": 3072, "double_blocks": 19, "single_blocks": 38, "mlp_ratio": 4},
        "flux-schnell": {"hidden": 3072, "double_blocks": 19, "single_blocks": 38, "mlp_ratio": 4},
        "flux-tiny": {"hidden": 64, "double_blocks": 2, "single_blocks": 2, "mlp_ratio": 4},
    },
    cost_model=flux_cost_model,
    cost_dims=flux_cost_dims,
    mixes={"flux_buckets": flux_buckets},
    default_mix="kf_image_video",
    # What diffusers' FLUX LoRA training adapts by default: every attention projection of both
    # streams and the double-stream blocks' feed-forwards.
    lora_targets=(
        *JOINT_ATTENTION_PROJECTIONS,
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ),
    training="deepspeed_knap.models.flux.finetune:FluxTraining",
    generator="deepspeed_knap.models.flux.generate:FluxGenerator",
    block_timer="deepspeed_knap.models.flux.calibrate:flux_blocks_step",
    bench_configs={"flux-dev": FLUX1_DEV},
    full_config=FLUX1_DEV,
)

FLUX2 = ModelSpec(
    block_counts=("num_layers", "num_single_layers"),
    name="flux2",
    title="FLUX.2",
    diffusers_class="Flux2Transformer2DModel",
    lora_loader="Flux2Pipeline",
    pipeline="Flux2Pipeline",
    model="deepspeed_knap.models.flux.flux2:PackedFlux2Transformer",
    tiny_config=TINY_FLUX2,
    # FLUX.2 [dev]: a SwiGLU MLP 3x wide has 2 * 3 + 3 = 9 d^2 matrices, what mlp_ratio 4.5 counts.
    presets={
        "flux2-dev": {"hidden": 6144, "double_blocks": 8, "single_blocks": 48, "mlp_ratio": 4.5},
        "flux2-tiny": {"hidden": 64, "double_blocks": 2, "single_blocks": 2, "mlp_ratio": 4.5},  # TINY_FLUX2
    },
    cost_model=flux_cost_model,
    cost_dims=swiglu_cost_dims,
    mixes={"flux2_buckets": flux2_buckets, "flux2_edit": flux2_edit},
    default_mix="kf_image_video",
    # FLUX.1's choice in FLUX.2's layers: the double-stream blocks' attention projections and
    # feed-forwards, and the single-stream blocks' fused q, k, v + MLP input and their output
    # (``attn.to_out``: a linear layer there, a list holding one in the double-stream blocks).
    lora_targets=(
        *JOINT_ATTENTION_PROJECTIONS,
        "ff.linear_in",
        "ff.linear_out",
        "ff_context.linear_in",
        "ff_context.linear_out",
        "attn.to_qkv_mlp_proj",
        "attn.to_out",
    ),
    training="deepspeed_knap.models.flux.finetune:Flux2Training",
    generator="deepspeed_knap.models.flux.generate:Flux2Generator",
    bench_configs={"flux2-dev": FLUX2_DEV},
    full_config=FLUX2_DEV,
)
