"""Qwen-Image (text-to-image, Edit, Edit-2509 and Edit-2511): what the package knows of the family, in
one place (pure: no torch).

One transformer, diffusers' ``QwenImageTransformer2DModel``, for every variant: the edit models put
reference images' tokens in the sequence after the target's, and Edit-2511 (``zero_cond_t``)
modulates them by timestep 0. The packed model is :mod:`.qwenimage`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepspeed_knap.models.flux.spec import JOINT_ATTENTION_PROJECTIONS, flux_cost_model
from deepspeed_knap.models.spec import ModelSpec

# A Qwen-Image small enough for CPU ranks: 4 heads for bags of up to 4, every RoPE axis, 2x2 patches
# of 4 latent channels as the released model's of 16.
TINY_QWEN_IMAGE = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                       num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))  # fmt: skip


def qwen_image_cost_dims(config: Mapping[str, Any]) -> dict[str, float]:
    """A Qwen-Image config's FLOP dims: ``num_layers`` double-stream blocks (text and image tokens
    each through their own q, k, v, output and MLP, attending jointly) with GELU MLPs 4x wide, and
    no single-stream blocks."""
    heads = config["num_attention_heads"]
    return {"hidden": heads * config["attention_head_dim"], "double_blocks": config["num_layers"],
            "single_blocks": 0, "mlp_ratio": 4.0, "num_heads": heads}  # fmt: skip


QWEN_IMAGE = ModelSpec(
    name="qwenimage",
    title="Qwen-Image",
    diffusers_class="QwenImageTransformer2DModel",
    lora_loader="QwenImagePipeline",
    pipeline="QwenImagePipeline",
    model="deepspeed_knap.models.qwenimage.qwenimage:PackedQwenImageTransformer",
    tiny_config=TINY_QWEN_IMAGE,
    presets={
        # diffusers 0.42.1's defaults, the released Qwen-Image, Edit and Edit-2509 (and Edit-2511 with
        # zero_cond_t): 60 double-stream blocks, 24 heads x 128 = 3072 wide, text 3584 wide.
        "qwen-image": {"hidden": 3072, "double_blocks": 60, "single_blocks": 0, "mlp_ratio": 4, "num_heads": 24},
        # TINY_QWEN_IMAGE
        "qwen-image-tiny": {"hidden": 64, "double_blocks": 2, "single_blocks": 0, "mlp_ratio": 4, "num_heads": 4},
    },
    cost_model=flux_cost_model,
    cost_dims=qwen_image_cost_dims,
    # Text-to-image fine-tuning draws as FLUX.1's: 16x16 pixels per token (8x VAE, 2x2 patches) and
    # prompts of up to 512 tokens (the pipeline's max_sequence_length).
    default_mix="flux_buckets",
    # FLUX.1's choice in Qwen-Image's double-stream blocks: every attention projection of both
    # streams and both streams' feed-forwards.
    lora_targets=(
        *JOINT_ATTENTION_PROJECTIONS,
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    ),
)
