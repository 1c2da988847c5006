"""Wan fine-tuning around :class:`~deepspeed_knap.models.wan.PackedWanTransformer`: the family's
training hooks (:class:`WanTraining`), the flow-matching objective on video latent samples, diffusers'
and validation clips through diffusers' own
``WanPipeline`` written as GIFs.

LoRA is every family's (:mod:`deepspeed_knap.models.lora`: the packed model has diffusers' module
names), and the adapter file is the one ``WanPipeline.load_lora_weights`` reads. No function here
communicates: under ZeRO-3 the trainer gathers the weights and passes them in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from deepspeed_knap.models.hooks import TrainingHooks, ValidationHooks, ValidationSettings
from deepspeed_knap.models.latents import LatentDirectory, SyntheticMixLatents, flow_noise
from deepspeed_knap.models.wan.data import SyntheticVideoLatents, latent_directory, tiny_wan_pipeline
from deepspeed_knap.models.wan.wan import output_rows

__all__ = ["TINY_WAN_VALIDATION", "WanTraining", "flow_matching", "write_gif"]

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


def write_gif(frames: np.ndarray, path: str | Path, fps: int = 16) -> Path:
    """Write ``frames [F, H, W, 3]`` (floats in ``[0, 1]``, ``WanPipeline``'s ``output_type="np"``)
    as a looping GIF at ``fps`` (Wan's 16); PIL only, no video codec needed."""
    from PIL import Image

    pixels = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    images = [Image.fromarray(frame) for frame in pixels]
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    return Path(path)


def two_expert_pipeline(path: str | None) -> str | None:
    """Why ``path`` cannot be trained as one model: a Wan 2.2 A14B pipeline (``transformer_2``), whose
    experts each serve one side of the pipeline's ``boundary_ratio`` of noise levels, where training
    draws them from all of (0, 1)."""
    index = Path(path or ".") / "model_index.json"
    try:
        two = path is not None and index.is_file() and (json.loads(index.read_text()).get("transformer_2") or [None])[0]
    except (OSError, ValueError) as error:
        return f"--model-path {path}: cannot read {index} ({error})"
    return (f"{path} is a two-expert Wan 2.2 pipeline (transformer_2): each expert trains on its own side of the "
            "pipeline's boundary_ratio of noise levels, which this trainer does not do; train Wan 2.1 or Wan 2.2 "
            "TI2V-5B") if two else None  # fmt: skip


class WanValidation(ValidationHooks):
    """Validation clips through diffusers' ``WanPipeline``, written as GIFs."""

    pipeline = "WanPipeline"
    default_guidance = 5.0

    def options(self, settings: ValidationSettings) -> dict[str, Any]:
        options = dict(TINY_WAN_VALIDATION if settings.tiny else WAN_VALIDATION)
        sizes = {"height": settings.height, "width": settings.width, "num_frames": settings.frames}
        options.update({key: value for key, value in sizes.items() if value})
        if settings.steps or settings.tiny:
            options.update(num_inference_steps=settings.steps or 2)
        guidance = self.default_guidance if settings.guidance is None else settings.guidance
        return {**options, "guidance_scale": guidance}

    def tiny_components(self, config: Mapping, seed: int) -> dict[str, Any]:
        return tiny_wan_pipeline(config["text_dim"], config["in_channels"], seed).components

    def render(self, pipe: Any, prompt: str, generator: torch.Generator, options: Mapping, path: Path) -> Path:
        clip = pipe(prompt, generator=generator, output_type="np", **options).frames[0]
        return write_gif(clip, path.with_suffix(".gif"))


class WanTraining(TrainingHooks):
    """Wan training: prepared clips and images (``examples/prepare_video_latents.py``) or a synthetic
    mix, Wan's flow matching (:func:`flow_matching`), validation clips through ``WanPipeline``.
    Image-to-video and two-expert (A14B) checkpoints are refused."""

    validation = WanValidation

    def refuse(self, model: nn.Module, model_path: str | None) -> str | None:
        if model.config["image_dim"] is not None:
            return (f"{model_path} is a Wan image-to-video model (image_dim={model.config['image_dim']}); this trains "
                    "text-to-video models (Wan 2.1 T2V, Wan 2.2 TI2V-5B) from prepare_video_latents.py's samples, "
                    "which hold no image context")  # fmt: skip
        return two_expert_pipeline(model_path)

    def synthetic_data(self, mix: str, config: Mapping, token_scale: float, seed: int) -> SyntheticMixLatents:
        return SyntheticVideoLatents(mix, config, token_scale, seed)

    def latent_directory(self, path: str | Path, samples_per_rank: int, repeat: bool) -> LatentDirectory:
        return latent_directory(path, samples_per_rank, repeat)

    def objective(self, latents: Sequence[Mapping[str, Tensor]], generator: torch.Generator, config: Mapping,
                  guidance: float | None) -> tuple[list[dict[str, Tensor]], list[Tensor]]:  # fmt: skip
        return flow_matching(latents, generator, config["patch_size"])
