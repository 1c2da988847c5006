"""FLUX.1 generation, request by request, around diffusers' own ``FluxPipeline`` parts.

The packed transformer runs the requests of every rank together (balanced by
:mod:`deepspeed_knap.generation`); everything else is the pipeline's own code, called per request on
its home rank: ``encode_prompt`` (CLIP pooled + T5), ``prepare_latents`` (the seeded noise and
position ids), a ``FlowMatchEulerDiscreteScheduler`` of the pipeline's config per request with the
resolution-dependent shift ``mu = calculate_shift(image tokens, ...)`` and the sigmas
``linspace(1, 1/steps, steps)`` as ``FluxPipeline.__call__`` sets them, and the VAE decode and
post-processing. So an image equals what ``FluxPipeline(...)(prompt, height=..., width=...,
num_inference_steps=..., guidance_scale=..., generator=torch.Generator().manual_seed(seed))`` gives
for that request alone (tested at fp64 on gloo ranks).

Shapes: ``L`` image tokens (``(height / 16) * (width / 16)`` for FLUX.1's 8x VAE and 2x2 patches),
``C`` packed latent channels (64), ``Tt`` text tokens, ``Dj`` T5 width, ``Dp`` CLIP width.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deepspeed_knap.generation.requests import Request, RequestError
from deepspeed_knap.models.flux.flux1 import PackedFluxTransformer

MAX_SEQUENCE_LENGTH = 512  # FluxPipeline refuses a larger max_sequence_length (it truncates prompts)


@dataclass
class FluxDenoising:
    """One request's state between steps, on its home rank.

    Attributes:
        request: what is generated.
        latents: ``[L, C]`` the packed noisy latents.
        scheduler: the request's own flow-matching scheduler, its timesteps set.
        timesteps: ``[steps]`` the scheduler's timesteps.
        conditioning: the transformer's constant inputs: ``encoder_hidden_states [Tt, Dj]``,
            ``pooled_projections [Dp]``, ``img_ids [L, 3]``, ``txt_ids [Tt, 3]``, ``guidance``.
        step: steps taken.
    """

    request: Request
    latents: Tensor
    scheduler: Any
    timesteps: Tensor
    conditioning: dict[str, Tensor]
    step: int = 0

    @property
    def done(self) -> bool:
        return self.step == len(self.timesteps)

    def sample(self) -> dict[str, Tensor]:
        """The packed transformer's input for this step (one unbatched sample): the pipeline's
        ``timestep = t.to(latents.dtype) / 1000``."""
        t = self.timesteps[self.step]
        return {"hidden_states": self.latents, "timestep": t.to(self.latents.dtype) / 1000, **self.conditioning}

    def advance(self, noise_pred: Tensor) -> None:
        """One scheduler step with the transformer's ``[L, C]`` prediction."""
        t = self.timesteps[self.step]
        self.latents = self.scheduler.step(noise_pred[None], t, self.latents[None], return_dict=False)[0][0]
        self.step += 1


