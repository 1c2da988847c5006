"""Wan 2.x generation, request by request, around diffusers' own ``WanPipeline`` and
``WanImageToVideoPipeline`` parts.

The packed transformer runs the requests of every rank together (balanced by
:mod:`deepspeed_knap.generation`); everything else is the pipeline's own code, called per request on
its home rank: ``encode_prompt`` (UMT5, the prompt and the negative prompt), ``encode_image`` (the
CLIP image context of Wan 2.1 I2V), ``prepare_latents`` (the seeded float32 noise, and for
image-to-video the first frame's condition from the VAE), a copy of the pipeline's scheduler per
request (UniPC with the checkpoint's ``flow_shift``; ``set_timesteps(steps)`` as the pipelines'
``__call__`` does), and the decode (the latents un-normalised by the VAE's ``latents_mean`` and
``latents_std``, decoded, post-processed to frames). Wan uses true classifier-free guidance: with a
``guidance`` above 1 (the pipeline's default is 5.0) each step runs the conditional and the
unconditional branch, two sequences of the same video tokens that the planner places apart or
together by cost, and the home rank combines them as the pipeline does. So a video equals what the
pipeline (``prompt, negative_prompt=..., height=..., width=..., num_frames=...,
num_inference_steps=..., guidance_scale=..., generator=torch.Generator().manual_seed(seed),
output_type="np"``, and ``image=``, ``guidance_scale_2=`` where the request gives them) gives for that
request alone (tested at fp64 on gloo ranks).

The checkpoints:

* Wan 2.1 T2V and Wan 2.2 TI2V-5B (``WanPipeline``): text to video; an image is a one-frame video.
  TI2V-5B (``expand_timesteps``) also takes a request's ``image``: its first latent frame is the
  image's, clean, its tokens at timestep 0, as ``WanImageToVideoPipeline`` runs that checkpoint.
* Wan 2.1 I2V and Wan 2.2 I2V-A14B (``WanImageToVideoPipeline``): every request gives an ``image``;
  the noise goes in beside the first frame's mask and latents (36 channels), and Wan 2.1 I2V
  cross-attends to the image's CLIP context too.
* Wan 2.2 A14B, T2V or I2V (``transformer_2``, ``boundary_ratio``): both experts
  (:class:`~deepspeed_knap.models.wan.experts.PackedWanExperts`); a request's step runs the
  high-noise expert while its timestep is at least ``boundary_ratio * 1000``, then the low-noise one
  with guidance ``guidance_2`` (the pipeline's ``guidance_scale_2``; default ``guidance``). Requests
  at different steps use different experts in the same batch: one plan balances them all.

Shapes: ``C`` latent channels, ``F`` latent frames (``(frames - 1) / 4 + 1``), ``H``, ``W`` latent
height and width (pixels / 8), ``Tt`` text rows, ``Dj`` the text encoder's width.
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

from deepspeed_knap.generation.denoising import Denoising
from deepspeed_knap.generation.generator import Generator
from deepspeed_knap.generation.requests import Request, RequestError
from deepspeed_knap.models.loading import pipeline_index
from deepspeed_knap.models.wan.data import I2V_TEXT_ROWS, IMAGE_CONTEXT_KEY, frames_per_second
from deepspeed_knap.models.wan.experts import PackedWanExperts, image_to_video_pipeline, pipeline_experts
from deepspeed_knap.models.wan.spec import TINY_WAN, WAN
from deepspeed_knap.models.wan.wan import PackedWanTransformer

DEFAULT_FRAMES = 81  # WanPipeline's num_frames
DEFAULT_GUIDANCE = 5.0  # WanPipeline's guidance_scale
MAX_SEQUENCE_LENGTH = 512  # WanPipeline's max_sequence_length: the text rows Wan was trained with


@dataclass
class WanDenoising(Denoising):
    """One Wan request's state (:class:`~deepspeed_knap.generation.denoising.Denoising`):
    ``latents [C, F, H, W]`` float32, as the pipeline keeps them; each branch holds
    ``encoder_hidden_states [Tt, Dj]`` (and Wan 2.1 I2V's ``encoder_hidden_states_image``).

    Attributes:
        dtype: the transformer's, which the pipeline casts its input to for each step.
        condition: image-to-video's first frame: ``[4 + C, F, H, W]`` (mask, then latents) put
            beside the noise, or with ``first_frame_mask`` ``[C, F, H, W]`` latents that replace
            the first frame's; ``None`` for text to video.
        first_frame_mask: ``[1, F, H, W]``, 0 on the first latent frame, 1 elsewhere
            (``expand_timesteps`` with an image), or ``None``.
        boundary: the timestep from which the high-noise expert runs (``boundary_ratio * 1000``), or
            ``None`` (one transformer).
        guidance_scale_2: the low-noise expert's guidance scale.
    """

    dtype: torch.dtype = torch.float32
    condition: Tensor | None = None
    first_frame_mask: Tensor | None = None
    boundary: float | None = None
    guidance_scale_2: float | None = None

    def step_inputs(self, timestep: Tensor) -> dict[str, Tensor]:
        if self.first_frame_mask is not None:  # WanImageToVideoPipeline with expand_timesteps
            mask = self.first_frame_mask
            hidden = (1 - mask) * self.condition + mask * self.latents
            return {"hidden_states": hidden.to(self.dtype), "timestep": (mask[0][:, ::2, ::2] * timestep).flatten()}
        if self.condition is not None:
            return {"hidden_states": torch.cat([self.latents, self.condition]).to(self.dtype), "timestep": timestep}
        return {"hidden_states": self.latents.to(self.dtype), "timestep": timestep}

    def guidance_at(self, timestep: Tensor) -> float | None:
        """``guidance_scale`` on the high-noise expert's steps, ``guidance_scale_2`` on the other's."""
        if self.boundary is None or timestep >= self.boundary:
            return self.guidance_scale
        return self.guidance_scale_2

    def final_latents(self) -> Tensor:
        """The latents to decode: with ``first_frame_mask``, the first frame's are the image's again."""
        if self.first_frame_mask is None:
            return self.latents
        return (1 - self.first_frame_mask) * self.condition + self.first_frame_mask * self.latents


class WanGenerator(Generator):
    """Wan requests: token counts and checks, start (encode, noise, scheduler), decode, around a
    diffusers ``WanPipeline`` or ``WanImageToVideoPipeline``
    (:class:`~deepspeed_knap.generation.generator.Generator`'s arguments; ``model`` is
    :class:`~deepspeed_knap.models.wan.experts.PackedWanExperts` for a two-expert pipeline)."""

    spec = WAN
    default_guidance = DEFAULT_GUIDANCE

    def __init__(self, pipeline: Any, model: torch.nn.Module) -> None:
        super().__init__(pipeline, model)
        self.boundary_ratio = pipeline.config.get("boundary_ratio")
        self.expand_timesteps = bool(pipeline.config.get("expand_timesteps"))
        self.frames_per_second = frames_per_second(self.expand_timesteps)
        # An image-to-video pipeline needs an image (with expand_timesteps too: its check_inputs refuses a
        # request without one); TI2V-5B's WanPipeline (expand_timesteps) takes one or none.
        self.needs_image = type(pipeline).__name__ == "WanImageToVideoPipeline"
        self.takes_image = self.needs_image or self.expand_timesteps
        self._image_pipeline = pipeline if type(pipeline).__name__ == "WanImageToVideoPipeline" else None

    @property
    def image_pipeline(self) -> Any:
        """The ``WanImageToVideoPipeline`` of the same parts: the pipeline itself, or for TI2V-5B's
        ``WanPipeline`` the image-to-video pipeline diffusers runs its image requests with."""
        if self._image_pipeline is None:
            self._image_pipeline = image_to_video_pipeline(self.pipeline)
        return self._image_pipeline

    def pipeline_options(self, request: Request) -> dict[str, Any]:
        options = super().pipeline_options(request)
        options.update(num_frames=self.frames(request), negative_prompt=request.negative_prompt)
        if request.image is not None:
            options["image"] = self.image_file(request)
        if request.guidance_2 is not None:
            options["guidance_scale_2"] = request.guidance_2
        return options

    def request_seq_lens(self, request: Request) -> tuple[int, ...]:
        """Video tokens of each sequence ``request`` runs per step (two with a guidance above 1):
        what the planner balances (the text and the image context are cross-attended, not part of
        the sequence).

        Raises:
            RequestError: frames, height or width the VAE and the patching cannot take (the
                pipeline would silently round them), a grid over the model's RoPE table, an
                embeddings file that is unreadable or does not fit, an image that is missing (an
                image-to-video pipeline), unreadable or not taken (a text-to-video one),
                ``true_cfg_scale`` (Wan's ``guidance`` is its classifier-free guidance), a
                ``max_sequence_length`` over :data:`MAX_SEQUENCE_LENGTH`, a
                ``negative_prompt`` or ``guidance_2`` without guidance, ``guidance_2`` without two
                experts.
        """
        pipe, config, line = self.pipeline, self.model.config, request.line
        if request.true_cfg_scale is not None:
            raise RequestError(f"line {line}: Wan's 'guidance' is its classifier-free guidance scale (default "
                               f"{DEFAULT_GUIDANCE}); drop 'true_cfg_scale'")  # fmt: skip
        self._check_image(request)
        self.check_size_given(request)
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
        guidance = self.guidance_scale(request)
        branches = 2 if guidance > 1 else 1
        if self.boundary_ratio is None and request.guidance_2 is not None:
            raise RequestError(f"line {line}: 'guidance_2' is the low-noise expert's guidance of a two-expert "
                               "pipeline (Wan 2.2 A14B); this one has one transformer: drop 'guidance_2'")  # fmt: skip
        for key in ("negative_prompt", "guidance_2"):
            if branches == 1 and getattr(request, key) is not None:
                raise RequestError(f"line {line}: {key!r} does nothing at guidance {guidance} (classifier-free "
                                   "guidance runs above 1); drop it or raise 'guidance'")  # fmt: skip
        if request.max_sequence_length is not None and request.max_sequence_length > MAX_SEQUENCE_LENGTH:
            # UMT5 would encode (and the blocks cross-attend to) that many padded rows, which no plan
            # prices: a large value would run out of memory as the request starts, ending the run.
            raise RequestError(f"line {line}: max_sequence_length {request.max_sequence_length} is over the "
                               f"{MAX_SEQUENCE_LENGTH} text tokens Wan's pipelines pad prompts to; give at most "
                               f"{MAX_SEQUENCE_LENGTH}")  # fmt: skip
        encodes = request.embeddings is None or self._check_embeddings(request, branches)  # (some text)
        if encodes and config.get("image_dim") is not None and self.max_sequence_length(request) != I2V_TEXT_ROWS:
            negative = f", or save negative_prompt_embeds [{I2V_TEXT_ROWS}, D] too" if request.embeddings else ""
            raise RequestError(f"line {line}: max_sequence_length {request.max_sequence_length}: a model with image "
                               f"context (Wan 2.1 I2V) takes its text as {I2V_TEXT_ROWS} rows (diffusers splits the "
                               f"context there); drop 'max_sequence_length'{negative}")  # fmt: skip
        return (int(np.prod(grid)),) * branches

    def frames(self, request: Request) -> int:
        """The request's frames, or the pipeline's default."""
        return DEFAULT_FRAMES if request.frames is None else request.frames

    def _check_image(self, request: Request) -> None:
        """An image where the pipeline needs or takes one, readable."""
        line, name = request.line, type(self.pipeline).__name__
        if request.image is None and self.needs_image:
            raise RequestError(f"line {line}: this {name} makes a video from an image: give 'image' (a path; relative "
                               "paths are the request file's directory's)")  # fmt: skip
        if request.image is not None and not self.takes_image:
            raise RequestError(f"line {line}: this {name} makes videos from text alone: drop 'image' (image to video "
                               "needs a WanImageToVideoPipeline checkpoint or Wan 2.2 TI2V-5B)")  # fmt: skip
        if request.image is not None and len(request.image) > 1:
            raise RequestError(f"line {line}: {len(request.image)} images: Wan's image to video starts from one (the "
                               "first frame); give one path")  # fmt: skip
        if request.image is not None:
            self.image_file(request)

    def _check_embeddings(self, request: Request, branches: int) -> bool:
        """The embeddings file holds ``prompt_embeds [Tt, Dj]`` and, with guidance, may hold
        ``negative_prompt_embeds [Tn, Dj]`` (a model with image context: 512 rows each,
        :data:`I2V_TEXT_ROWS`). Returns whether the negative prompt ``""`` is encoded in their place
        (guidance without them), as diffusers' pipelines do."""
        width, line = self.model.config["text_dim"], request.line
        tensors = self.embeddings_file(request)
        shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
        wanted = ["prompt_embeds"] + (["negative_prompt_embeds"] if branches == 2 and "negative_prompt_embeds" in shapes
                                      else [])  # fmt: skip
        rows = I2V_TEXT_ROWS if self.model.config.get("image_dim") is not None else None  # None: any
        if not all(key in shapes and len(shapes[key]) == 2 and shapes[key][1] == width and shapes[key][0] >= 1
                   and rows in (None, shapes[key][0]) for key in wanted):  # fmt: skip
            rows_name = "Tt" if rows is None else str(rows)
            raise RequestError(f"line {line}: embeddings {request.embeddings} hold {shapes}; this model takes "
                               f"{', '.join(f'{key} [{rows_name}, {width}]' for key in wanted)} (one prompt, "
                               "unbatched; for guidance above 1 optionally negative_prompt_embeds, else the "
                               'negative prompt "" is encoded)')  # fmt: skip
        self.check_embedding_values(request, tensors, wanted)
        return branches == 2 and len(wanted) == 1

    @torch.no_grad()
    def start(self, request: Request) -> WanDenoising:
        """Encode the prompts (or read the embeddings) and the image, draw the seeded noise, set the
        request's own scheduler and make the image's condition, in the order of the pipeline's
        ``__call__`` for the request alone (``WanImageToVideoPipeline``'s for a request with an image)."""
        device = self.device
        pipe = self.pipeline if request.image is None else self.image_pipeline
        guidance = self.guidance_scale(request)
        cfg = guidance > 1
        if request.prompt is not None:
            text, negative = pipe.encode_prompt(prompt=request.prompt, negative_prompt=request.negative_prompt,
                                                do_classifier_free_guidance=cfg, device=device,
                                                max_sequence_length=self.max_sequence_length(request))  # fmt: skip
        else:
            saved = {key: tensor.to(device) for key, tensor in self.embeddings_file(request).items()}
            text, negative = saved["prompt_embeds"][None], saved.get("negative_prompt_embeds") if cfg else None
            if cfg and negative is None:  # the negative prompt "", as the pipeline encodes it in its place
                _, negative = pipe.encode_prompt(prompt=None, prompt_embeds=text, do_classifier_free_guidance=True,
                                                 device=device,
                                                 max_sequence_length=self.max_sequence_length(request))  # fmt: skip
            elif negative is not None:
                negative = negative[None]
        image = None if request.image is None else self.image_file(request)
        context = {}
        if image is not None and self.model.config.get("image_dim") is not None:  # Wan 2.1 I2V's CLIP context
            context[IMAGE_CONTEXT_KEY] = pipe.encode_image(image, device)[0].to(self.dtype)
        branches = [{"encoder_hidden_states": text[0].to(self.dtype), **context}]
        if cfg:
            branches.append({"encoder_hidden_states": negative[0].to(self.dtype), **context})
        scheduler = copy.deepcopy(pipe.scheduler)
        scheduler.set_timesteps(request.steps, device=device)
        scheduler.set_begin_index(0)
        generator = torch.Generator().manual_seed(request.seed)
        size = (request.height, request.width, self.frames(request), torch.float32, device, generator)
        condition = mask = None
        if image is None:
            latents = pipe.prepare_latents(1, self.model.config["in_channels"], *size)
        else:
            pixels = pipe.video_processor.preprocess(image, height=request.height, width=request.width)
            prepared = pipe.prepare_latents(pixels.to(device, torch.float32), 1, pipe.vae.config.z_dim, *size)
            latents, condition = prepared[0], prepared[1][0]
            if self.expand_timesteps:
                mask = prepared[2][0]
        boundary = None if self.boundary_ratio is None else self.boundary_ratio * scheduler.config.num_train_timesteps
        guidance_2 = guidance if request.guidance_2 is None else request.guidance_2
        return WanDenoising(request, latents[0], scheduler, scheduler.timesteps, branches, guidance if cfg else None,
                            dtype=self.dtype, condition=condition, first_frame_mask=mask, boundary=boundary,
                            guidance_scale_2=guidance_2 if cfg else None)  # fmt: skip

    @torch.no_grad()
    def decode(self, state: WanDenoising) -> np.ndarray:
        """``[frames, height, width, 3]`` floats in ``[0, 1]``: the pipeline's un-normalising, VAE
        decode and post-processing (``output_type="np"``)."""
        vae = self.pipeline.vae
        latents = state.final_latents()[None].to(next(vae.parameters()).device, vae.dtype)
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
        """A ``WanPipeline`` or ``WanImageToVideoPipeline`` directory (:func:`load_wan_generator`)."""
        return load_wan_generator(model_path, dtype, device)


PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")


def load_wan_generator(model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> WanGenerator:
    """A diffusers ``WanPipeline`` or ``WanImageToVideoPipeline`` directory as a
    :class:`WanGenerator`: the transformer packed (both experts of a two-expert pipeline), the rest
    diffusers' own; the VAE and the CLIP image encoder in float32, as diffusers' Wan examples load
    them.

    Raises:
        ValueError: another pipeline class (e.g. ``WanVACEPipeline``), or a transformer the packed
            model does not run (its message).
    """
    import diffusers

    index = pipeline_index(model_path)
    name = index.get("_class_name")
    if name not in PIPELINES:
        raise ValueError(f"{model_path} is a {name}; deepspeed-knap generate runs {' and '.join(PIPELINES)} "
                         "checkpoints (Wan 2.1 T2V and I2V, Wan 2.2 A14B, I2V-A14B and TI2V-5B)")  # fmt: skip
    parts: dict[str, Any] = {"vae": diffusers.AutoencoderKLWan.from_pretrained(model_path, subfolder="vae",
                                                                                torch_dtype=torch.float32)}  # fmt: skip
    if (index.get("image_encoder") or [None])[0]:
        from transformers import CLIPVisionModel

        parts["image_encoder"] = CLIPVisionModel.from_pretrained(model_path, subfolder="image_encoder",
                                                                 torch_dtype=torch.float32)  # fmt: skip
    pipeline = getattr(diffusers, name).from_pretrained(model_path, transformer=None, transformer_2=None, **parts,
                                                        torch_dtype=dtype).to(device)  # fmt: skip
    _, two_experts = pipeline_experts(model_path)
    if two_experts and pipeline.scheduler.config.num_train_timesteps != 1000:
        # PackedWanExperts switches at boundary_ratio * 1000, the pipelines at boundary_ratio times this.
        raise ValueError(f"{model_path}: its scheduler has num_train_timesteps "
                         f"{pipeline.scheduler.config.num_train_timesteps}; the two experts switch at boundary_ratio x "
                         "1000 (Wan's 1000 train timesteps)")  # fmt: skip
    packed = PackedWanExperts if two_experts else PackedWanTransformer
    model = packed.from_pretrained(model_path, torch_dtype=dtype).to(device).eval()
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
