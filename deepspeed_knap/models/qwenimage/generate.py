"""Qwen-Image generation, request by request, around diffusers' own ``QwenImagePipeline`` parts.

The packed transformer runs the requests of every rank together (balanced by
:mod:`deepspeed_knap.generation`); everything else is the pipeline's own code, called per request on
its home rank: ``encode_prompt`` (Qwen2.5-VL through the pipeline's chat template, its prefix
dropped, no padding), ``prepare_latents`` (the seeded noise, packed in 2x2 patches, in the text's
dtype), a copy of the pipeline's ``FlowMatchEulerDiscreteScheduler`` per request with the sigmas
``linspace(1, 1/steps, steps)`` and the shift ``mu = calculate_shift(image tokens, ...)`` of the
scheduler's config, and the decode (unpacked, the VAE's ``latents_mean`` and ``latents_std`` undone,
decoded, post-processed). Qwen-Image is not guidance-distilled: a request with a negative prompt runs
true classifier-free guidance at ``true_cfg_scale`` (4.0, the pipeline's default), the conditional and
the unconditional branch two sequences of their own texts' lengths for the planner, combined as the
pipeline does, rescaled to the conditional prediction's norm per token. So an image equals what
``QwenImagePipeline(...)(prompt, negative_prompt=..., true_cfg_scale=..., height=..., width=...,
num_inference_steps=..., generator=torch.Generator().manual_seed(seed), output_type="np")`` gives for
that request alone (tested at fp64 on gloo ranks).

Shapes: ``L`` image tokens (``(height / 16) * (width / 16)``), ``C`` packed latent channels (64),
``Tt`` text rows, ``Dj`` the text encoder's width (3584).
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
from deepspeed_knap.models.qwenimage.layers import ROPE_POSITIONS
from deepspeed_knap.models.qwenimage.qwenimage import PackedQwenImageTransformer, image_positions
from deepspeed_knap.models.qwenimage.spec import QWEN_IMAGE, TINY_QWEN_IMAGE

DEFAULT_TRUE_CFG_SCALE = 4.0  # QwenImagePipeline's true_cfg_scale


@dataclass
class QwenImageDenoising(Denoising):
    """One Qwen-Image request's state (:class:`~deepspeed_knap.generation.denoising.Denoising`):
    ``latents [L, C]`` packed, in the text's dtype as the pipeline keeps them; each branch holds
    ``encoder_hidden_states [Tt, Dj]`` and the image's ``img_shapes``."""

    def step_inputs(self, timestep: Tensor) -> dict[str, Tensor]:
        """The pipeline's ``timestep = t.to(latents.dtype) / 1000``."""
        return {"hidden_states": self.latents, "timestep": timestep.to(self.latents.dtype) / 1000}

    def combine(self, predictions: list[Tensor], timestep: Tensor) -> Tensor:
        """``QwenImagePipeline``'s true CFG: ``uncond + scale * (cond - uncond)``, rescaled per token
        to the conditional prediction's norm (the conditional one alone without guidance)."""
        if len(predictions) == 1:
            return predictions[0]
        conditional, unconditional = predictions
        combined = unconditional + self.guidance_scale * (conditional - unconditional)
        return combined * (conditional.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImageGenerator(Generator):
    """Qwen-Image requests (text to image): token counts and checks, start (encode, noise, scheduler),
    decode, around a diffusers ``QwenImagePipeline``
    (:class:`~deepspeed_knap.generation.generator.Generator`'s arguments). A request's ``guidance`` is
    refused (the model is not guidance-distilled): its guidance is ``true_cfg_scale`` with a
    ``negative_prompt``."""

    spec = QWEN_IMAGE
    default_guidance = DEFAULT_TRUE_CFG_SCALE
    pipeline_embeddings = ("prompt_embeds", "negative_prompt_embeds")

    @classmethod
    def tiny_config(cls, heads: int, head_dim: int) -> dict[str, Any]:
        """Every RoPE axis of the head: ``(head_dim / 4, 3 head_dim / 8, 3 head_dim / 8)``, as 16, 56, 56 of 128."""
        quarter = head_dim // 4
        axes = (quarter, (head_dim - quarter) // 2, head_dim - quarter - (head_dim - quarter) // 2)
        return {**super().tiny_config(heads, head_dim), "axes_dims_rope": axes}

    def pipeline_options(self, request: Request) -> dict[str, Any]:
        options = {"true_cfg_scale": self.true_cfg_scale(request)}
        if request.negative_prompt is not None:
            options["negative_prompt"] = request.negative_prompt
        return options

    def true_cfg_scale(self, request: Request) -> float:
        """The request's ``true_cfg_scale``, or the pipeline's default."""
        return DEFAULT_TRUE_CFG_SCALE if request.true_cfg_scale is None else request.true_cfg_scale

    def _branches(self, request: Request) -> int:
        """2 with true CFG (a negative prompt, or the embeddings file's negative, and a scale above
        1, as the pipeline runs it), else 1. Refuses what the pipeline would ignore.

        Raises:
            RequestError: a key Qwen-Image does not take (``frames``, ``image``, ``guidance``,
                ``guidance_2``), or a ``true_cfg_scale`` given above 1 without a negative prompt or
                at 1 or below with one (the pipeline would ignore the one given).
        """
        line = request.line
        for key, why in (("frames", "makes images"), ("image", "generates from text alone here (edits: not yet)"),
                         ("guidance", "is not guidance-distilled: its guidance is 'true_cfg_scale' with a "
                                      "'negative_prompt'"),
                         ("guidance_2", "has one transformer")):  # fmt: skip
            if getattr(request, key) is not None:
                raise RequestError(f"line {line}: Qwen-Image {why}; drop {key!r}")
        scale = self.true_cfg_scale(request)
        negative = request.negative_prompt is not None or (
            request.embeddings is not None and "negative_prompt_embeds" in self.embeddings_file(request)
        )
        if request.true_cfg_scale is not None and (scale > 1) != negative:
            raise RequestError(f"line {line}: true classifier-free guidance needs both 'true_cfg_scale' above 1 and a "
                               f"negative prompt ('negative_prompt', or the embeddings file's negative_prompt_embeds); "
                               f"got true_cfg_scale {scale} and negative_prompt {request.negative_prompt!r}: "
                               "QwenImagePipeline would ignore the one given")  # fmt: skip
        return 2 if negative else 1

    def request_seq_lens(self, request: Request) -> tuple[int, ...]:
        """Text + image tokens of each sequence ``request`` runs per step (two with true CFG, each
        of its own text's length): what the planner balances.

        Raises:
            RequestError: a size the VAE and the patching cannot take (the pipeline would round it),
                a ``max_sequence_length`` over the pipeline's 1,024, an embeddings file that is
                unreadable or does not fit, RoPE positions outside diffusers' tables (a side over
                ~65k px), and what :meth:`_branches` refuses.
        """
        pipe, line = self.pipeline, request.line
        branches = self._branches(request)
        side = pipe.vae_scale_factor * 2
        if request.height % side or request.width % side:
            raise RequestError(f"line {line}: {request.height}x{request.width} px: Qwen-Image's VAE "
                               f"({pipe.vae_scale_factor}x) and 2x2 patches need height and width in multiples of "
                               f"{side} px")  # fmt: skip
        grid = (request.height // side, request.width // side)
        length = self.max_sequence_length(request)
        if length > pipe.tokenizer_max_length:
            raise RequestError(f"line {line}: max_sequence_length {length} is over "
                               f"QwenImagePipeline's {pipe.tokenizer_max_length}")  # fmt: skip
        if request.embeddings is not None:
            rows = self._embedding_rows(request)[:branches]
        else:
            rows = [self._text_rows(prompt, length) for prompt in [request.prompt, request.negative_prompt][:branches]]
        # Every token's RoPE position must be in diffusers' tables: image rows and columns centred,
        # the text from the larger half-side on (checked here, before any rank starts the request).
        positions, text_start = image_positions([(1, *grid)])
        low, high = int(positions.min()), text_start + max(rows) - 1
        if low < -ROPE_POSITIONS or high >= ROPE_POSITIONS:
            raise RequestError(f"line {line}: {request.height}x{request.width} px with {max(rows)} text rows puts RoPE "
                               f"positions at {low}..{high}, outside Qwen-Image's {-ROPE_POSITIONS}.."
                               f"{ROPE_POSITIONS - 1}; make the image smaller")  # fmt: skip
        return tuple(count + grid[0] * grid[1] for count in rows)

    def _text_rows(self, prompt: str, max_sequence_length: int) -> int:
        """The rows ``encode_prompt`` gives ``prompt``: its chat-templated tokens (truncated as the
        pipeline truncates them) less the template's dropped prefix, at most ``max_sequence_length``."""
        pipe = self.pipeline
        drop = pipe.prompt_template_encode_start_idx
        tokens = pipe.tokenizer(pipe.prompt_template_encode.format(prompt), max_length=pipe.tokenizer_max_length + drop,
                                truncation=True)["input_ids"]  # fmt: skip
        return min(len(tokens) - drop, max_sequence_length)

    def _embedding_rows(self, request: Request) -> list[int]:
        """Rows of the embeddings file's ``prompt_embeds [Tt, Dj]`` (and ``negative_prompt_embeds``)
        the pipeline uses: at most ``max_sequence_length`` (it cuts given embeddings there too)."""
        width, line = self.model.config["joint_attention_dim"], request.line
        tensors = self.embeddings_file(request)
        wanted = [key for key in self.pipeline_embeddings if key in tensors]
        shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
        if (
            "prompt_embeds" not in wanted
            or set(shapes) - set(wanted)
            or not all(len(shapes[key]) == 2 and shapes[key][0] >= 1 and shapes[key][1] == width for key in wanted)
        ):
            raise RequestError(f"line {line}: embeddings {request.embeddings} hold {shapes}; Qwen-Image takes "
                               f"prompt_embeds [Tt, {width}] and for true CFG negative_prompt_embeds [Tn, {width}], "
                               "nothing else (one prompt each, unbatched, no padding: no mask)")  # fmt: skip
        self.check_embedding_values(request, tensors, wanted)
        return [min(shapes[key][0], self.max_sequence_length(request)) for key in wanted]

    @torch.no_grad()
    def start(self, request: Request) -> QwenImageDenoising:
        """Encode the prompts (or read the embeddings), draw the seeded noise and set the request's own
        scheduler, as ``QwenImagePipeline.__call__`` does for it alone."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        pipe, device = self.pipeline, self.device
        guided = self._branches(request) == 2
        texts = self._encode(request, guided)
        generator = torch.Generator().manual_seed(request.seed)
        latents = pipe.prepare_latents(1, self.model.config["in_channels"] // 4, request.height, request.width,
                                       texts[0].dtype, device, generator)[0]  # fmt: skip
        side = pipe.vae_scale_factor * 2
        grids = torch.tensor([[1, request.height // side, request.width // side]], device=device)
        steps, config = request.steps, pipe.scheduler.config
        mu = calculate_shift(len(latents), config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))  # fmt: skip
        scheduler = copy.deepcopy(pipe.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        scheduler.set_begin_index(0)
        branches = [{"encoder_hidden_states": text, "img_shapes": grids} for text in texts]
        return QwenImageDenoising(request, latents, scheduler, timesteps, branches,
                                  self.true_cfg_scale(request) if guided else None)  # fmt: skip

    def _encode(self, request: Request, guided: bool) -> list[Tensor]:
        """``[Tt, Dj]`` text rows of the prompt and, with true CFG, of the negative prompt: from
        ``encode_prompt`` or the embeddings file."""
        pipe, device = self.pipeline, self.device
        if request.prompt is not None:
            prompts = [request.prompt, request.negative_prompt][: 1 + guided]
            length = self.max_sequence_length(request)
            return [pipe.encode_prompt(prompt=prompt, device=device, max_sequence_length=length)[0][0]
                    for prompt in prompts]  # fmt: skip
        saved, length = self.embeddings_file(request), self.max_sequence_length(request)
        keys = self.pipeline_embeddings[: 1 + guided]
        return [saved[key][:length].to(device, pipe.text_encoder.dtype) for key in keys]  # cut as encode_prompt does

    @torch.no_grad()
    def decode(self, state: QwenImageDenoising) -> np.ndarray:
        """``[height, width, 3]`` float image in ``[0, 1]``: the pipeline's unpacking, un-normalising,
        VAE decode (the one frame) and post-processing (``output_type="np"``)."""
        pipe, request = self.pipeline, state.request
        latents = pipe._unpack_latents(state.latents[None], request.height, request.width, pipe.vae_scale_factor)
        vae = pipe.vae
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents / std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="np")[0]

    @classmethod
    def tiny(cls, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
             config: Mapping[str, Any] | None = None) -> QwenImageGenerator:  # fmt: skip
        """A tiny random Qwen-Image (``TINY_QWEN_IMAGE`` or ``config``) with
        :func:`~deepspeed_knap.models.qwenimage.finetune.tiny_qwen_image_components`, the same on
        every rank for a ``seed``."""
        import diffusers

        from deepspeed_knap.models.qwenimage.finetune import tiny_qwen_image_components

        config = dict(TINY_QWEN_IMAGE if config is None else config)
        pipeline = diffusers.QwenImagePipeline(**tiny_qwen_image_components(config, seed), transformer=None)
        torch.manual_seed(seed)
        model = PackedQwenImageTransformer(**config).to(device, dtype).eval()
        return cls(pipeline.to(device, dtype), model)

    @classmethod
    def load(cls, model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> QwenImageGenerator:
        """A ``QwenImagePipeline`` directory: the transformer packed, the rest diffusers' own.

        Raises:
            ValueError: another pipeline class (the edit pipelines are not run here yet).
        """
        import json

        import diffusers

        name = json.loads((Path(model_path) / "model_index.json").read_text()).get("_class_name")
        if name != "QwenImagePipeline":
            raise ValueError(f"{model_path} is a {name}; deepspeed-knap generate runs QwenImagePipeline checkpoints "
                             "(text to image) of Qwen-Image")  # fmt: skip
        pipeline = diffusers.QwenImagePipeline.from_pretrained(model_path, transformer=None, torch_dtype=dtype)
        model = PackedQwenImageTransformer.from_pretrained(model_path, torch_dtype=dtype).to(device).eval()
        return cls(pipeline.to(device), model)
