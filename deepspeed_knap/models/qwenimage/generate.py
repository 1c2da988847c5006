"""Qwen-Image generation, request by request, around diffusers' own ``QwenImagePipeline``,
``QwenImageEditPlusPipeline`` and ``QwenImageEditPipeline`` parts.

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

Edits (:class:`QwenImageEditPlusGenerator` for Qwen-Image-Edit-2509 and -2511, 1 to 16 reference
images; :class:`QwenImageEditGenerator` for Qwen-Image-Edit, one): a request's ``image`` are the
references, prepared as the pipeline's ``__call__`` prepares them. Each is resized for the
vision-language encoder (Edit-Plus: to about ``CONDITION_IMAGE_SIZE`` px of area; Edit: about 1
megapixel) and encoded with the prompt, and with the negative prompt for true CFG, by
``encode_prompt(prompt, image=...)``: the text's rows hold the references' vision tokens, so its
length depends on them (nothing is truncated: the edit pipelines ignore ``max_sequence_length``).
Each is VAE-encoded at about ``VAE_IMAGE_SIZE`` (Edit: 1 megapixel; the posterior's mode,
normalised) and packed by ``prepare_latents``; their tokens follow the target's in the sequence and
in ``img_shapes``, the shift ``mu`` counts the target's alone, and the model predicts the target's.
The pipeline module's sizes and ``calculate_dimensions`` are read at each call, as the pipeline reads
them. Without ``height`` or ``width`` the side is the pipeline's: ``calculate_dimensions(1024 * 1024,
ratio)`` of the last reference (Edit: its one). So an edit equals
``QwenImageEditPlusPipeline(...)(image=[...], prompt, ...)`` (or ``QwenImageEditPipeline``'s with
one image) for that request alone.

Shapes: ``L`` image tokens (``(height / 16) * (width / 16)``), ``Lr`` reference tokens, ``C``
packed latent channels (64), ``Tt`` text rows, ``Dj`` the text encoder's width (3584).
"""

from __future__ import annotations

import copy
import math
import sys
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
from deepspeed_knap.models.flux.flux1 import rope_axes
from deepspeed_knap.models.loading import pipeline_index
from deepspeed_knap.models.qwenimage.layers import ROPE_POSITIONS
from deepspeed_knap.models.qwenimage.qwenimage import PackedQwenImageTransformer
from deepspeed_knap.models.qwenimage.spec import QWEN_IMAGE, TINY_QWEN_IMAGE

