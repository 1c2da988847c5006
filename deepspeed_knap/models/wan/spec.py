"""Wan 2.x: what the package knows of the family, in one place (pure: no torch), its FLOP model
included: a Wan block attends to its text by cross-attention, outside the balanced sequence."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from deepspeed_knap.cost.model import (
    DEFAULT_ALLTOALL_GBPS,
    DEFAULT_INTER_NODE_ALLTOALL_GBPS,
    DEFAULT_TFLOPS,
    CostModel,
    per_token_s,
    step_factors,
)
from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.models.spec import ModelSpec

# A Wan 2.1 T2V 1.3B small enough for CPU ranks: every kind of layer, 12 heads as the 1.3B has.
TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=6, in_channels=4, out_channels=4,
                text_dim=24, freq_dim=16, ffn_dim=48, num_layers=2, rope_max_seq_len=64)  # fmt: skip

# Wan 2.1 T2V 14B's transformer (each of Wan 2.2 A14B's two experts has its shape).
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)  # fmt: skip


def from_wan_dims(
    dim: int = 5120,
    ffn_dim: int = 13824,
    num_heads: int = 40,
    num_layers: int = 40,
    text_len: int = 512,
    tflops: float = DEFAULT_TFLOPS,
    alltoall_gbps: float = DEFAULT_ALLTOALL_GBPS,
    bytes_per_element: int = 2,
    gpu_speed: tuple[float, ...] | None = None,
    frozen_base: bool = False,
    inter_node_alltoall_gbps: float | None = DEFAULT_INTER_NODE_ALLTOALL_GBPS,
    forward_only: bool = False,
) -> CostModel:
    """FLOP-based defaults for a Wan 2.x DiT (defaults: Wan 2.1 14B on an H100 in bf16).

    A Wan block is self-attention over the video tokens, cross-attention from them to the
    sample's ``text_len`` text rows, and a GELU FFN ``ffn_dim`` wide. The balancer plans video
    tokens only (the text is not in the sequence; docs/design.md, "Wan: cross-attention under
    Ulysses"). Per block, forward, in multiply-adds:

    * per video token, linear layers: ``4 d^2`` (self-attention q, k, v, output) + ``2 d^2``
      (cross-attention q, output) + ``2 d ffn_dim`` (FFN);
    * per video token, cross-attention scores and values over the text: ``2 text_len d``. Linear
      in the tokens for a fixed text length, so it folds into ``a`` (with attention's 3.5x
      forward + backward factor); the text length is the pipeline's 512, padding included;
    * per pair of video tokens, self-attention: ``2 s d`` per token, the ``b`` term;
    * per sequence, the text keys and values: ``2 text_len d^2``. The text travels with its
      sequence and every member of the bag projects it itself, so this does not shrink with the
      bag: it is ``e``, the per-sequence term (at ``d = 5120`` some 90 video tokens' worth of
      linear work per block: 6% of a 1,560-token 480p image at degree 1, 1% of each member's
      share of a 75,600-token 720p clip at degree 8). Counted with the linear layers' factor.

    x2 FLOPs per multiply-add; forward + backward 3x (linear, 2x with ``frozen_base``) and 3.5x
    (attention), as for FLUX. The Ulysses all-to-alls are self-attention's (cross-attention runs
    locally): 8 of ``d``-wide tokens per block, as for FLUX. Left out as small: norms,
    modulation, RoPE, patch embedding and head, the time and text embedders (once per model, not
    per block), and I2V's image context (257 more cross-attention rows through ``add_k_proj``).

    Args:
        dim, ffn_dim, num_heads, num_layers, text_len: Wan's config names (the presets of :data:`WAN`).
        Others: as :meth:`from_model_dims`.
    """
    dims = (dim, ffn_dim, num_heads, num_layers, tflops, alltoall_gbps, bytes_per_element,
            inter_node_alltoall_gbps or 1.0)  # fmt: skip
    if not all(np.isfinite(dims)) or min(dims) <= 0 or not np.isfinite(text_len) or text_len < 0:
        raise ValueError(
            "Wan dims must be finite and positive (text_len >= 0): got "
            f"dim={dim}, ffn_dim={ffn_dim}, num_heads={num_heads}, num_layers={num_layers}, text_len={text_len}, "
            f"tflops={tflops}, alltoall_gbps={alltoall_gbps}, bytes_per_element={bytes_per_element}, "
            f"inter_node_alltoall_gbps={inter_node_alltoall_gbps}"
        )
    if dim % num_heads:
        raise ValueError(f"Wan dims: dim={dim} is not a whole number of heads ({num_heads})")
    flops_per_s = tflops * 1e12
    linear_factor, attention_factor, exchanges = step_factors(frozen_base, forward_only)
    linear_macs = 6 * dim**2 + 2 * dim * ffn_dim
    linear = (linear_factor * 2 * linear_macs + attention_factor * 2 * 2 * text_len * dim) * num_layers / flops_per_s
    quadratic = attention_factor * 2 * 2 * dim * num_layers / flops_per_s
    sequence = linear_factor * 2 * 2 * text_len * dim**2 * num_layers / flops_per_s
    token_bytes = exchanges * dim * bytes_per_element * num_layers
    return CostModel(linear, quadratic, token_bytes / (alltoall_gbps * 1e9), gpu_speed, num_heads=int(num_heads),
               sequence_coef=sequence, inter_node_alltoall_coef=per_token_s(token_bytes, inter_node_alltoall_gbps))  # fmt: skip


def wan_cost_model(dims: Mapping[str, Any], **rates: Any) -> CostModel:
    """:func:`from_wan_dims` of a dims dict (the presets' names)."""
    return from_wan_dims(**dims, **rates)


def wan_cost_dims(config: Mapping[str, Any]) -> dict[str, float]:
    """A ``WanTransformer3DModel`` config's FLOP dims; the text is the pipeline's 512 rows (padding
    included), which the config does not hold."""
    heads = config["num_attention_heads"]
    return {"dim": heads * config["attention_head_dim"], "ffn_dim": config["ffn_dim"], "num_heads": heads,
            "num_layers": config["num_layers"], "text_len": WAN_TEXT_TOKENS}  # fmt: skip


# Wan 2.1 joint image + video training. Sources: the Wan technical report (arXiv 2503.20314, section
# "Image-video joint training"): after 256px text-to-image pre-training, joint training of images
# and 5-second videos in stages of rising resolution, 256px/192px, then 480px, then 720px, images and
# videos at the same resolution; the released models generate 832x480 and 1280x720 at 16 fps, 81
# frames (Wan-Video/Wan2.1 README and generate.py; wan/configs/shared_config.py: sample_fps 16,
# text_len 512). Wan's VAE compresses 4x in time and 8x in space, and the DiT patches (1, 2, 2):
# (1 + (frames - 1) / 4) * (H / 16) * (W / 16) tokens, e.g. 81 frames at 720p = 21 * 45 * 80 =
# 75,600, and an image (1 frame) one latent frame. (Wan 2.2 TI2V-5B's VAE compresses 16x in space:
# a quarter of these tokens.) Assumptions, not from the report, which gives no ratios: the image
# share (0.3 of the samples), 480p and 720p at even odds (a fine-tuning mix of both stages' data), and
# half the clips shorter than 81 frames (short source videos kept whole, 4k + 1 frames, as trainers
# such as musubi-tuner's frame buckets do), and the 75,600-token budget per rank.
WAN_TEXT_TOKENS = 512
WAN_IMAGE_SHARE = 0.3
_WAN_TOKENS_PER_LATENT_FRAME = (30 * 52, 45 * 80)  # 832x480, 1280x720 over 16x16 pixels per token
_WAN_RANK_TOKENS = 21 * 45 * 80


def wan_tokens(frames: int, height: int, width: int) -> int:
    """Wan 2.1's video tokens of ``frames`` frames (``4k + 1``) of ``height x width`` pixels
    (multiples of 16): ``(1 + (frames - 1) / 4) * (height / 16) * (width / 16)``."""
    if frames < 1 or (frames - 1) % 4 or height % 16 or width % 16:
        raise ValueError(f"Wan takes 4k + 1 frames of multiples of 16 pixels; got {frames} frames of {height}x{width}")
    return (1 + (frames - 1) // 4) * (height // 16) * (width // 16)


def _wan_sample(rng: np.random.Generator) -> SampleShape:
    per_latent_frame = _WAN_TOKENS_PER_LATENT_FRAME[int(rng.integers(2))]
    if rng.random() < WAN_IMAGE_SHARE:
        latent_frames = 1
    elif rng.random() < 0.5:
        latent_frames = 21  # 81 frames
    else:
        latent_frames = int(rng.integers(5, 21))  # 17 to 77 frames
    return SampleShape(0, per_latent_frame * latent_frames, latent_frames, WAN_TEXT_TOKENS)


def wan_image_video(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    """Wan 2.1 joint image + video training at 480p and 720p. The planner's sequence is the video
    tokens alone: Wan's text enters by cross-attention, not in the sequence, so a sample's 512 text
    rows are :attr:`SampleShape.cross_text` and its ``text`` is 0. Each sample is 480p (832x480: 30 x
    52 = 1,560 tokens per latent frame) or 720p (1280x720: 45 x 80 = 3,600), even odds, and an image
    (one latent frame) with probability 0.3, else a clip of ``4k + 1`` frames: 81 (Wan's 5-second
    clips at 16 fps; 21 latent frames: 32,760 or 75,600 tokens) with probability 0.5, else 17 to 77
    (5 to 20 latent frames) uniformly. A rank draws samples until one would take its video tokens
    over 75,600 (one 720p 81-frame clip), and drops that one (its first sample always stays); images
    fill the gaps clips leave, so about 40% of the samples a step holds are images. Sources and
    assumptions above it."""
    shapes = []
    for _ in range(num_gpus):
        samples = [_wan_sample(rng)]
        tokens = samples[0].visual
        while True:
            sample = _wan_sample(rng)
            if tokens + sample.visual > _WAN_RANK_TOKENS:
                break
            samples.append(sample)
            tokens += sample.visual
        shapes.append(samples)
    return shapes


WAN = ModelSpec(
    name="wan",
    title="Wan 2.x",
    diffusers_class="WanTransformer3DModel",
    lora_loader="WanPipeline",
    pipeline="WanPipeline",
    model="deepspeed_knap.models.wan.wan:PackedWanTransformer",
    tiny_config=TINY_WAN,
    # In the names of Wan's own configs: dim, ffn_dim, num_heads, num_layers (Wan-Video/Wan2.1
    # wan/configs/wan_t2v_1_3B.py and wan_t2v_14B.py; Wan-Video/Wan2.2 wan/configs/wan_ti2v_5B.py),
    # and text_len 512 (wan/configs/shared_config.py: the umT5 prompt padded to 512; diffusers'
    # WanPipeline max_sequence_length=512). diffusers' WanTransformer3DModel configs agree:
    # num_attention_heads x attention_head_dim 128 = dim (12, 40, 24 heads), ffn_dim, num_layers. Wan
    # 2.2 A14B's two experts each have the 14B shape. wan-tiny: TINY_WAN with the text of a mix at 1/64.
    # The first is the base of dims given in part (deepspeed-knap plan --model num_layers=20).
    presets={
        "wan2.1-14b": {"dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40, "text_len": 512},
        "wan2.1-1.3b": {"dim": 1536, "ffn_dim": 8960, "num_heads": 12, "num_layers": 30, "text_len": 512},
        "wan2.2-ti2v-5b": {"dim": 3072, "ffn_dim": 14336, "num_heads": 24, "num_layers": 30, "text_len": 512},
        "wan-tiny": {"dim": 72, "ffn_dim": 48, "num_heads": 12, "num_layers": 2, "text_len": 8},
    },
    cost_model=wan_cost_model,
    cost_dims=wan_cost_dims,
    mixes={"wan_image_video": wan_image_video},
    default_mix="wan_image_video",
    lora_targets=(
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
        "ffn.net.0.proj",
        "ffn.net.2",
    ),
    training="deepspeed_knap.models.wan.finetune:WanTraining",
    generator="deepspeed_knap.models.wan.generate:WanGenerator",
    block_timer="deepspeed_knap.models.wan.calibrate:wan_blocks_step",
    full_config=WAN_14B,
    video=True,
    keep_in_fp32=("rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"),
)
