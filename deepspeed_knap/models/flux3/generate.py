"""FLUX.3 generation, request by request, around the blocks of diffusers' modular FLUX.3 pipeline
(``diffusers.modular_pipelines.flux3``: diffusers 0.42.1 has no FLUX.3 pipeline class).

The packed transformer runs the requests of every rank together (balanced by
:mod:`deepspeed_knap.generation`); everything else is the modular pipeline's own code, called per
request on its home rank, as ``Flux3AutoBlocks`` (without its prompt upsampler) runs it for the
request alone:

* the text: ``Flux3TextEncoderStep``'s helper (Qwen3-VL's stacked hidden states of the
  chat-templated prompt, right-padded to a multiple of 80 tokens, the padding attended to), and
  with classifier-free guidance the negative prompt's (``""`` unless given), of its own length;
  text ids ``(0, 0, 0, l)``;
* reference images (an edit): ``Flux3VaeEncoderSequentialStep`` (one reference kept whole and
  reflect-padded to its canvas, several each fitted under 1 megapixel and cropped; VAE-encoded,
  normalised by the VAE's batch-norm statistics, patchified), their tokens after the noise's in the
  request's sequence at ids ``(0, h / 2, w / 2, -1 - i)``; without ``height`` and ``width`` the
  image is the first reference's size (a single reference's canvas, cropped back at the decode);
* the noise: drawn in float32, then the transformer's dtype (``Flux3PrepareLatentsStep``), ids
  ``(0, h / 2, w / 2, 0)`` (:func:`~deepspeed_knap.models.flux3.data.flux3_image_ids`);
* a copy of the pipeline's scheduler per request (``FlowMatchEulerDiscreteScheduler``, shift 6.93)
  with the sigmas ``linspace(1, 1 / steps, steps)`` (``Flux3SetTimestepsStep``);
* classifier-free guidance by a copy of the pipeline's ``ClassifierFreeGuidance`` at the request's
  ``guidance``: it decides whether the unconditional branch runs (not at a scale of 1) and combines
  the branches each step;
* the decode: ``Flux3UnpackLatentsStep`` and ``Flux3DecodeStep`` (batch-norm statistics undone,
  unpatchified, VAE-decoded, post-processed and cropped back to a single reference).

So an image equals what ``Flux3AutoBlocks`` (prompt upsampler popped) gives for
``pipe(prompt=..., image=..., height=..., width=..., num_inference_steps=...,
max_sequence_length=..., generator=torch.Generator().manual_seed(seed))`` with the guider
``ClassifierFreeGuidance(guidance_scale=guidance)``, for that request alone (tested at fp64 on gloo
ranks).

Shapes: ``L`` image tokens (``(height / 16) * (width / 16)`` for an 8x VAE and 2x2 patches), ``Lr``
reference tokens, ``C`` / ``Cr`` packed latent channels (128), ``Tt`` text tokens (a multiple of 80
up to ``max_sequence_length``), ``Dj`` text width (8 x Qwen3-VL's: 20,480).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from deepspeed_knap.generation.denoising import Denoising
from deepspeed_knap.generation.generator import Generator
from deepspeed_knap.generation.requests import Request, RequestError
from deepspeed_knap.models.flux.generate import _nearest
from deepspeed_knap.models.flux3.data import flux3_image_ids, flux3_reference_tokens
from deepspeed_knap.models.flux3.flux3 import PackedFlux3Transformer
from deepspeed_knap.models.flux3.spec import FLUX3, TINY_FLUX3


@dataclass
class Flux3Denoising(Denoising):
    """One FLUX.3 request's state (:class:`~deepspeed_knap.generation.denoising.Denoising`):
    ``latents [L, C]`` tokens in the transformer's dtype; each branch holds ``encoder_hidden_states
    [Tt, Dj]`` and ``txt_ids [Tt, 4]`` (the branches' text lengths differ), ``img_ids [L, 4]`` and,
    with references, ``image_cond_hidden_states [Lr, Cr]`` and ``image_cond_ids [Lr, 4]``. The
    packed model predicts the image tokens alone, so every row of a prediction is the noise's.

    Attributes:
        guider: the request's ``ClassifierFreeGuidance``, which combines the branches each step.
        height, width: the image's pixels before any crop.
        reference_crop: the pipeline's per-reference crop boxes to cut the decoded image back to (a
            single reference's, when the request gives no size), or ``None``.
    """

    guider: Any = None
    height: int = 0
    width: int = 0
    reference_crop: list | None = None

    def step_inputs(self, timestep: Tensor) -> dict[str, Tensor]:
        """The pipeline's ``timestep = (t / 1000).to(latents.dtype)``: the flow time in ``[0, 1]``."""
        return {"hidden_states": self.latents, "timestep": (timestep / 1000).to(self.latents.dtype)}

    def combine(self, predictions: list[Tensor], timestep: Tensor) -> Tensor:
        """The guider's prediction at this step (``Flux3LoopDenoiser``: ``set_state``, then the
        guider on the branches' ``[1, L, C]`` predictions)."""
        self.guider.set_state(step=self.step, num_inference_steps=len(self.timesteps), timestep=timestep)
        return self.guider.forward(*(prediction[None] for prediction in predictions)).pred[0]


class Flux3Generator(Generator):
    """FLUX.3 requests: token counts and checks, start (encode, references, noise, scheduler,
    guider), decode, around a ``Flux3ModularPipeline`` of ``Flux3AutoBlocks`` without the prompt
    upsampler (its ``transformer`` may be ``None``) and a
    :class:`~deepspeed_knap.models.flux3.flux3.PackedFlux3Transformer`.

    Raises:
        ValueError: a flow-map (step-distilled) model, which runs through other blocks
            (``Flux3DistilledAutoBlocks``: no guidance, a target timestep per step), a tokenizer
            that is not a processor, or a guider other than ``ClassifierFreeGuidance``.
    """

    spec = FLUX3
    # Flux3LoopDenoiser's guider config; the pipeline's own guider's scale is the default (guidance_scale).
    default_guidance = 3.5
    default_max_sequence_length = 8192  # Flux3TextEncoderStep's max_sequence_length

    def __init__(self, pipeline: Any, model: nn.Module) -> None:
        from diffusers import ClassifierFreeGuidance, SequentialPipelineBlocks
        from diffusers.modular_pipelines.flux3.decoders import Flux3DecodeStep, Flux3UnpackLatentsStep
        from diffusers.modular_pipelines.flux3.encoders import Flux3ProcessImagesInputStep
        from diffusers.modular_pipelines.flux3.modular_blocks_flux3 import Flux3VaeEncoderSequentialStep

        super().__init__(pipeline, model)
        if model.config["flow_map"]:
            raise ValueError("this FLUX.3 transformer is a flow map (step-distilled, flow_map=True): diffusers runs it "
                             "with Flux3DistilledAutoBlocks (no guidance, a target timestep each step), which generate "
                             "does not follow; give the base FLUX.3 checkpoint")  # fmt: skip
        check_flux3_tokenizer(pipeline.tokenizer)
        if type(pipeline.guider) is not ClassifierFreeGuidance:
            raise ValueError(f"the pipeline's guider is a {type(pipeline.guider).__name__}; generate runs FLUX.3's "
                             "ClassifierFreeGuidance (a request's 'guidance' is its scale)")  # fmt: skip
        self.pad_multiple = pipeline.blocks.sub_blocks["text_encoder"].pad_multiple
        # The modular pipeline's own blocks, each run alone per request on the pipeline's components.
        self._prepare_references = blocks_pipeline(Flux3ProcessImagesInputStep(), pipeline)
        self._encode_references = blocks_pipeline(Flux3VaeEncoderSequentialStep(), pipeline)
        self._decoder = blocks_pipeline(SequentialPipelineBlocks.from_blocks_dict(
            {"unpack": Flux3UnpackLatentsStep(), "decode": Flux3DecodeStep()}), pipeline)  # fmt: skip

    @classmethod
    def tiny_config(cls, heads: int, head_dim: int) -> dict[str, Any]:  # four RoPE axes of equal size
        return {**super().tiny_config(heads, head_dim), "axes_dims_rope": (head_dim // 4,) * 4}

    @property
    def patch_pixels(self) -> int:
        """Pixels per latent token along each side: the VAE's scale times the 2x2 patches (16)."""
        return self.pipeline.vae_scale_factor * 2

    def guidance_scale(self, request: Request) -> float:
        """The request's ``guidance``: the classifier-free guidance scale, or the pipeline's guider's."""
        return self.pipeline.guider.guidance_scale if request.guidance is None else request.guidance

    def guider(self, request: Request) -> Any:
        """The request's ``ClassifierFreeGuidance``: the pipeline's, at the request's scale
        (:func:`scaled_guider`)."""
        return scaled_guider(self.pipeline.guider, self.guidance_scale(request))

    @staticmethod
    def guided(guider: Any) -> bool:
        """Whether the unconditional branch runs: ``Flux3ModularPipeline.requires_unconditional_embeds``
        of a guider whose state is unset (every step in its range): enabled, and a scale other than 1
        (0 with ``use_original_formulation``)."""
        return guider._enabled and guider.num_conditions > 1

    def pipeline_options(self, request: Request) -> dict[str, Any]:
        """The negative prompt and the reference images (``guidance`` is the guider's:
        :meth:`run_pipeline`)."""
        options: dict[str, Any] = {}
        if request.negative_prompt is not None:
            options["negative_prompt"] = request.negative_prompt
        if request.image is not None:
            options["image"] = [self.image_file(request, index) for index in range(len(request.image))]
        return options

    def reference_pipeline(self, transformers: Mapping[str, nn.Module]) -> Any:
        """A ``Flux3ModularPipeline`` of the same blocks and parts with diffusers' ``transformers``
        (``{"transformer": ...}``)."""
        pipe = self.pipeline.blocks.init_pipeline()
        parts = {name: part for name, part in self.pipeline.components.items() if part is not None}
        pipe.update_components(**{**parts, **transformers})
        return pipe

    def run_pipeline(self, pipe: Any, request: Request) -> Any:
        """``pipe`` with the request's guider drawing it alone: its images, ``output_type="np"``."""
        pipe.update_components(guider=self.guider(request))
        return pipe(**self.pipeline_call(request), output_type="np", output="images")

    def request_seq_lens(self, request: Request) -> tuple[int, ...]:
        """Text + image + reference tokens of each sequence ``request`` runs per step (two with
        classifier-free guidance, each of its own text length): what the planner balances. The
        prompt is tokenised here, as the text encoder step pads it.

        Raises:
            RequestError: a key FLUX.3 does not take (``embeddings``: the pipeline encodes its
                prompt itself; ``frames``, ``true_cfg_scale``, ``guidance_2``), a ``negative_prompt``
                at guidance 1, a size that is not a multiple of the token (the pipeline refuses
                it), a ``max_sequence_length`` over the text encoder's positions, a reference image
                that is unreadable or that the pipeline cannot prepare.
        """
        line, name = request.line, self.name
        if request.embeddings is not None:
            raise RequestError(f"line {line}: {name}'s pipeline encodes its prompt itself (the text's length is the "
                               f"prompt's, padded to a multiple of {self.pad_multiple} tokens): give 'prompt', not "
                               "'embeddings'")  # fmt: skip
        if request.frames is not None:
            raise RequestError(f"line {line}: {name} makes images: drop 'frames'")
        if request.true_cfg_scale is not None:
            raise RequestError(f"line {line}: {name}'s 'guidance' is its classifier-free guidance scale (default "
                               f"{self.guidance_scale(request)}): drop 'true_cfg_scale'")  # fmt: skip
        if request.guidance_2 is not None:
            raise RequestError(f"line {line}: 'guidance_2' is a two-expert Wan pipeline's; {name} takes 'guidance': "
                               "drop 'guidance_2'")  # fmt: skip
        guided, scale = self.guided(self.guider(request)), self.guidance_scale(request)
        if request.negative_prompt is not None and not guided:
            raise RequestError(f"line {line}: 'negative_prompt' does nothing at guidance {scale} (the guider runs no "
                               "unconditional branch at 1); drop it or change 'guidance'")  # fmt: skip
        length = self.max_sequence_length(request)
        most = self.pipeline.text_encoder.config.text_config.max_position_embeddings
        if length > most:
            raise RequestError(f"line {line}: max_sequence_length {length} is over the text encoder's {most} "
                               "positions")  # fmt: skip
        grids, crops = self._reference_grids(request)
        height, width, _ = self._size(request, grids, crops)
        patch = self.patch_pixels
        if height % patch or width % patch:
            fit = f"{_nearest(height, patch)}x{_nearest(width, patch)}"
            raise RequestError(f"line {line}: {height}x{width} px: {name}'s VAE ({patch // 2}x) and 2x2 patches need "
                               f"height and width in multiples of {patch} px (the pipeline refuses others); e.g. "
                               f"{fit}")  # fmt: skip
        visual = (height // patch) * (width // patch) + sum(h * w for h, w in grids)
        texts = [request.prompt] + ([request.negative_prompt or ""] if guided else [])
        return tuple(self.text_length(text, length) + visual for text in texts)

    def text_length(self, prompt: str, max_sequence_length: int) -> int:
        """The rows ``Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds`` gives ``prompt``: its
        chat-templated tokens (truncated at ``max_sequence_length``) rounded up to the pad multiple,
        at most ``max_sequence_length``. Tokenises only (no text encoder)."""
        tokenizer = self.pipeline.tokenizer
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        real = len(tokenizer.tokenizer(text, truncation=True, max_length=max_sequence_length)["input_ids"])
        return min(math.ceil(real / self.pad_multiple) * self.pad_multiple, max_sequence_length)

    def _reference_images(self, request: Request) -> list[Any]:
        """The request's reference images (PIL), read.

        Raises:
            RequestError: an unreadable image, or with several references one smaller than the
                16 px grid the pipeline crops each to (it would crop it to nothing).
        """
        images = [self.image_file(request, index) for index in range(len(request.image))]
        problem = reference_problem(request.image, images, self.pipeline.image_processor.config.vae_scale_factor)
        if problem:
            raise RequestError(f"line {request.line}: {problem}")
        return images

    def _reference_grids(self, request: Request) -> tuple[list[tuple[int, int]], list | None]:
        """``(height, width)`` in latent tokens of each reference as ``Flux3ProcessImagesInputStep``
        prepares it, and its ``reference_crop`` boxes; ``([], None)`` without references.

        Raises:
            RequestError: as :meth:`_reference_images`, or the pipeline's preprocessing failed (naming it).
        """
        if request.image is None:
            return [], None
        images = self._reference_images(request)
        try:
            prepared = self._prepare_references(image=images, output=["condition_images", "reference_crop"])
        except Exception as error:  # PIL's and torch's own types
            raise RequestError(f"line {request.line}: {self.name}'s pipeline cannot prepare the images "
                               f"{list(request.image)}: {type(error).__name__}: {error}") from None  # fmt: skip
        patch = self.patch_pixels
        grids = [(image.shape[-2] // patch, image.shape[-1] // patch) for image in prepared["condition_images"]]
        return grids, prepared["reference_crop"]

    def _size(self, request: Request, grids: list[tuple[int, int]], crops: list | None) -> tuple[int, int, list | None]:
        """``(height, width, reference_crop)`` as ``Flux3ImageCondInputStep`` sets them: a side not
        given is the first reference's (its prepared size); the crop-back only when neither is."""
        if not grids:
            return request.height, request.width, None
        (rows, columns), patch = grids[0], self.patch_pixels
        crop = crops if request.height is None and request.width is None else None
        return request.height or rows * patch, request.width or columns * patch, crop

    @torch.no_grad()
    def start(self, request: Request) -> Flux3Denoising:
        """Encode the prompt (and with guidance the negative one) and the reference images, draw the
        seeded noise, set the request's own scheduler and guider, as ``Flux3AutoBlocks`` does for
        the request alone."""
        from diffusers.modular_pipelines.flux3.before_denoise import retrieve_timesteps
        from diffusers.utils.torch_utils import randn_tensor

        pipe, device, dtype = self.pipeline, self.device, self.dtype
        guider = self.guider(request)
        texts = [request.prompt] + ([request.negative_prompt or ""] if self.guided(guider) else [])
        branches = [self._encode(text, self.max_sequence_length(request)) for text in texts]
        shared: dict[str, Tensor] = {}
        grids, crops = [], None
        if request.image is not None:
            encoded = self._encode_references(image=self._reference_images(request),
                                              output=["image_cond_latents", "reference_crop"])  # fmt: skip
            latents = encoded["image_cond_latents"]  # [1, Cr, h_i, w_i] each
            grids, crops = [tuple(reference.shape[-2:]) for reference in latents], encoded["reference_crop"]
            tokens, ids = flux3_reference_tokens(latents)
            shared["image_cond_hidden_states"], shared["image_cond_ids"] = tokens.to(device, dtype), ids.to(device)
        height, width, crop = self._size(request, grids, crops)
        rows, columns = height // self.patch_pixels, width // self.patch_pixels
        shape = (1, self.model.config["in_channels"], rows, columns)
        # Drawn in float32, then cast, as the pipeline does (a draw in another dtype is other noise).
        noise = randn_tensor(shape, generator=torch.Generator().manual_seed(request.seed), device=device,
                             dtype=torch.float32).to(dtype)  # fmt: skip
        shared["img_ids"] = flux3_image_ids(rows, columns).to(device)
        scheduler = copy.deepcopy(pipe.scheduler)
        steps = request.steps
        timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=np.linspace(1.0, 1 / steps, steps))
        scheduler.set_begin_index(0)
        branches = [{**branch, **shared} for branch in branches]
        scale = guider.guidance_scale if len(branches) == 2 else None
        return Flux3Denoising(request, noise[0].flatten(1).T, scheduler, timesteps, branches, scale, guider=guider,
                              height=height, width=width, reference_crop=crop)  # fmt: skip

    def _encode(self, prompt: str, max_sequence_length: int) -> dict[str, Tensor]:
        """One branch's ``encoder_hidden_states [Tt, Dj]`` (the transformer's dtype, as
        ``Flux3TextInputStep`` casts them) and ``txt_ids [Tt, 4]`` (:func:`encode_flux3_prompt`)."""
        embeds, text_ids = encode_flux3_prompt(self.pipeline, prompt, max_sequence_length, self.device)
        return {"encoder_hidden_states": embeds.to(self.dtype), "txt_ids": text_ids.to(self.device)}

    @torch.no_grad()
    def decode(self, state: Flux3Denoising) -> np.ndarray:
        """``[height, width, 3]`` float image in ``[0, 1]`` (a single reference's size when cropped
        back): ``Flux3UnpackLatentsStep`` and ``Flux3DecodeStep`` (``output_type="np"``)."""
        images = self._decoder(latents=state.latents[None], height=state.height, width=state.width,
                               reference_crop=state.reference_crop, output_type="np", output="images")  # fmt: skip
        return images[0]

    @classmethod
    def tiny(cls, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
             config: Mapping[str, Any] | None = None) -> Flux3Generator:  # fmt: skip
        """A tiny random FLUX.3 (:func:`tiny_flux3_generator`)."""
        return tiny_flux3_generator(dtype, device, seed, config)

    @classmethod
    def load(cls, model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> Flux3Generator:
        """A FLUX.3 modular pipeline folder (:func:`load_flux3_generator`)."""
        return load_flux3_generator(model_path, dtype, device)


def flux3_blocks() -> Any:
    """``Flux3AutoBlocks`` without the prompt upsampler: the prompt is encoded as given (the
    upsampler, a Qwen3.5 that rewrites it, is not run)."""
    from diffusers.modular_pipelines import Flux3AutoBlocks

    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    return blocks


def blocks_pipeline(blocks: Any, pipeline: Any) -> Any:
    """A ``Flux3ModularPipeline`` of ``blocks`` (one step of the modular pipeline, or a few) with
    ``pipeline``'s components, to run that step alone."""
    from diffusers.modular_pipelines import Flux3ModularPipeline

    pipe = Flux3ModularPipeline(blocks=blocks)
    pipe.update_components(**{name: getattr(pipeline, name) for name in pipe.component_names})
    return pipe


def scaled_guider(guider: Any, scale: float) -> Any:
    """A copy of the pipeline's ``ClassifierFreeGuidance`` at ``scale``: a copy whose scale is set,
    not ``guider.new(...)``, which prints diffusers' experimental-feature warning each time."""
    guider = copy.deepcopy(guider)
    guider.guidance_scale = scale
    return guider


def encode_flux3_prompt(pipeline: Any, prompt: str, max_sequence_length: int,
                        device: torch.device | str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(encoder_hidden_states [Tt, Dj], txt_ids [Tt, 4])`` of ``prompt`` by the text encoder step's
    helpers (``Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds`` at the step's pad multiple, in the
    text encoder's dtype; ``Flux3TextRoPEInputsStep._prepare_text_ids``, float32 on the host)."""
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    pad_multiple = pipeline.blocks.sub_blocks["text_encoder"].pad_multiple
    embeds = Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
        pipeline.text_encoder, pipeline.tokenizer, prompt, device, max_sequence_length=max_sequence_length,
        pad_multiple=pad_multiple)  # fmt: skip
    return embeds[0], Flux3TextRoPEInputsStep._prepare_text_ids(embeds)


def reference_problem(names: list[str], images: list[Any], grid: int) -> str | None:
    """What the modular pipeline cannot take of these reference images (PIL, named by ``names``),
    or ``None``: with several, one smaller than the ``grid`` (the image processor's, 16 px) the
    pipeline crops each to (it would crop it to nothing). One alone is padded, whatever its size."""
    for name, image in zip(names, images, strict=True):
        if len(images) > 1 and min(image.size) < grid:
            return (f"image {name} is {image.width}x{image.height} px: with several references FLUX.3's pipeline "
                    f"crops each to its {grid} px grid; give images of at least {grid} px a side")  # fmt: skip
    return None


def check_flux3_tokenizer(tokenizer: Any) -> None:
    """Raises ``ValueError`` unless ``tokenizer`` is what ``Flux3TextEncoderStep`` takes: a Qwen3-VL
    processor (it tokenises with the processor's ``.tokenizer``)."""
    if not hasattr(tokenizer, "tokenizer"):  # AutoProcessor gives a folder's tokenizer alone without one
        raise ValueError(f"the pipeline's tokenizer is a {type(tokenizer).__name__}; FLUX.3's text encoder step "
                         "takes a Qwen3-VL processor (it tokenises with the processor's .tokenizer): give a "
                         "tokenizer/ folder AutoProcessor loads as one (transformers builds Qwen3-VL's processor "
                         "only with torchvision installed)")  # fmt: skip


def load_flux3_pipeline(model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> Any:
    """The parts of a FLUX.3 modular pipeline folder (``modular_model_index.json`` or
    ``model_index.json``, ``text_encoder/``, ``tokenizer/``, ``vae/``) but the transformer: a
    pipeline of :func:`flux3_blocks` (``init_pipeline(model_path)``, ``load_components``) in
    ``dtype`` on ``device``, its ``transformer`` ``None``; the scheduler and guider are the folder's
    where it has them, else the blocks' defaults.

    Raises:
        ValueError: a part the folder does not give (naming it), a tokenizer that is not a processor.
    """
    pipe = flux3_blocks().init_pipeline(model_path)
    names = [name for name in pipe.pretrained_component_names if name != "transformer"]
    pipe.load_components(names=names, dtype=dtype)  # diffusers drops it for the tokenizer and configs
    missing = [name for name in ("text_encoder", "tokenizer", "vae", "scheduler", "guider", "image_processor")
               if getattr(pipe, name, None) is None]  # fmt: skip
    if missing:
        raise ValueError(f"{model_path}: the FLUX.3 modular pipeline could not load {missing}; give a folder with "
                         "them (subfolders named in its modular_model_index.json or model_index.json)")  # fmt: skip
    check_flux3_tokenizer(pipe.tokenizer)
    return pipe.to(device)


def load_flux3_generator(model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> Flux3Generator:
    """A FLUX.3 modular pipeline folder (``transformer/`` too) as a :class:`Flux3Generator`: the
    transformer packed, the rest loaded by the modular pipeline (:func:`load_flux3_pipeline`), in
    ``dtype``.

    Raises:
        ValueError: as :func:`load_flux3_pipeline`, a flow-map checkpoint.
    """
    pipe = load_flux3_pipeline(model_path, dtype, device)
    model = PackedFlux3Transformer.from_pretrained(model_path, torch_dtype=dtype).to(device).eval()
    return Flux3Generator(pipe, model)


class TokenizerProcessor:
    """What ``Flux3TextEncoderStep`` uses of its ``tokenizer`` component (a Qwen3-VL processor): its
    ``tokenizer`` and its chat template. The tiny pipeline's, so that no image processor (which
    needs torchvision) is built."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def tiny_flux3_pipeline_components(config: Mapping[str, Any], seed: int = 0) -> dict[str, Any]:
    """Small random parts that fit a packed FLUX.3 ``config``, built locally with no download: a
    character tokenizer with Qwen's chat markers (:class:`TokenizerProcessor`), a 32-layer Qwen3-VL
    text encoder of width ``joint_attention_dim / 8`` (the step stacks its hidden states 4, 8, ...,
    32), an ``AutoencoderKLFlux2`` of ``in_channels / 4`` latent channels (2x: a token is 4x4 px)
    with random batch-norm statistics, so that the normalisation shows.

    Raises:
        ValueError: a config these parts cannot fit.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from deepspeed_knap.models.flux.finetune import tiny_flux2_vae

    if config["in_channels"] % 4 or config["cond_in_channels"] != config["in_channels"]:
        raise ValueError(f"in_channels={config['in_channels']} must be 4 x the VAE's latent channels (2x2 patches) "
                         f"and cond_in_channels={config['cond_in_channels']} the same (references are VAE latents "
                         "too)")  # fmt: skip
    if config["joint_attention_dim"] % 16:
        raise ValueError(f"joint_attention_dim={config['joint_attention_dim']} must be 8 stacked hidden states of an "
                         "even width (two attention heads)")  # fmt: skip
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate([*specials, "<unk>", *map(chr, range(32, 127)), "\n"])}
    characters = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    characters.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=characters, pad_token=specials[0], unk_token="<unk>",
                                        additional_special_tokens=specials[1:], model_max_length=8192)  # fmt: skip
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
                               "\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
    torch.manual_seed(seed)
    width = config["joint_attention_dim"] // 8
    rope = {"rope_type": "default", "mrope_section": [width // 4, 0, 0], "mrope_interleaved": True}
    text = dict(vocab_size=len(vocab), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=32,
                num_attention_heads=2, num_key_value_heads=1, head_dim=width // 2, rope_scaling=rope)  # fmt: skip
    vision = dict(depth=1, hidden_size=8, intermediate_size=8, num_heads=1, out_hidden_size=width,
                  deepstack_visual_indexes=[])  # fmt: skip
    text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision))
    vae = tiny_flux2_vae(config["in_channels"] // 4)
    return {"text_encoder": text_encoder.eval(), "tokenizer": TokenizerProcessor(tokenizer), "vae": vae}


def tiny_flux3_generator(dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                         config: Mapping[str, Any] | None = None) -> Flux3Generator:  # fmt: skip
    """A tiny random FLUX.3 (``TINY_FLUX3`` or ``config``) with :func:`tiny_flux3_pipeline_components`
    in a pipeline of :func:`flux3_blocks` (its scheduler and guider the blocks' defaults), the same
    on every rank for a ``seed``: for CPU runs, tests and benchmarks without downloaded weights."""
    config = dict(TINY_FLUX3 if config is None else config)
    pipe = flux3_blocks().init_pipeline()
    pipe.update_components(**tiny_flux3_pipeline_components(config, seed))
    pipe.to(device, dtype)
    torch.manual_seed(seed)
    model = PackedFlux3Transformer(**config).to(device, dtype).eval()
    return Flux3Generator(pipe, model)