DEFAULT_TRUE_CFG_SCALE = 4.0  # the pipelines' true_cfg_scale
# The edit pipelines' output area where a request gives no size: their __call__'s
# calculate_dimensions(1024 * 1024, ratio) of a reference's aspect ratio.
EDIT_OUTPUT_AREA = 1024 * 1024
# QwenImageEditPlusPipeline._get_qwen_prompt_embeds's text before the prompt, once per reference i
# (from 1): the processor puts the reference's vision tokens at its <|image_pad|>.
PICTURE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class QwenImageDenoising(Denoising):
    """One Qwen-Image request's state (:class:`~deepspeed_knap.generation.denoising.Denoising`):
    ``latents [L, C]`` packed, in the text's dtype as the pipeline keeps them; each branch holds
    ``encoder_hidden_states [Tt, Dj]`` and the images' ``img_shapes`` (the target's grid, then each
    reference's). The packed model predicts the target's tokens alone, so every row of a prediction
    is the noise's.

    Attributes:
        reference: an edit's reference images' packed latents ``[Lr, C]``, after the noise every
            step (``cat([latents, image_latents])``), or ``None``.
        height, width: the image's pixels.
    """

    reference: Tensor | None = None
    height: int = 0
    width: int = 0

    def step_inputs(self, timestep: Tensor) -> dict[str, Tensor]:
        """The pipeline's ``timestep = t.to(latents.dtype) / 1000`` and, with references,
        ``cat([latents, image_latents])``."""
        hidden = self.latents if self.reference is None else torch.cat([self.latents, self.reference])
        return {"hidden_states": hidden, "timestep": timestep.to(self.latents.dtype) / 1000}

    def combine(self, predictions: list[Tensor], timestep: Tensor) -> Tensor:
        """The pipelines' true CFG: ``uncond + scale * (cond - uncond)``, rescaled per token to the
        conditional prediction's norm (the conditional one alone without guidance)."""
        if len(predictions) == 1:
            return predictions[0]
        conditional, unconditional = predictions
        combined = unconditional + self.guidance_scale * (conditional - unconditional)
        return combined * (conditional.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


@dataclass
class EditReferences:
    """A request's reference images as an edit pipeline's ``__call__`` prepares them.

    Attributes:
        condition: what ``encode_prompt(image=...)`` and its processor take: the PIL images the
            vision-language encoder sees (Edit-Plus: a list, each at about ``CONDITION_IMAGE_SIZE``
            px of area; Edit: its one image at about 1 megapixel).
        images: the PIL images the VAE's inputs are preprocessed from, in order.
        sizes: ``(height, width)`` px each is VAE-encoded at (multiples of 32).
        output: ``(height, width)`` px of the edit where the request gives no size.
    """

    condition: Any
    images: list[Any]
    sizes: list[tuple[int, int]]
    output: tuple[int, int]


class QwenImageGenerator(Generator):
    """Qwen-Image requests (text to image): token counts and checks, start (encode, noise, scheduler),
    decode, around a diffusers ``QwenImagePipeline``
    (:class:`~deepspeed_knap.generation.generator.Generator`'s arguments). A request's ``guidance`` is
    refused (the model is not guidance-distilled): its guidance is ``true_cfg_scale`` with a
    ``negative_prompt``. Edits: :class:`QwenImageEditPlusGenerator` and :class:`QwenImageEditGenerator`
    (:meth:`load` picks a folder's by its pipeline)."""

    spec = QWEN_IMAGE
    default_guidance = DEFAULT_TRUE_CFG_SCALE
    pipeline_embeddings = ("prompt_embeds", "negative_prompt_embeds")
    pipeline_class = "QwenImagePipeline"  # the diffusers pipeline followed

    @classmethod
    def tiny_config(cls, heads: int, head_dim: int) -> dict[str, Any]:
        """Every RoPE axis of the head, each even (:func:`~deepspeed_knap.models.flux.flux1.rope_axes`:
        16, 56, 56 of 128, as the pipeline's model has them)."""
        return {**super().tiny_config(heads, head_dim), "axes_dims_rope": rope_axes(head_dim)}

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
            RequestError: a key Qwen-Image does not take (``frames``, ``guidance``, ``guidance_2``),
                what :meth:`_check_pipeline_keys` refuses, or a ``true_cfg_scale`` given above 1
                without a negative prompt or at 1 or below with one (the pipeline would ignore the
                one given).
        """
        line = request.line
        for key, why in (("frames", "makes images"),
                         ("guidance", "is not guidance-distilled: its guidance is 'true_cfg_scale' with a "
                                      "'negative_prompt'"),
                         ("guidance_2", "has one transformer")):  # fmt: skip
            if getattr(request, key) is not None:
                raise RequestError(f"line {line}: Qwen-Image {why}; drop {key!r}")
        self._check_pipeline_keys(request)
        scale = self.true_cfg_scale(request)
        negative = request.negative_prompt is not None or (
            request.embeddings is not None and "negative_prompt_embeds" in self.embeddings_file(request)
        )
        if request.true_cfg_scale is not None and (scale > 1) != negative:
            raise RequestError(f"line {line}: true classifier-free guidance needs both 'true_cfg_scale' above 1 and a "
                               f"negative prompt ('negative_prompt', or the embeddings file's negative_prompt_embeds); "
                               f"got true_cfg_scale {scale} and negative_prompt {request.negative_prompt!r}: "
                               f"{self.pipeline_class} would ignore the one given")  # fmt: skip
        return 2 if negative else 1

    def _check_pipeline_keys(self, request: Request) -> None:
        """Refuse ``image``: ``QwenImagePipeline`` generates from text alone.

        Raises:
            RequestError: naming the line and the checkpoints that edit.
        """
        if request.image is not None:
            raise RequestError(f"line {request.line}: this Qwen-Image checkpoint is a QwenImagePipeline (text to "
                               "image); edits take a QwenImageEditPlusPipeline (Qwen-Image-Edit-2509, -2511) or "
                               "QwenImageEditPipeline (Qwen-Image-Edit) checkpoint: drop 'image'")  # fmt: skip

    def request_seq_lens(self, request: Request) -> tuple[int, ...]:
        """Text + image tokens (an edit's references' too) of each sequence ``request`` runs per step
        (two with true CFG, each of its own text's length): what the planner balances.

        Raises:
            RequestError: a size the VAE and the patching cannot take (the pipeline would round it),
                a step count of NaN timesteps (:meth:`_check_schedule`), text rows past the RoPE tables, an
                embeddings file that is unreadable or does not fit, a ``max_sequence_length`` over the
                pipeline's 1,024 (with a prompt or embeddings: every Qwen-Image pipeline refuses it), and
                what :meth:`_branches`, :meth:`_references` and :meth:`_text_rows` refuse.
        """
        branches = self._branches(request)  # (an edit's: refuses max_sequence_length, which its pipeline ignores)
        length, most = self.max_sequence_length(request), self.pipeline.tokenizer_max_length
        if length > most:  # check_inputs of every Qwen-Image pipeline, whether it encodes the text or is given it
            raise RequestError(f"line {request.line}: max_sequence_length {length} is over {self.pipeline_class}'s "
                               f"{most}")  # fmt: skip
        references = self._references(request)
        grids = self._grids(*self._size(request, references), references)
        self._check_schedule(request, math.prod(grids[0]))
        image = sum(math.prod(grid) for grid in grids)
        if request.embeddings is not None:
            rows = self._embedding_rows(request)[:branches]
        else:
            prompts = [request.prompt, request.negative_prompt][:branches]
            rows = [self._text_rows(request, prompt, references) for prompt in prompts]
        self._check_positions(request, grids, max(rows))
        return tuple(count + image for count in rows)

    def _references(self, request: Request) -> EditReferences | None:
        """The request's reference images as the pipeline prepares them: none here (text to image)."""
        return None

    def _size(self, request: Request, references: EditReferences | None) -> tuple[int, int]:
        """``(height, width)`` px of the image: the request's, checked (:meth:`_check_size`)."""
        self._check_size(request, request.height, request.width)
        return request.height, request.width

    def _check_size(self, request: Request, height: int, width: int) -> None:
        """Refuse a size the VAE and the 2x2 patches cannot take (the pipeline would floor it).

        Raises:
            RequestError: naming the line, the size and the multiple.
        """
        side = self.pipeline.vae_scale_factor * 2
        if height % side or width % side:
            raise RequestError(f"line {request.line}: {height}x{width} px: Qwen-Image's VAE "
                               f"({self.pipeline.vae_scale_factor}x) and 2x2 patches need height and width in "
                               f"multiples of {side} px (the pipeline would floor them)")  # fmt: skip

    def _grids(self, height: int, width: int, references: EditReferences | None) -> list[tuple[int, int, int]]:
        """The sequence's ``img_shapes``: the target's post-patch grid ``(1, h, w)``, then each
        reference's at its VAE size."""
        side = self.pipeline.vae_scale_factor * 2
        sizes = [(height, width), *([] if references is None else references.sizes)]
        return [(1, rows // side, columns // side) for rows, columns in sizes]

    def _check_positions(self, request: Request, grids: list[tuple[int, int, int]], rows: int) -> None:
        """Refuse text rows past diffusers' RoPE tables (``QwenEmbedRope``: positions up to
        ``ROPE_POSITIONS - 1``): the text's row ``j`` is at position ``m + j``, ``m`` the largest
        half side of the images in tokens (the images' own positions, from ``-(side - side // 2)``,
        stay inside when the text's do).

        Raises:
            RequestError: naming the line, the rows and where they start.
        """
        start = max(max(height // 2, width // 2) for _, height, width in grids)
        if start + rows > ROPE_POSITIONS:
            raise RequestError(f"line {request.line}: {rows} text rows from RoPE position {start} on (the largest "
                               f"image's half side in tokens) pass the {ROPE_POSITIONS} positions of Qwen-Image's RoPE "
                               "tables, which the pipeline would overrun; shorten the prompt, or give fewer or smaller "
                               "images")  # fmt: skip

    def _text_rows(self, request: Request, prompt: str, references: EditReferences | None) -> int:
        """The rows ``encode_prompt`` gives ``prompt``: its chat-templated tokens (truncated as the
        pipeline truncates them) less the template's dropped prefix, at most ``max_sequence_length``
        (at most the pipeline's 1,024: :meth:`request_seq_lens` refuses more)."""
        pipe, length = self.pipeline, self.max_sequence_length(request)
        drop = pipe.prompt_template_encode_start_idx
        tokens = pipe.tokenizer(pipe.prompt_template_encode.format(prompt), max_length=pipe.tokenizer_max_length + drop,
                                truncation=True)["input_ids"]  # fmt: skip
        return min(len(tokens) - drop, length)

    def _embedding_rows(self, request: Request) -> list[int]:
        """Rows of the embeddings file's ``prompt_embeds [Tt, Dj]`` (and ``negative_prompt_embeds``)
        the pipeline uses (:meth:`_text_cut`)."""
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
        return [min(shapes[key][0], self._text_cut(request)) for key in wanted]

    def _text_cut(self, request: Request) -> int:
        """The most text rows the pipeline keeps of given embeddings: ``QwenImagePipeline.encode_prompt``
        cuts them to ``max_sequence_length`` (the edit pipelines keep them all)."""
        return self.max_sequence_length(request)

    @torch.no_grad()
    def start(self, request: Request) -> QwenImageDenoising:
        """Encode the prompts (or read the embeddings) and any reference images, draw the seeded noise
        and set the request's own scheduler, as the pipeline's ``__call__`` does for it alone."""
        device = self.device
        guided = self._branches(request) == 2
        references = self._references(request)
        height, width = self._size(request, references)
        texts = self._encode(request, guided, references)
        generator = torch.Generator().manual_seed(request.seed)
        latents, reference = self._latents(height, width, texts[0].dtype, generator, references)
        grids = torch.tensor(self._grids(height, width, references), device=device)
        scheduler, timesteps = self._schedule(len(latents), request.steps, device)
        branches = [{"encoder_hidden_states": text, "img_shapes": grids} for text in texts]
        return QwenImageDenoising(request, latents, scheduler, timesteps, branches,
                                  self.true_cfg_scale(request) if guided else None, reference=reference, height=height,
                                  width=width)  # fmt: skip

    def _schedule(self, image_tokens: int, steps: int, device: torch.device | str) -> tuple[Any, Tensor]:
        """A copy of the pipeline's scheduler set as the pipelines set it for ``steps`` steps of an
        image of ``image_tokens`` tokens (the target's alone, as they count ``image_seq_len``): the
        sigmas ``linspace(1, 1/steps, steps)``, the shift ``mu = calculate_shift(image_tokens, ...)``
        of the scheduler's config, the first step at index 0; and its ``[steps]`` timesteps."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        config = self.pipeline.scheduler.config
        mu = calculate_shift(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))  # fmt: skip
        scheduler = copy.deepcopy(self.pipeline.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def _check_schedule(self, request: Request, image_tokens: int) -> None:
        """Refuse a step count whose schedule is not finite. Qwen-Image's scheduler config stretches
        the sigmas to end at ``shift_terminal`` (0.02), dividing by ``1 - `` the last sigma: at one
        step that is 0, every timestep NaN, and the pipeline's image NaN (black), with nothing said.

        Raises:
            RequestError: naming the line, the steps and the fix.
        """
        with np.errstate(divide="ignore", invalid="ignore"):  # diffusers' 0 / 0, refused here with the reason
            _, timesteps = self._schedule(image_tokens, request.steps, "cpu")
        if not bool(torch.isfinite(timesteps).all()):
            terminal = self.pipeline.scheduler.config.get("shift_terminal")
            raise RequestError(f"line {request.line}: {request.steps} step(s): the scheduler's timesteps are not finite "
                               f"(its shift_terminal {terminal} divides by 1 minus the last sigma, 0 at one step), so "
                               "the image would be NaN; give 'steps' 2 or more")  # fmt: skip

    def _encode(self, request: Request, guided: bool, references: EditReferences | None) -> list[Tensor]:
        """``[Tt, Dj]`` text rows of the prompt and, with true CFG, of the negative prompt: from
        ``encode_prompt`` (with :meth:`_encode_options`) or the embeddings file."""
        pipe, device = self.pipeline, self.device
        if request.prompt is not None:
            prompts = [request.prompt, request.negative_prompt][: 1 + guided]
            options = self._encode_options(request, references)
            return [pipe.encode_prompt(prompt=prompt, device=device, **options)[0][0] for prompt in prompts]
        saved, cut = self.embeddings_file(request), self._text_cut(request)
        keys = self.pipeline_embeddings[: 1 + guided]
        return [saved[key][:cut].to(device, pipe.text_encoder.dtype) for key in keys]  # cut as encode_prompt does

    def _encode_options(self, request: Request, references: EditReferences | None) -> dict[str, Any]:
        """``encode_prompt``'s arguments besides the prompt: the text's ``max_sequence_length``."""
        return {"max_sequence_length": self.max_sequence_length(request)}

    def _latents(self, height: int, width: int, dtype: torch.dtype, generator: torch.Generator,
                 references: EditReferences | None) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """``prepare_latents``' seeded noise ``[L, C]``, and no references."""
        channels = self.model.config["in_channels"] // 4
        return self.pipeline.prepare_latents(1, channels, height, width, dtype, self.device, generator)[0], None

    @torch.no_grad()
    def decode(self, state: QwenImageDenoising) -> np.ndarray:
        """``[height, width, 3]`` float image in ``[0, 1]``: the pipeline's unpacking, un-normalising,
        VAE decode (the one frame) and post-processing (``output_type="np"``)."""
        pipe = self.pipeline
        latents = pipe._unpack_latents(state.latents[None], state.height, state.width, pipe.vae_scale_factor)
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
        """A tiny random Qwen-Image (``TINY_QWEN_IMAGE`` or ``config``) in this generator's pipeline
        with :meth:`tiny_components`, the same on every rank for a ``seed``."""
        import diffusers

        config = dict(TINY_QWEN_IMAGE if config is None else config)
        pipeline = getattr(diffusers, cls.pipeline_class)(**cls.tiny_components(config, seed), transformer=None)
        torch.manual_seed(seed)
        model = PackedQwenImageTransformer(**config).to(device, dtype).eval()
        return cls(pipeline.to(device, dtype), model)

    @classmethod
    def tiny_components(cls, config: Mapping[str, Any], seed: int) -> dict[str, Any]:
        """The pipeline's parts but the transformer:
        :func:`~deepspeed_knap.models.qwenimage.finetune.tiny_qwen_image_components`."""
        from deepspeed_knap.models.qwenimage.finetune import tiny_qwen_image_components

        return tiny_qwen_image_components(config, seed)

    @classmethod
    def load(cls, model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> QwenImageGenerator:
        """A ``QwenImagePipeline``, ``QwenImageEditPlusPipeline`` or ``QwenImageEditPipeline``
        directory as the generator that follows it: the transformer packed, the rest diffusers' own.

        Raises:
            ValueError: another pipeline class.
        """
        import diffusers

        name = pipeline_index(model_path).get("_class_name")
        if name not in QWEN_IMAGE_GENERATORS:
            raise ValueError(f"{model_path} is a {name}; deepspeed-knap generate runs Qwen-Image checkpoints of "
                             f"{', '.join(QWEN_IMAGE_GENERATORS)}")  # fmt: skip
        pipeline = getattr(diffusers, name).from_pretrained(model_path, transformer=None, torch_dtype=dtype)
        model = PackedQwenImageTransformer.from_pretrained(model_path, torch_dtype=dtype).to(device).eval()
        return QWEN_IMAGE_GENERATORS[name](pipeline.to(device), model)


class QwenImageEditPlusGenerator(QwenImageGenerator):
    """Qwen-Image edits around a diffusers ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit-2509, and
    -2511 with the transformer's ``zero_cond_t``): a request's ``image`` are its 1 to 16 references
    (the module docstring says how they are prepared). An embeddings file holds what
    ``encode_prompt(prompt, image=...)`` gives: the prompt's rows with the references' vision tokens."""

    pipeline_class = "QwenImageEditPlusPipeline"
    one_reference = False  # QwenImageEditPipeline takes one, as an image rather than a list

    def _text_cut(self, request: Request) -> int:
        """The edit pipelines' ``encode_prompt`` keeps every row of given embeddings."""
        return 2**31

    def pipeline_options(self, request: Request) -> dict[str, Any]:
        images = [self.image_file(request, index) for index in range(len(request.image))]
        return {**super().pipeline_options(request), "image": images[0] if self.one_reference else images}

    def _check_pipeline_keys(self, request: Request) -> None:
        """Refuse a request without ``image`` (the pipeline sizes by it and fails without), more than
        the pipeline's references, and ``max_sequence_length`` (the edit pipelines truncate nothing).

        Raises:
            RequestError: naming the line, the key and the fix.
        """
        line, name = request.line, self.pipeline_class
        if request.image is None:
            raise RequestError(f"line {line}: this Qwen-Image checkpoint is a {name}: it edits reference images; give "
                               "'image' (a path, or a list of paths), or use a QwenImagePipeline checkpoint for text "
                               "to image")  # fmt: skip
        if self.one_reference and len(request.image) > 1:
            raise RequestError(f"line {line}: {len(request.image)} images: {name} (Qwen-Image-Edit) edits one; give "
                               "one, or use a QwenImageEditPlusPipeline checkpoint (Qwen-Image-Edit-2509, -2511) for "
                               "several")  # fmt: skip
        if request.max_sequence_length is not None:
            raise RequestError(f"line {line}: {name} takes the whole text (the prompt with its images' vision tokens) "
                               "and ignores max_sequence_length: drop 'max_sequence_length'")  # fmt: skip

    def _pipeline_module(self) -> Any:
        """The pipeline's module: its sizes and ``calculate_dimensions``, read at each call as the
        pipeline's ``__call__`` reads its globals (a test may shrink them)."""
        return sys.modules[type(self.pipeline).__module__]

    def _dimensions(self, request: Request, index: int, image: Any, area: int) -> tuple[int, int]:
        """``(height, width)`` px the pipeline's ``calculate_dimensions(area, ratio)`` gives
        reference ``index`` (sides rounded to 32 px).

        Raises:
            RequestError: a side rounded to 0 (an image too elongated for the area), naming it.
        """
        width, height = self._pipeline_module().calculate_dimensions(area, image.width / image.height)[:2]
        if not (width and height):
            raise RequestError(f"line {request.line}: image {request.image[index]} is {image.width}x{image.height} "
                               f"px: {self.pipeline_class} would size it {width}x{height} px at {area:,} px of area "
                               "(sides rounded to 32 px); give a less elongated image")  # fmt: skip
        return height, width

    def _references(self, request: Request) -> EditReferences:
        """``QwenImageEditPlusPipeline.__call__``'s: each reference resized to about
        ``CONDITION_IMAGE_SIZE`` for the vision-language encoder and VAE-encoded at about
        ``VAE_IMAGE_SIZE`` (both from the original); the output's default size from the last.

        Raises:
            RequestError: an unreadable image, or one :meth:`_dimensions` refuses.
        """
        module, processor = self._pipeline_module(), self.pipeline.image_processor
        images = [self.image_file(request, index) for index in range(len(request.image))]
        condition, sizes = [], []
        for index, image in enumerate(images):
            height, width = self._dimensions(request, index, image, module.CONDITION_IMAGE_SIZE)
            condition.append(processor.resize(image, height, width))
            sizes.append(self._dimensions(request, index, image, module.VAE_IMAGE_SIZE))
        output = self._dimensions(request, len(images) - 1, images[-1], EDIT_OUTPUT_AREA)
        return EditReferences(condition, images, sizes, output)

    def _vision_text(self, prompt: str, references: int) -> str:
        """The text the processor takes with the references: the chat template around a
        ``Picture i:`` vision block per reference and the prompt."""
        pictures = "".join(PICTURE_PROMPT.format(index + 1) for index in range(references))
        return self.pipeline.prompt_template_encode.format(pictures + prompt)

    def _size(self, request: Request, references: EditReferences) -> tuple[int, int]:
        """``(height, width)`` px: the request's sides, a side not given the pipeline's default
        (``height or calculated_height``), checked (:meth:`_check_size`)."""
        height, width = request.height or references.output[0], request.width or references.output[1]
        self._check_size(request, height, width)
        return height, width

    def _text_rows(self, request: Request, prompt: str, references: EditReferences) -> int:
        """The rows ``encode_prompt(prompt, image=...)`` gives: the processor's tokens of the
        templated text, each ``<|image_pad|>`` expanded to its image's vision tokens, less the
        template's dropped prefix. Runs the processor, not the encoder.

        Raises:
            RequestError: an image the processor refuses (such as one over 200:1), naming them.
        """
        pipe = self.pipeline
        text = self._vision_text(prompt, len(references.images))
        try:
            tokens = pipe.processor(text=[text], images=references.condition, padding=True,
                                    return_tensors="pt")["input_ids"]  # fmt: skip
        except Exception as error:  # the image processor raises ValueError, PIL its own types
            raise RequestError(f"line {request.line}: the vision-language processor cannot take the images "
                               f"{list(request.image)}: {type(error).__name__}: {error}") from None  # fmt: skip
        return tokens.shape[1] - pipe.prompt_template_encode_start_idx

    def _encode_options(self, request: Request, references: EditReferences) -> dict[str, Any]:
        """The condition images (the edit pipelines' ``encode_prompt`` truncates nothing)."""
        return {"image": references.condition}

    def _latents(self, height: int, width: int, dtype: torch.dtype, generator: torch.Generator,
                 references: EditReferences) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``prepare_latents``' seeded noise ``[L, C]`` and the references' packed latents ``[Lr,
        C]``: each reference preprocessed at its VAE size (``[1, 3, 1, h, w]`` in ``[-1, 1]``),
        encoded (the posterior's mode), normalised and packed, in order."""
        processor, channels = self.pipeline.image_processor, self.model.config["in_channels"] // 4
        pixels = [processor.preprocess(image, rows, columns).unsqueeze(2)
                  for image, (rows, columns) in zip(references.images, references.sizes, strict=True)]  # fmt: skip
        latents, image_latents = self.pipeline.prepare_latents(pixels[0] if self.one_reference else pixels, 1, channels,
                                                               height, width, dtype, self.device, generator)  # fmt: skip
        return latents[0], image_latents[0]

    @classmethod
    def tiny_components(cls, config: Mapping[str, Any], seed: int) -> dict[str, Any]:
        """The text-to-image tiny parts and their tokenizer's
        :func:`~deepspeed_knap.models.qwenimage.finetune.tiny_qwen2vl_processor`."""
        from deepspeed_knap.models.qwenimage.finetune import tiny_qwen2vl_processor

        components = super().tiny_components(config, seed)
        return {**components, "processor": tiny_qwen2vl_processor(components["tokenizer"])}


class QwenImageEditGenerator(QwenImageEditPlusGenerator):
    """Qwen-Image-Edit requests around a diffusers ``QwenImageEditPipeline``: one reference image,
    resized to about 1 megapixel (``calculate_dimensions(1024 * 1024, ratio)``), which both the
    vision-language encoder (in the template's own vision block) and the VAE take; the output's
    default size is that one's."""

    pipeline_class = "QwenImageEditPipeline"
    one_reference = True

    def _references(self, request: Request) -> EditReferences:
        """``QwenImageEditPipeline.__call__``'s: its image resized to about 1 megapixel, for both
        encoders and as the output's default size.

        Raises:
            RequestError: an unreadable image, or one :meth:`_dimensions` refuses.
        """
        image = self.image_file(request)
        height, width = self._dimensions(request, 0, image, EDIT_OUTPUT_AREA)
        resized = self.pipeline.image_processor.resize(image, height, width)
        return EditReferences(resized, [resized], [(height, width)], (height, width))

    def _vision_text(self, prompt: str, references: int) -> str:
        """The chat template (its vision block included) around the prompt."""
        return self.pipeline.prompt_template_encode.format(prompt)


# The generator of each Qwen-Image pipeline class a checkpoint folder may name.
QWEN_IMAGE_GENERATORS = {generator.pipeline_class: generator
                         for generator in (QwenImageGenerator, QwenImageEditPlusGenerator, QwenImageEditGenerator)}  # fmt: skip
