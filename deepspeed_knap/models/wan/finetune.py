"""Wan fine-tuning around :class:`~deepspeed_knap.models.wan.PackedWanTransformer`: the family's
training hooks (:class:`WanTraining`), the flow-matching objective on video latent samples, diffusers'
and validation clips through diffusers' own
``WanPipeline`` written as GIFs.

LoRA is every family's (:mod:`deepspeed_knap.models.lora`: the packed model has diffusers' module
names), and the adapter file is the one ``WanPipeline.load_lora_weights`` reads. No function here
communicates: under ZeRO-3 the trainer gathers the weights and passes them in.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from deepspeed_knap.models.hooks import Objective, TrainingHooks, ValidationHooks, ValidationSettings
from deepspeed_knap.models.latents import LatentDirectory, SyntheticMixLatents, flow_noise
from deepspeed_knap.models.loading import names_second_transformer, pipeline_index
from deepspeed_knap.models.lora import adapter_state_dict, lora_config, save_adapter
from deepspeed_knap.models.wan.data import (
    CONDITION_KEY,
    I2V_TEXT_ROWS,
    IMAGE_CONTEXT_KEY,
    SyntheticVideoLatents,
    condition_channels,
    frames_per_second,
    latent_channels,
    latent_directory,
    tiny_wan_pipeline,
)
from deepspeed_knap.models.wan.experts import (
    DEFAULT_BOUNDARY_RATIO,
    EXPERTS,
    PackedWanExperts,
    expand_timesteps,
    expert_state,
    image_to_video_pipeline,
    pipeline_experts,
)
from deepspeed_knap.models.wan.wan import PackedWanTransformer, output_rows

__all__ = ["TINY_WAN_VALIDATION", "WanTraining", "flow_matching", "write_gif"]

# Validation clips of the tiny pipeline (data.tiny_wan_pipeline): 5 frames (2 latent frames) of
# 32 x 32 pixels, 2 denoising steps; Wan's own defaults are 480 x 832, 81 frames, 50 steps.
TINY_WAN_VALIDATION = dict(height=32, width=32, num_frames=5, num_inference_steps=2, max_sequence_length=16)
WAN_VALIDATION = dict(height=480, width=832, num_frames=81, num_inference_steps=50, max_sequence_length=512)


def flow_matching(
    samples: Sequence[Mapping[str, Tensor]],
    generator: torch.Generator,
    patch_size: Sequence[int],
    sigma_range: tuple[float, float] | None = None,
    first_frame_share: float = 0.0,
    expert_draw: tuple[float, float] | None = None,
) -> Objective:
    """The flow-matching objective of Wan training, per video latent sample (``latents [C, F, H, W]``,
    ``encoder_hidden_states [Lt, Dj]``, and for image-to-video ``condition``, maybe
    ``encoder_hidden_states_image``: :func:`~deepspeed_knap.models.wan.data.sample_keys`).

    ``sigma = sigmoid(n)``, ``n ~ N(0, 1)`` (logit-normal, as FLUX fine-tuning here; Wan's own
    trainers also draw it uniformly and shift it), scaled into ``sigma_range`` where given (one
    expert of Wan 2.2 A14B: its side of ``boundary_ratio``). ``expert_draw`` ``(boundary_ratio,
    high_noise_share)`` (two experts trained together): each sample first draws its expert, the
    high-noise one with probability ``high_noise_share``, then its ``sigma`` scaled into that
    expert's side, as one expert alone draws it; ``noisy = (1 - sigma) * x0 + sigma *
    noise``; the model sees ``noisy`` at timestep ``1000 * sigma`` (diffusers' scale) and must predict
    ``noise - x0``, what the pipelines' flow-matching scheduler integrates.

    * Image-to-video (a ``condition``): the model's input is ``[noisy | condition]`` along the
      channels, as ``WanImageToVideoPipeline`` builds it (noise latents, first-frame mask, first
      frame's latents); the CLIP image context goes along.
    * Wan 2.2 TI2V (``first_frame_share``): with that probability a clip of more than one latent
      frame trains image-conditioned, as the pipeline with ``expand_timesteps`` generates: its first
      latent frame clean in the input, its tokens at timestep 0 and out of the loss (weight 0).

    Returns:
        The :class:`~deepspeed_knap.models.hooks.Objective`: inputs for ``PackedWanTransformer.pack``,
        targets as ``[L, P * C]`` rows in the order of the model's packed output (:func:`output_rows`),
        and each row's weight where a sample trained image-conditioned.
    """
    model_samples, targets, weights = [], [], []
    for sample in samples:
        x0 = sample["latents"]
        if expert_draw is not None:
            boundary, high_share = expert_draw
            high = bool(torch.rand((), generator=generator) < high_share)
            sigma_range = (boundary, 1.0) if high else (0.0, boundary)
        # One sigma, in the data's dtype, for both the mix and the timestep (bf16 rounds it).
        sigma, noisy, velocity = flow_noise(x0, generator, sigma_range)
        timestep = 1000 * sigma.float()
        rows = output_rows(velocity, patch_size)
        weight = None
        if (
            first_frame_share
            and x0.shape[1] > patch_size[0]
            and torch.rand((), generator=generator) < first_frame_share
        ):
            first = patch_size[0]  # the first latent frame (the patch holds one frame in time)
            noisy = torch.cat([x0[:, :first], noisy[:, first:]], dim=1)
            frame_tokens = (x0.shape[2] // patch_size[1]) * (x0.shape[3] // patch_size[2])
            timestep = timestep.expand(len(rows)).clone()
            timestep[:frame_tokens] = 0
            weight = torch.ones(len(rows))
            weight[:frame_tokens] = 0
        model_sample = {"hidden_states": noisy, "timestep": timestep,
                        "encoder_hidden_states": sample["encoder_hidden_states"]}  # fmt: skip
        if CONDITION_KEY in sample:
            model_sample["hidden_states"] = torch.cat([noisy, sample[CONDITION_KEY].to(noisy.dtype)])
        if IMAGE_CONTEXT_KEY in sample:
            model_sample[IMAGE_CONTEXT_KEY] = sample[IMAGE_CONTEXT_KEY]
        model_samples.append(model_sample)
        targets.append(rows)
        weights.append(weight)
    if all(weight is None for weight in weights):
        return Objective(model_samples, targets)
    return Objective(model_samples, targets,
                     [torch.ones(len(rows)) if w is None else w for w, rows in zip(weights, targets, strict=True)])  # fmt: skip


def write_gif(frames: np.ndarray, path: str | Path, fps: int) -> Path:
    """Write ``frames [F, H, W, 3]`` (floats in ``[0, 1]``, ``WanPipeline``'s ``output_type="np"``)
    as a looping GIF at ``fps`` (the model's:
    :func:`~deepspeed_knap.models.wan.data.frames_per_second`); PIL only, no video codec needed.
    A GIF holds each frame's delay in hundredths of a second: frame
    ``i`` ends at ``(i + 1) / fps`` rounded to one, so 16 fps plays 6, 6, 7, 6 hundredths (one delay
    of 6 for every frame played at 16.7 fps)."""
    from PIL import Image

    pixels = (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    images = [Image.fromarray(frame) for frame in pixels]
    ends = [round((i + 1) * 100 / fps) for i in range(len(images))]
    durations = [10 * (end - start) for start, end in zip([0, *ends], ends, strict=False)]
    images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0)
    return Path(path)


class WanValidation(ValidationHooks):
    """Validation clips through diffusers' ``WanPipeline``, written as GIFs; an image-to-video model's
    through ``WanImageToVideoPipeline``; Wan 2.2 TI2V's (a pipeline with ``expand_timesteps``) through
    ``WanPipeline``, and a line with an image through ``WanImageToVideoPipeline`` of the same parts,
    as diffusers generates from an image."""

    default_guidance = 5.0

    @functools.cached_property
    def expands_timesteps(self) -> bool:
        """Whether the pipeline folder sets ``expand_timesteps`` (Wan 2.2 TI2V-5B), read once.

        Raises:
            ValueError: an unreadable ``model_index.json``, naming it.
        """
        return expand_timesteps(self.model_path)

    def options(self, settings: ValidationSettings) -> dict[str, Any]:
        options = dict(TINY_WAN_VALIDATION if settings.tiny else WAN_VALIDATION)
        sizes = {"height": settings.height, "width": settings.width, "num_frames": settings.frames}
        options.update({key: value for key, value in sizes.items() if value})
        if settings.steps or settings.tiny:
            options.update(num_inference_steps=settings.steps or 2)
        guidance = self.default_guidance if settings.guidance is None else settings.guidance
        return {**options, "guidance_scale": guidance}

    def pipeline(self, model: nn.Module) -> tuple[str, dict[str, Any]]:
        """``WanImageToVideoPipeline`` for an image-to-video model (a condition input), else
        ``WanPipeline``; a two-expert model's ``boundary_ratio`` with it, and TI2V's
        ``expand_timesteps`` (a pipeline's parts do not carry its config)."""
        name = "WanImageToVideoPipeline" if condition_channels(model.config) else "WanPipeline"
        config = {"boundary_ratio": model.boundary_ratio} if isinstance(model, PackedWanExperts) else {}
        return name, {**config, "expand_timesteps": True} if self.expands_timesteps else config

    def render_options(self, model: nn.Module) -> dict[str, Any]:
        """Wan 2.1 I2V's attention splits its context at 512 text rows (diffusers, :data:`I2V_TEXT_ROWS`):
        the text of its renders is padded to 512 whatever the tiny defaults."""
        return {"max_sequence_length": I2V_TEXT_ROWS} if model.config.get("image_dim") else {}

    def tiny_components(self, model: nn.Module, seed: int) -> dict[str, Any]:
        config = model.config
        pipe = tiny_wan_pipeline(config["text_dim"], latent_channels(config), seed,
                                 image_to_video=condition_channels(config) > 0, image_dim=config.get("image_dim"))  # fmt: skip
        return pipe.components

    def call(self, line: str, directory: Path, model: nn.Module) -> dict[str, Any]:
        """Text to video: the line is the prompt. Image to video (a condition input):
        ``IMAGE<TAB>PROMPT``, the image's path relative to the prompts file. Wan 2.2 TI2V (a
        pipeline with ``expand_timesteps``): either."""
        takes_image = self.expands_timesteps
        if not condition_channels(model.config) and not takes_image:
            return {"prompt": line}
        image, tab, prompt = line.partition("\t")
        if not tab:
            if takes_image:
                return {"prompt": line}
            raise ValueError(f"{line[:60]!r}: an image-to-video model renders from an image: write IMAGE<TAB>PROMPT "
                             "(the image's path relative to the prompts file)")  # fmt: skip
        from deepspeed_knap.generation.requests import read_image

        return {"image": read_image(directory / image), "prompt": prompt}

    def render(self, pipe: Any, call: Mapping[str, Any], generator: torch.Generator, options: Mapping,
               path: Path) -> Path:  # fmt: skip
        if "image" in call and type(pipe).__name__ == "WanPipeline":  # TI2V from an image, as diffusers runs it
            pipe = image_to_video_pipeline(pipe)
        clip = pipe(**call, generator=generator, output_type="np", **options).frames[0]
        return write_gif(clip, path.with_suffix(".gif"), frames_per_second(self.expands_timesteps))


def _two_expert_parent(path: str | Path) -> Path | None:
    """The two-expert pipeline folder (Wan 2.2 A14B) ``path`` is the ``transformer/`` or
    ``transformer_2/`` of, or ``None`` (a pipeline folder, another folder, an unreadable index)."""
    path = Path(path).resolve()  # ("." inside transformer/ too)
    if path.name not in ("transformer", "transformer_2") or (path / "model_index.json").is_file():
        return None
    try:
        return path.parent if names_second_transformer(pipeline_index(path.parent)) else None
    except ValueError:  # no readable model_index.json there: not a pipeline's part
        return None


class WanTraining(TrainingHooks):
    """Wan training: prepared clips and images (``examples/prepare_video_latents.py``) or a synthetic
    mix, Wan's flow matching (:func:`flow_matching`), validation clips through ``WanPipeline`` (or
    ``WanImageToVideoPipeline``). Text-to-video and image-to-video models (Wan 2.1, Wan 2.2 TI2V-5B,
    A14B), and Wan 2.2 A14B's two experts: both (:class:`~deepspeed_knap.models.wan.experts.PackedWanExperts`,
    each sample's noise level picks its expert) or one on its side of ``boundary_ratio``."""

    validation = WanValidation

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.sigma_range: tuple[float, float] | None = None  # one expert's side of the boundary
        self.expert_draw: tuple[float, float] | None = None  # both experts: (boundary, high-noise share)
        self.first_frame_share = 0.0
        # (boundary_ratio, has transformer_2, expand_timesteps) of the pipeline folder, read once, in
        # check_arguments: that runs where the ranks agree on its errors (an unreadable file).
        self._pipeline: tuple[str | None, tuple[float | None, bool, bool]] | None = None

    def _pipeline_config(self, path: str | Path | None) -> tuple[float | None, bool, bool]:
        """``(boundary_ratio, has transformer_2, expand_timesteps)`` of ``path``'s ``model_index.json``
        (:func:`pipeline_experts`, :func:`expand_timesteps`), read once per path."""
        if self._pipeline is None or self._pipeline[0] != path:
            self._pipeline = (path, (*pipeline_experts(path), expand_timesteps(path)))
        return self._pipeline[1]

    def _experts_trained(self, arguments: Any) -> str | None:
        """``arguments.expert``, or ``"both"`` for a two-expert pipeline given without it."""
        _, two, _ = self._pipeline_config(arguments.model_path)
        return "both" if two and arguments.expert is None else arguments.expert

    def check_arguments(self, arguments: Any) -> None:
        path, expert = arguments.model_path, arguments.expert
        boundary, two, expand = self._pipeline_config(path)
        if two and boundary is None:  # also without --expert, which then trains both
            raise ValueError(f"{Path(path) / 'model_index.json'} names transformer_2 but no boundary_ratio, so which "
                             "expert trains which noise levels is unknown: set boundary_ratio there (Wan 2.2 "
                             "T2V-A14B's is 0.875, I2V-A14B's 0.9)")  # fmt: skip
        if path is not None and expert is None and (pipeline := _two_expert_parent(path)) is not None:
            # Trained alone it would learn every noise level; the pipeline runs it on one side of the boundary.
            side = "high" if Path(path).name == "transformer" else "low"
            raise ValueError(f"{path} is one expert of the two-expert Wan pipeline {pipeline}, which runs it on one "
                             f"side of its boundary_ratio only: give --model-path {pipeline} --expert {side} (or "
                             "--expert both)")  # fmt: skip
        if path is not None and expert is not None and not two:
            what = ("its model_index.json names no transformer_2" if (Path(path) / "model_index.json").is_file()
                    else "a folder without model_index.json; give the pipeline folder")  # fmt: skip
            raise ValueError(f"--expert {expert}: {path} is not a two-expert Wan pipeline ({what}); drop --expert or "
                             "give a Wan 2.2 A14B pipeline folder")  # fmt: skip
        if expert in ("high", "low") and arguments.validation_every:
            # The pipeline runs both experts, each on its side of the boundary: the one trained alone
            # would render from noise levels it never trained on.
            raise ValueError(f"--validation-every with --expert {expert}: validation renders run both experts; train "
                             "both (--expert both) to validate, or render the exported expert with the pipeline "
                             "yourself")  # fmt: skip
        share = arguments.high_noise_share
        if share is not None and self._experts_trained(arguments) != "both":  # (an --expert both without two: above)
            raise ValueError(f"--high-noise-share {share}: it splits the samples between the two experts trained "
                             "together; give a two-expert Wan 2.2 A14B pipeline with --expert both (one expert "
                             "alone trains on its side of boundary_ratio only)")  # fmt: skip
        if arguments.first_frame_share and path is not None and not expand:
            raise ValueError(f"--first-frame-share {arguments.first_frame_share}: {path} is not a Wan 2.2 TI2V "
                             "pipeline (its model_index.json does not set expand_timesteps); drop it")  # fmt: skip

    def load_model(self, arguments: Any, options: Mapping[str, Any]) -> nn.Module:
        path, expert = arguments.model_path, self._experts_trained(arguments)
        boundary, _, expand = self._pipeline_config(path)
        if path is None and expert is not None:
            boundary = DEFAULT_BOUNDARY_RATIO
        share = arguments.first_frame_share
        self.first_frame_share = (0.5 if expand else 0.0) if share is None else share
        if expert in ("high", "low"):  # one expert, trained on its side of the boundary
            self.sigma_range = (boundary, 1.0) if expert == "high" else (0.0, boundary)
            self.expert = expert
        if expert == "both" and arguments.high_noise_share is not None:
            self.expert_draw = (boundary, arguments.high_noise_share)
        if expert is None:
            return super().load_model(arguments, options)
        if path is None:
            experts = [self.spec.tiny_model(**options) for _ in EXPERTS]
            return PackedWanExperts(*experts, boundary) if expert == "both" else experts[0]
        if expert == "both":
            return PackedWanExperts.from_pretrained(path, ds_config=arguments.deepspeed_config, **options)
        name = EXPERTS[0 if expert == "high" else 1]
        return PackedWanTransformer.from_pretrained(Path(path) / name, ds_config=arguments.deepspeed_config, **options)

    def synthetic_data(self, mix: str, config: Mapping, token_scale: float, seed: int) -> SyntheticMixLatents:
        return SyntheticVideoLatents(mix, config, token_scale, seed)

    def latent_directory(self, path: str | Path, samples_per_rank: int, repeat: bool) -> LatentDirectory:
        return latent_directory(path, samples_per_rank, repeat)

    def objective(self, latents: Sequence[Mapping[str, Tensor]], generator: torch.Generator, config: Mapping,
                  guidance: float | None) -> Objective:  # fmt: skip
        return flow_matching(latents, generator, config["patch_size"], self.sigma_range, self.first_frame_share,
                             self.expert_draw)  # fmt: skip

    def save_adapters(self, model: nn.Module, state: Mapping[str, Tensor], directory: Path) -> list[tuple[Path, dict]]:
        """Two experts: one adapter file each, ``directory/transformer`` and ``directory/transformer_2``
        (``WanPipeline.load_lora_weights`` reads the second with ``load_into_transformer_2=True``); one
        expert of the two (``--expert high`` or ``low``): its folder alone."""
        if self.expert is not None:
            index = 0 if self.expert == "high" else 1
            adapter = adapter_state_dict(model, state)
            path = save_adapter(Path(directory) / EXPERTS[index], adapter, lora_config(model), self.spec.lora_loader)
            return [(path, {"load_into_transformer_2": True} if index else {})]
        if not isinstance(model, PackedWanExperts):
            return super().save_adapters(model, state, directory)
        adapter = adapter_state_dict(model, state)
        files = []
        for index, name in enumerate(EXPERTS):
            part = expert_state(adapter, name)
            path = save_adapter(Path(directory) / name, part, lora_config(model), self.spec.lora_loader)
            files.append((path, {"load_into_transformer_2": True} if index else {}))
        return files
