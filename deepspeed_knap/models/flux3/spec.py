"""FLUX.3: what the package knows of the family, in one place (pure: no torch)."""

from __future__ import annotations

import numpy as np

from deepspeed_knap.data.mixes import ASPECTS, SampleShape, bucket_tokens, fill_ranks
from deepspeed_knap.models.flux.spec import flux_cost_model, swiglu_cost_dims
from deepspeed_knap.models.spec import ModelSpec

# A FLUX.3 small enough for CPU ranks (``train_dit.py --tiny --family flux3``), sized like TINY_FLUX:
# every kind of block, 4 heads for groups of up to 4, references as wide as the image latents.
TINY_FLUX3 = dict(in_channels=16, cond_in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=4, joint_attention_dim=32, timestep_channels=32, mlp_ratio=3.0,
                  axes_dims_rope=(4, 4, 4, 4))  # fmt: skip


def flux3_cost_dims(config) -> dict[str, float]:
    """A FLUX.3 config's FLOP dims: every token through ``num_layers`` blocks of its own mode
    (``mode_blocks``, attending within its mode), then ``num_single_layers`` joint blocks; SwiGLU
    MLPs (:func:`~deepspeed_knap.models.flux.spec.swiglu_cost_dims`)."""
    dims = swiglu_cost_dims(config)
    return {**dims, "double_blocks": 0, "mode_blocks": config["num_layers"]}


# FLUX.3. Sources: diffusers 0.42.1's FLUX.3 modular pipeline (diffusers/modular_pipelines/flux3):
# the text encoder step (Qwen3-VL, encoders.py) right-pads the chat-templated prompt to a multiple of
# 80 tokens (pad_multiple=80; the transformer attends to the padding), capped at 8,192; one
# reference image is kept whole, downscaled only to fit its 16-pixel-grid canvas under 4 megapixels
# (sides at most 4,096 px: 16,384 tokens), and the generation defaults to that canvas; each of
# several references is fitted under 1 megapixel (4,096 tokens) and cropped to the grid
# (image_processor.py, Flux3ProcessImagesInputStep). Tokens: 16x16 pixels each (8x VAE, 2x2
# patches, as FLUX.2). Assumptions, not from the pipeline, which gives no training data: half the
# samples text-to-image; edits with 1, 2 or 3 references at 0.5 / 0.3 / 0.2; a single reference a
# bucket as flux_buckets' (512 / 768 / 1024 px base) or, with probability 0.25, a 2048 px-base one
# (about 4 megapixels, the pipeline's limit); prompts of 20 to 400 tokens before padding; 16,384
# image tokens per rank, as flux2_edit.
FLUX3_TEXT_PAD = 80
FLUX3_EDIT_SHARE = 0.5
_FLUX3_REFERENCE_COUNTS = ((1, 0.5), (2, 0.3), (3, 0.2))
_FLUX3_WHOLE_REFERENCE_TOKENS = 4 * 1024 * 1024 // 256  # 4 megapixels over 16x16 pixels per token
_FLUX3_REFERENCE_TOKENS = 1024 * 1024 // 256  # 1 megapixel


def _flux3_sample(rng: np.random.Generator) -> SampleShape:
    text = -(-int(rng.integers(20, 401)) // FLUX3_TEXT_PAD) * FLUX3_TEXT_PAD
    if rng.random() >= FLUX3_EDIT_SHARE:
        return SampleShape(text, bucket_tokens(rng), 1)
    counts, odds = zip(*_FLUX3_REFERENCE_COUNTS, strict=True)
    references = int(rng.choice(counts, p=odds))
    if references == 1:  # kept whole on its canvas, and the target on the same canvas
        if rng.random() < 0.25:
            wide, tall = ASPECTS[rng.integers(len(ASPECTS))]
            scale = 2048 / np.sqrt(wide * tall)
            width, height = (round(side * scale / 64) * 64 for side in (wide, tall))
            tokens = min((width // 16) * (height // 16), _FLUX3_WHOLE_REFERENCE_TOKENS)
        else:
            tokens = bucket_tokens(rng)
        return SampleShape(text, 2 * tokens, 2, reference=tokens)
    reference = sum(min(_FLUX3_REFERENCE_TOKENS, bucket_tokens(rng)) for _ in range(references))
    return SampleShape(text, bucket_tokens(rng) + reference, 1 + references, reference=reference)


def flux3_edit(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    """FLUX.3 text-to-image plus editing with 1 to 3 reference images at mixed resolutions. A sample
    is text (a prompt's chat-templated tokens right-padded to a multiple of 80), a target image and
    its references, three attention segments (:attr:`SampleShape.segments`: the per-mode blocks
    attend within each). Half the samples are text-to-image (a ``flux_buckets`` bucket); the edits
    have one reference (0.5), kept whole up to 4 megapixels (16,384 tokens) with the target on its
    canvas, or two (0.3) or three (0.2), each fitted under 1 megapixel (4,096 tokens) with the target
    a bucket. Each rank holds samples until its image tokens (targets and references) reach 16,384.
    Sources and assumptions at :data:`FLUX3_TEXT_PAD`."""
    return fill_ranks(num_gpus, rng, _flux3_sample)


FLUX3 = ModelSpec(
    block_counts=("num_layers", "num_single_layers"),
    name="flux3",
    title="FLUX.3",
    diffusers_class="Flux3Transformer2DModel",
    # diffusers 0.42.1 has no FLUX.3 pipeline class, but its FLUX.3 LoRA loader writes and reads the
    # adapter file (hooks.save_adapters); Flux3Transformer2DModel.load_lora_adapter and the modular
    # pipeline's load_lora_weights (Flux3ModularPipeline mixes the loader in) load it.
    lora_loader="Flux3LoraLoaderMixin",
    pipeline=None,
    model="deepspeed_knap.models.flux3.flux3:PackedFlux3Transformer",
    tiny_config=TINY_FLUX3,
    # diffusers 0.42.1 Flux3Transformer2DModel defaults: 24 heads x 128 = 3072 wide, every token
    # through num_layers=5 blocks of its own mode (attending within its mode only) and
    # num_single_layers=28 joint blocks; a SwiGLU MLP 3x wide (mlp_ratio=3.0: 2 * 3 + 3 = 9 d^2
    # matrices, what mlp_ratio 4.5 counts), q, k, v, out without biases: 13 d^2 per token and block.
    presets={
        "flux3": {
            "hidden": 3072,
            "double_blocks": 0,
            "single_blocks": 28,
            "mode_blocks": 5,
            "mlp_ratio": 4.5,
            "num_heads": 24,
        },
        # TINY_FLUX3
        "flux3-tiny": {
            "hidden": 64,
            "double_blocks": 0,
            "single_blocks": 2,
            "mode_blocks": 2,
            "mlp_ratio": 4.5,
            "num_heads": 4,
        },
    },
    cost_model=flux_cost_model,
    cost_dims=flux3_cost_dims,
    mixes={"flux3_edit": flux3_edit},
    default_mix="flux3_edit",
    lora_targets=("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.linear_in", "ff.linear_out"),
    training="deepspeed_knap.models.flux3.finetune:Flux3Training",
    # Generation and validation run around diffusers' modular FLUX.3 blocks (Flux3AutoBlocks): there
    # is no pipeline class.
    generator="deepspeed_knap.models.flux3.generate:Flux3Generator",
    keep_in_fp32=("norm_q", "norm_k"),
)
