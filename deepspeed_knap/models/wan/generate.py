"""Wan 2.x text-to-video generation, request by request, around diffusers' own ``WanPipeline`` parts.

The packed transformer runs the requests of every rank together (balanced by
:mod:`deepspeed_knap.generation`); everything else is the pipeline's own code, called per request on
its home rank: ``encode_prompt`` (UMT5, the prompt and the negative prompt), ``prepare_latents``
(the seeded float32 noise), a copy of the pipeline's scheduler per request (UniPC with the
checkpoint's ``flow_shift``; ``set_timesteps(steps)`` as ``WanPipeline.__call__`` does), and the
decode (the latents un-normalised by the VAE's ``latents_mean`` and ``latents_std``, decoded,
post-processed to frames). Wan uses true classifier-free guidance: with a ``guidance`` above 1 (the
pipeline's default is 5.0) each step runs the conditional and the unconditional branch, two
sequences of the same video tokens that the planner places apart or together by cost, and the
home rank combines them as the pipeline does. So a video equals what ``WanPipeline(...)(prompt,
negative_prompt=..., height=..., width=..., num_frames=..., num_inference_steps=...,
guidance_scale=..., generator=torch.Generator().manual_seed(seed), output_type="np")`` gives for
that request alone (tested at fp64 on gloo ranks).

Wan 2.1 T2V and Wan 2.2 TI2V-5B text-to-video pipelines run; an image is a one-frame video. I2V
checkpoints (image context) and Wan 2.2 A14B's two experts (one per side of ``boundary_ratio``)
are refused at load.

Shapes: ``C`` latent channels, ``F`` latent frames (``(frames - 1) / 4 + 1``), ``H``, ``W`` latent
height and width (pixels / 8), ``Tt`` text rows, ``Dj`` the text encoder's width.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from deepspeed_knap.generation.denoising import Denoising
from deepspeed_knap.generation.generator import Generator
from deepspeed_knap.generation.requests import Request, RequestError
from deepspeed_knap.models.wan.spec import TINY_WAN, WAN
from deepspeed_knap.models.wan.wan import PackedWanTransformer

DEFAULT_FRAMES = 81  # WanPipeline's num_frames
DEFAULT_GUIDANCE = 5.0  # WanPipeline's guidance_scale


@dataclass
class WanDenoising(Denoising):
    """One Wan request's state (:class:`~deepspeed_knap.generation.denoising.Denoising`):
    ``latents [C, F, H, W]`` float32, as the pipeline keeps them; each branch holds
    ``encoder_hidden_states [Tt, Dj]``. ``dtype``: the transformer's, which the pipeline casts the
    latents to for each step."""

    dtype: torch.dtype = torch.float32

    def step_inputs(self, timestep: Tensor) -> dict[str, Tensor]:
        return {"hidden_states": self.latents.to(self.dtype), "timestep": timestep}


class WanGenerator(Generator):
    """Wan requests: token counts and checks, start (encode, noise, scheduler), decode, around a
    diffusers ``WanPipeline`` (:class:`~deepspeed_knap.generation.generator.Generator`'s arguments)."""

    spec = WAN
    default_guidance = DEFAULT_GUIDANCE

    def pipeline_options(self, request: Request) -> dict[str, Any]:
        options = super().pipeline_options(request)
        return {**options, "num_frames": self.frames(request), "negative_prompt": request.negative_prompt}

    def request_seq_lens(self, request: Request) -> tuple[int, ...]:
        """Video tokens of each sequence ``request`` runs per step (two with a guidance above 1):
        what the planner balances (the text is cross-attended, not part of the sequence).

        Raises:
            RequestError: frames, height or width the VAE and the patching cannot take (the
                pipeline would silently round them), a grid over the model's RoPE table, an
                embeddings file that is unreadable or does not fit, ``true_cfg_scale`` (Wan's
                ``guidance`` is its classifier-free guidance), a ``negative_prompt`` without guidance.
        """
        pipe, config, line = self.pipeline, self.model.config, request.line
        if request.true_cfg_scale is not None:
            raise RequestError(f"line {line}: Wan's 'guidance' is its classifier-free guidance scale (default "
                               f"{DEFAULT_GUIDANCE}); drop 'true_cfg_scale'")  # fmt: skip
        frames, temporal = self.frames(request), pipe.vae_scale_factor_temporal
        if (frames - 1) % temporal:
            below = (frames - 1) // temporal * temporal + 1
            raise RequestError(f"line {line}: {frames} frames: Wan's VAE takes 1 + a multiple of {temporal} frames "
                               f"(e.g. {below} or {below + temporal})")  # fmt: skip
        pt, ph, pw = config["patch_size"]
        side = pipe.vae_scale_factor_spatial * ph
        if request.height % side or request.width % side:
            raise RequestError(f"line {line}: {request.height}x{request.width} px: Wan's VAE "
                               f"({pipe.vae_scale_factor_spatial}x) and {ph}x{pw} patches need height and width in "
                               f"multiples of {side} px")  # fmt: skip
        latent_frames = (frames - 1) // temporal + 1
        if latent_frames % pt:
            raise RequestError(f"line {line}: {latent_frames} latent frames are not a multiple of the patch's {pt}")
        grid = (latent_frames // pt, request.height // side, request.width // side)
        if max(grid) > config["rope_max_seq_len"]:
            raise RequestError(f"line {line}: the post-patch grid {list(grid)} (frames, height, width) exceeds the "
                               f"model's rope_max_seq_len {config['rope_max_seq_len']} on an axis")  # fmt: skip
        branches = 2 if self.guidance_scale(request) > 1 else 1
        if branches == 1 and request.negative_prompt is not None:
            raise RequestError(f"line {line}: 'negative_prompt' does nothing at guidance {self.guidance_scale(request)} "
                               "(classifier-free guidance runs above 1); drop it or raise 'guidance'")  # fmt: skip
        if request.embeddings is not None:
            self._check_embeddings(request, branches)
        return (int(np.prod(grid)),) * branches

    def frames(self, request: Request) -> int:
        """The request's frames, or the pipeline's default."""
        return DEFAULT_FRAMES if request.frames is None else request.frames

    def _check_embeddings(self, request: Request, branches: int) -> None:
        """The embeddings file holds ``prompt_embeds [Tt, Dj]`` and, with guidance, ``negative_prompt_embeds
        [Tn, Dj]``."""
        width, line = self.model.config["text_dim"], request.line
        wanted = ["prompt_embeds", "negative_prompt_embeds"][:branches]
        tensors = self.embeddings_file(request)
        shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
        if not all(key in shapes and len(shapes[key]) == 2 and shapes[key][1] == width and shapes[key][0] >= 1
                   for key in wanted):  # fmt: skip
            raise RequestError(f"line {line}: embeddings {request.embeddings} hold {shapes}; this model takes "
                               f"{', '.join(f'{key} [Tt, {width}]' for key in wanted)} (one prompt, unbatched; "
                               "the negative one for guidance above 1)")  # fmt: skip
        self.check_embedding_values(request, tensors, wanted)

    @torch.no_grad()
    def start(self, request: Request) -> WanDenoising:
        """Encode the prompts (or read the embeddings), draw the seeded noise and set the request's
        own scheduler, as ``WanPipeline.__call__`` does for it alone."""
        pipe, device = self.pipeline, self.device
        guidance = self.guidance_scale(request)
        cfg = guidance > 1
        if request.prompt is not None:
            text, negative = pipe.encode_prompt(prompt=request.prompt, negative_prompt=request.negative_prompt,
                                                do_classifier_free_guidance=cfg, device=device,
                                                max_sequence_length=request.max_sequence_length)  # fmt: skip
        else:
            saved = {key: tensor.to(device) for key, tensor in self.embeddings_file(request).items()}
            text, negative = saved["prompt_embeds"][None], saved.get("negative_prompt_embeds") if cfg else None
            negative = None if negative is None else negative[None]
        branches = [{"encoder_hidden_states": text[0].to(self.dtype)}]
        if cfg:
            branches.append({"encoder_hidden_states": negative[0].to(self.dtype)})
        scheduler = copy.deepcopy(pipe.scheduler)
        scheduler.set_timesteps(request.steps, device=device)
        scheduler.set_begin_index(0)
        generator = torch.Generator().manual_seed(request.seed)
        latents = pipe.prepare_latents(1, self.model.config["in_channels"], request.height, request.width,
                                       self.frames(request), torch.float32, device, generator)  # fmt: skip
        return WanDenoising(request, latents[0], scheduler, scheduler.timesteps, branches,
                            guidance if cfg else None, dtype=self.dtype)  # fmt: skip

    @torch.no_grad()
    def decode(self, state: WanDenoising) -> np.ndarray:
        """``[frames, height, width, 3]`` floats in ``[0, 1]``: ``WanPipeline``'s un-normalising, VAE
        decode and post-processing (``output_type="np"``)."""
        vae = self.pipeline.vae
        latents = state.latents[None].to(next(vae.parameters()).device, vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / std + mean, return_dict=False)[0]
        return self.pipeline.video_processor.postprocess_video(video, output_type="np")[0]

    @classmethod
    def tiny(cls, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
             config: Mapping[str, Any] | None = None) -> WanGenerator:  # fmt: skip
        """A tiny random Wan (:func:`tiny_wan_generator`)."""
        return tiny_wan_generator(dtype, device, seed, config)

    @classmethod
    def load(cls, model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> WanGenerator:
        """A ``WanPipeline`` directory (:func:`load_wan_generator`)."""
        return load_wan_generator(model_path, dtype, device)


def refuse_wan_pipeline(model_path: str | Path) -> str | None:
    """Why a Wan pipeline directory cannot be generated from, or ``None``: an image-to-video
    pipeline (its image context is not prepared) or Wan 2.2 A14B's two experts."""
    index = json.loads((Path(model_path) / "model_index.json").read_text())
    if index.get("_class_name") != "WanPipeline":
        return (f"{model_path} is a {index.get('_class_name')}; deepspeed-knap generate runs text-to-video WanPipeline "
                "checkpoints (Wan 2.1 T2V, Wan 2.2 TI2V-5B)")  # fmt: skip
    if (index.get("transformer_2") or [None])[0] or index.get("boundary_ratio") is not None:
        return (f"{model_path} is a two-expert Wan 2.2 pipeline (transformer_2, boundary_ratio): deepspeed-knap "
                "generate runs one transformer; use Wan 2.1 T2V or Wan 2.2 TI2V-5B")  # fmt: skip
    return None


def load_wan_generator(model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> WanGenerator:
    """A diffusers ``WanPipeline`` directory as a :class:`WanGenerator`: the transformer packed, the
    rest diffusers' own; the VAE in float32, as diffusers' Wan examples load it.

    Raises:
        ValueError: an I2V or two-expert pipeline (:func:`refuse_wan_pipeline`).
    """
    from diffusers import AutoencoderKLWan, WanPipeline

    problem = refuse_wan_pipeline(model_path)
    if problem is not None:
        raise ValueError(problem)
    vae = AutoencoderKLWan.from_pretrained(model_path, subfolder="vae", torch_dtype=torch.float32)
    pipeline = WanPipeline.from_pretrained(model_path, transformer=None, vae=vae, torch_dtype=dtype).to(device)
    model = PackedWanTransformer.from_pretrained(model_path, torch_dtype=dtype).to(device).eval()
    return WanGenerator(pipeline, model)


def tiny_wan_generator(dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                       config: Mapping[str, Any] | None = None) -> WanGenerator:  # fmt: skip
    """A tiny random Wan (``TINY_WAN`` or ``config``) with
    :func:`~deepspeed_knap.models.wan.data.tiny_wan_pipeline`, the same on every rank for a
    ``seed``: for CPU runs, tests and benchmarks without downloaded weights."""
    from deepspeed_knap.models.wan.data import tiny_wan_pipeline

    config = dict(TINY_WAN if config is None else config)
    pipeline = tiny_wan_pipeline(text_dim=config["text_dim"], z_dim=config["in_channels"], seed=seed).to(device, dtype)
    torch.manual_seed(seed)
    model = PackedWanTransformer(**config).to(device, dtype).eval()
    return WanGenerator(pipeline, model)
