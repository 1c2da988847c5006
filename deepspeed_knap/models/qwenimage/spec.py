"""Qwen-Image (text-to-image, Edit, Edit-2509 and Edit-2511): what the package knows of the family, in
one place (pure: no torch).

One transformer, diffusers' ``QwenImageTransformer2DModel``, for every variant: the edit models put
reference images' tokens in the sequence after the target's, and Edit-2511 (``zero_cond_t``)
modulates them by timestep 0. The packed model is :mod:`.qwenimage`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deepspeed_knap.data.mixes import SampleShape, bucket_tokens, fill_ranks
from deepspeed_knap.models.flux.spec import JOINT_ATTENTION_PROJECTIONS, flux_cost_model
from deepspeed_knap.models.spec import ModelSpec

# A Qwen-Image small enough for CPU ranks: 4 heads for bags of up to 4, every RoPE axis, 2x2 patches
# of 4 latent channels as the released model's of 16.
TINY_QWEN_IMAGE = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                       num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))  # fmt: skip
# Qwen-Image's 20B transformer (the Edit models share it).
QWEN_IMAGE_20B = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                      num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))  # fmt: skip


def qwen_image_cost_dims(config: Mapping[str, Any]) -> dict[str, float]:
    """A Qwen-Image config's FLOP dims: ``num_layers`` double-stream blocks (text and image tokens
    each through their own q, k, v, output and MLP, attending jointly) with GELU MLPs 4x wide, and
    no single-stream blocks."""
    heads = config["num_attention_heads"]
    return {"hidden": heads * config["attention_head_dim"], "double_blocks": config["num_layers"],
            "single_blocks": 0, "mlp_ratio": 4.0, "num_heads": heads}  # fmt: skip


# Qwen-Image editing as diffusers 0.42.1's QwenImageEditPlusPipeline (Edit-2509, Edit-2511) prepares
# it (pipeline_qwenimage_edit_plus.py): each reference is VAE-encoded at about 1 megapixel (sides
# rounded to 32 px: ~4,096 tokens of 16 x 16 px), the output defaults to the last reference's ~1
# megapixel, and the text holds, besides the prompt, each reference seen by the vision-language
# encoder at ~384 x 384 px (Qwen2.5-VL's 28-px merged patches: ~196 tokens, plus "Picture i:" and
# its vision markers) and the template's tail after the dropped prefix. Assumptions, not from the
# pipeline: half the samples text-to-image (a flux_buckets bucket, prompts of 20 to 400 tokens),
# edits with 1, 2 or 3 references at 0.5 / 0.3 / 0.2, prompts of 20 to 200 tokens; 16,384 image
# tokens per rank, as flux3_edit.
QWEN_EDIT_SHARE = 0.5
_QWEN_REFERENCE_COUNTS = ((1, 0.5), (2, 0.3), (3, 0.2))
_QWEN_MEGAPIXEL_TOKENS = 1024 * 1024 // 256
_QWEN_VISION_TOKENS = (392 // 28) ** 2 + 8  # a ~384 px condition image, its markers and "Picture i: "
_QWEN_TEMPLATE_TAIL = 5  # "<|im_end|>\n<|im_start|>assistant\n" after the prompt


def _qwen_sample(rng: np.random.Generator) -> SampleShape:
    if rng.random() >= QWEN_EDIT_SHARE:
        return SampleShape(int(rng.integers(20, 401)) + _QWEN_TEMPLATE_TAIL, bucket_tokens(rng), 1)
    counts, odds = zip(*_QWEN_REFERENCE_COUNTS, strict=True)
    references = int(rng.choice(counts, p=odds))
    reference = sum(min(_QWEN_MEGAPIXEL_TOKENS, bucket_tokens(rng)) for _ in range(references))
    text = int(rng.integers(20, 201)) + references * _QWEN_VISION_TOKENS + _QWEN_TEMPLATE_TAIL
    return SampleShape(text, _QWEN_MEGAPIXEL_TOKENS + reference, 1 + references, reference=reference)


def qwen_edit(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    """Qwen-Image text-to-image plus editing with 1 to 3 reference images, as the Edit-Plus pipeline
    prepares them: a sample is text (the prompt, and for an edit each reference's vision tokens), a
    target image and its references, one joint attention sequence. Half the samples are
    text-to-image (a ``flux_buckets`` bucket); an edit's target is about 1 megapixel (4,096 tokens)
    and each reference up to that. Each rank holds samples until its image tokens reach 16,384.
    Sources and assumptions at :data:`QWEN_EDIT_SHARE`."""
    return fill_ranks(num_gpus, rng, _qwen_sample)


QWEN_IMAGE = ModelSpec(
    name="qwen-image",
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
    default_mix="qwen_edit",
    mixes={"qwen_edit": qwen_edit},
    training="deepspeed_knap.models.qwenimage.finetune:QwenImageTraining",
    generator="deepspeed_knap.models.qwenimage.generate:QwenImageGenerator",
    # FLUX.1's choice in Qwen-Image's double-stream blocks: every attention projection of both
    # streams and both streams' feed-forwards.
    lora_targets=(
        *JOINT_ATTENTION_PROJECTIONS,
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    ),
    full_config=QWEN_IMAGE_20B,
)
