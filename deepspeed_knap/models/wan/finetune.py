"""Wan fine-tuning around :class:`~deepspeed_knap.models.wan.PackedWanTransformer`: the flow-matching
objective on video latent samples, diffusers' ``WanTransformer3DModel`` over trained weights, and
validation clips through diffusers' own ``WanPipeline`` written as GIFs.

LoRA goes through :func:`deepspeed_knap.models.flux.finetune.add_lora` (the packed model has
diffusers' module names, ``PackedWanTransformer.lora_targets``), and the adapter file is the one
``WanPipeline.load_lora_weights`` reads. No function here communicates: under ZeRO-3 the training
script gathers the weights and passes them in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from deepspeed_knap.models.latents import flow_noise
from deepspeed_knap.models.wan.wan import output_rows

__all__ = ["TINY_WAN_VALIDATION", "diffusers_transformer", "flow_matching", "write_gif"]

# Validation clips of the tiny pipeline (data.tiny_wan_pipeline): 5 frames (2 latent frames) of
# 32 x 32 pixels, 2 denoising steps; Wan's own defaults are 480 x 832, 81 frames, 50 steps.
TINY_WAN_VALIDATION = dict(height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=16)
WAN_VALIDATION = dict(height=480, width=832, num_frames=81, num_inference_steps=50, max_sequence_length=512)


def flow_matching(
    samples: Sequence[Mapping[str, Tensor]], generator: torch.Generator, patch_size: Sequence[int]
) -> tuple[list[dict[str, Tensor]], list[Tensor]]:
    """The flow-matching objective of Wan training, per video latent sample (``latents [C, F, H, W]``,
    ``encoder_hidden_states [Lt, Dj]``).

    ``sigma = sigmoid(n)``, ``n ~ N(0, 1)`` (logit-normal, as FLUX fine-tuning here; Wan's own
    trainers also draw it uniformly and shift it); ``noisy = (1 - sigma) * x0 + sigma * noise``; the
    model sees ``noisy`` at timestep ``1000 * sigma`` (diffusers' scale, one per sample: text-to-video
    training, every token at the same noise level) and must predict ``noise - x0``, what
    ``WanPipeline``'s flow-matching scheduler integrates.

    Returns:
        ``(model_samples, targets)``: per-sample inputs for ``PackedWanTransformer.pack`` and the
        targets as ``[L, P * C]`` rows in the order of the model's packed output (:func:`output_rows`).
    """
    model_samples, targets = [], []
    for sample in samples:
        # One sigma, in the data's dtype, for both the mix and the timestep (bf16 rounds it).
        sigma, noisy, velocity = flow_noise(sample["latents"], generator)
        model_samples.append({
            "hidden_states": noisy,
            "timestep": 1000 * sigma.float(),
            "encoder_hidden_states": sample["encoder_hidden_states"],
        })  # fmt: skip
        targets.append(output_rows(velocity, patch_size))
    return model_samples, targets


def diffusers_transformer(config: Mapping[str, Any], state_dict: Mapping[str, Tensor]) -> nn.Module:
    """diffusers' ``WanTransformer3DModel`` of ``config`` (the packed model's) holding ``state_dict``
    (the packed model's names, which are diffusers'), in the state dict's dtype. Parameters are
    made empty and take the state dict's tensors; buffers (the RoPE tables, not in the state dict)
    are computed as usual."""
    from accelerate import init_empty_weights  # peft's dependency
    from diffusers import WanTransformer3DModel

    with init_empty_weights(include_buffers=False):
        model = WanTransformer3DModel(**config)
    model.load_state_dict(dict(state_dict), strict=True, assign=True)
    return model.eval()


def write_gif(frames: np.ndarray, path: str | Path, fps: int = 16) -> Path:
    """Write ``frames [F, H, W, 3]`` (floats in ``[0, 1]``, ``WanPipeline``'s ``output_type="np"``)
    as a looping GIF at ``fps`` (Wan's 16); PIL only, no video codec needed."""
    from PIL import Image

    pixels = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    images = [Image.fromarray(frame) for frame in pixels]
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    return Path(path)