class FluxGenerator:
    """FLUX.1 requests: token counts and checks, start (encode, noise, scheduler), decode.

    Args:
        pipeline: a diffusers ``FluxPipeline`` (its ``transformer`` may be ``None``) on the device.
        model: the packed transformer with the pipeline transformer's weights, on the same device.
    """

    family = "flux"

    def __init__(self, pipeline: Any, model: PackedFluxTransformer) -> None:
        self.pipeline = pipeline
        self.model = model
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    @property
    def patch_pixels(self) -> int:
        """Pixels per latent token along each side: the VAE's scale times the 2x2 patches."""
        return self.pipeline.vae_scale_factor * 2

    def request_tokens(self, request: Request) -> int:
        """Text + image tokens of ``request``: what the planner balances.

        Raises:
            RequestError: a size the VAE and the patching cannot take (the pipeline would silently
                resize it), a ``max_sequence_length`` over T5's 512 (a longer prompt is truncated, as
                diffusers does), an embeddings file that is unreadable or does not fit the model.
        """
        patch, line = self.patch_pixels, request.line
        if request.height % patch or request.width % patch:
            fit = f"{_nearest(request.height, patch)}x{_nearest(request.width, patch)}"
            raise RequestError(f"line {line}: {request.height}x{request.width} px: FLUX.1's VAE ({patch // 2}x) "
                               f"and 2x2 patches need height and width in multiples of {patch} px; e.g. {fit}")  # fmt: skip
        image_tokens = (request.height // patch) * (request.width // patch)
        if request.embeddings is None:
            if request.max_sequence_length > MAX_SEQUENCE_LENGTH:
                raise RequestError(f"line {line}: max_sequence_length {request.max_sequence_length} is over T5's "
                                   f"{MAX_SEQUENCE_LENGTH} that FluxPipeline takes")  # fmt: skip
            return request.max_sequence_length + image_tokens
        return self._embeddings_shape(request)[0] + image_tokens

    def _embeddings_shape(self, request: Request) -> tuple[int, int]:
        """``(Tt, Dj)`` of a request's embeddings file, checked against the model."""
        from safetensors import safe_open

        config, line = self.model.config, request.line
        expected = {"prompt_embeds": f"[Tt, {config['joint_attention_dim']}]",
                    "pooled_prompt_embeds": f"[{config['pooled_projection_dim']}]"}  # fmt: skip
        try:
            with safe_open(request.embeddings, "pt") as file:
                shapes = {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}  # noqa: SIM118
        except Exception as error:  # safetensors raises its own types for a missing or damaged file
            raise RequestError(f"line {line}: cannot read embeddings {request.embeddings}: {error}") from None
        text, pooled = shapes.get("prompt_embeds"), shapes.get("pooled_prompt_embeds")
        if (text is None or len(text) != 2 or text[1] != config["joint_attention_dim"]
                or pooled != (config["pooled_projection_dim"],)):  # fmt: skip
            raise RequestError(f"line {line}: embeddings {request.embeddings} hold {shapes}; this model takes "
                               f"{expected} (one prompt, unbatched)")  # fmt: skip
        return text[0], text[1]

    @torch.no_grad()
    def start(self, request: Request) -> FluxDenoising:
        """Encode the prompt (or read the embeddings), draw the seeded noise and set the request's
        own scheduler, as ``FluxPipeline.__call__`` does for it alone."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        pipe, device = self.pipeline, self.device
        if request.prompt is not None:
            text, pooled, text_ids = pipe.encode_prompt(prompt=request.prompt, prompt_2=None, device=device,
                                                        max_sequence_length=request.max_sequence_length)  # fmt: skip
        else:
            from safetensors.torch import load_file

            saved = load_file(request.embeddings, device=str(device))
            text = saved["prompt_embeds"][None].to(self.dtype)
            pooled = saved["pooled_prompt_embeds"][None].to(self.dtype)
            text_ids = torch.zeros(text.shape[1], 3, device=device, dtype=self.dtype)
        generator = torch.Generator().manual_seed(request.seed)
        latents, img_ids = pipe.prepare_latents(1, self.model.config["in_channels"] // 4, request.height,
                                                request.width, text.dtype, device, generator)  # fmt: skip
        steps = request.steps
        config = pipe.scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))  # fmt: skip
        scheduler = copy.deepcopy(pipe.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        conditioning = {"encoder_hidden_states": text[0], "pooled_projections": pooled[0], "img_ids": img_ids,
                        "txt_ids": text_ids}  # fmt: skip
        if self.model.config["guidance_embeds"]:
            # The pipeline's float32 guidance, in the latents' dtype as every rank packs it (an empty
            # rank's columns are all in the model's dtype); the model casts it to that dtype anyway.
            guidance = torch.tensor(request.guidance, dtype=torch.float32, device=device)
            conditioning["guidance"] = guidance.to(latents.dtype)
        return FluxDenoising(request, latents[0], scheduler, timesteps, conditioning)

    @torch.no_grad()
    def decode(self, state: FluxDenoising) -> np.ndarray:
        """``[height, width, 3]`` float image in ``[0, 1]``: the pipeline's unpacking, VAE decode and
        post-processing (``output_type="np"``)."""
        pipe, request = self.pipeline, state.request
        latents = pipe._unpack_latents(state.latents[None], request.height, request.width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")[0]


def _nearest(pixels: int, multiple: int) -> int:
    return max(multiple, round(pixels / multiple) * multiple)


def load_flux_generator(model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> FluxGenerator:
    """A diffusers FLUX.1 pipeline directory (``model_index.json``, ``transformer/``, text encoders,
    VAE, scheduler) as a :class:`FluxGenerator`: the transformer packed, the rest diffusers' own.

    Raises:
        ValueError: the checkpoint is another family's (FLUX.2 generation is not wired up yet).
    """
    from diffusers import FluxPipeline

    from deepspeed_knap.models.registry import checkpoint_family, from_pretrained

    family = checkpoint_family(model_path)
    if family != "flux":
        raise ValueError(f"{model_path} holds a {family!r} transformer; deepspeed-knap generate runs FLUX.1 "
                         "pipelines (FluxPipeline) only so far")  # fmt: skip
    pipeline = FluxPipeline.from_pretrained(model_path, transformer=None, torch_dtype=dtype).to(device)
    model = from_pretrained(model_path, torch_dtype=dtype).to(device).eval()
    return FluxGenerator(pipeline, model)


def tiny_flux_generator(dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                        config: Mapping[str, Any] | None = None) -> FluxGenerator:  # fmt: skip
    """A tiny random FLUX.1 (``TINY_FLUX`` or ``config``) with
    :func:`~deepspeed_knap.models.flux.finetune.tiny_pipeline_components`, the same on every rank for
    a ``seed``: for CPU runs, tests and benchmarks without downloaded weights."""
    from diffusers import FluxPipeline

    from deepspeed_knap.models.flux.finetune import TINY_FLUX, tiny_pipeline_components

    config = dict(TINY_FLUX if config is None else config)
    pipeline = FluxPipeline(**tiny_pipeline_components(config, seed), transformer=None).to(device, dtype)
    torch.manual_seed(seed)
    model = PackedFluxTransformer(**config).to(device, dtype).eval()
    return FluxGenerator(pipeline, model)
