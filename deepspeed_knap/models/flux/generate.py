"""FLUX.1 and FLUX.2 generation, request by request, around diffusers' own ``FluxPipeline``,
``Flux2Pipeline`` and ``Flux2KleinPipeline`` parts.

The packed transformer runs the requests of every rank together (balanced by
:mod:`deepspeed_knap.generation`); everything else is the pipeline's own code, called per request on
its home rank: ``encode_prompt`` (CLIP pooled + T5), ``prepare_latents`` (the seeded noise and
position ids), a ``FlowMatchEulerDiscreteScheduler`` of the pipeline's config per request with the
resolution-dependent shift ``mu = calculate_shift(image tokens, ...)`` and the sigmas
``linspace(1, 1/steps, steps)`` as ``FluxPipeline.__call__`` sets them, and the VAE decode and
post-processing. So an image equals what ``FluxPipeline(...)(prompt, height=..., width=...,
num_inference_steps=..., guidance_scale=..., generator=torch.Generator().manual_seed(seed))`` gives
for that request alone (tested at fp64 on gloo ranks).

FLUX.2 (:class:`Flux2Generator`) the same way around ``Flux2Pipeline``: ``encode_prompt`` (the Mistral
text encoder's stacked hidden states, position ids ``(0, 0, 0, l)``), ``prepare_latents`` (the noise
already in 2x2 patches, ids ``(0, h, w, 0)``), the shift ``mu = compute_empirical_mu(image tokens,
steps)``, and the decode: the latents un-normalised by the VAE's batch-norm statistics, unpatchified
and decoded; a request's reference images (an edit: ``Flux2Pipeline(image=...)``) as the pipeline
prepares them (``prepare_image_latents``), their tokens after the noise's in the sequence. Both
families are guidance-distilled: the guidance scale goes into the transformer.

FLUX.2 [klein] (:class:`Flux2KleinGenerator`) around ``Flux2KleinPipeline``: FLUX.2's noise,
references, shift and decode, the klein pipeline's ``encode_prompt`` (Qwen3's stacked hidden
states), and classifier-free guidance instead of an embedded scale: above guidance 1 the
unconditional branch (the text ``""``) is a second sequence, unless the checkpoint is step-distilled.

Shapes: ``L`` image tokens (``(height / 16) * (width / 16)`` for an 8x VAE and 2x2 patches), ``C``
packed latent channels (FLUX.1: 64, FLUX.2: 128), ``Tt`` text tokens (``Tn`` the unconditional
branch's where they differ), ``Dj`` text width (T5's; FLUX.2: 3 x Mistral's, [klein] 3 x Qwen3's),
``Dp`` CLIP width (FLUX.1 only).
"""

from __future__ import annotations

import copy
import dataclasses
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
from deepspeed_knap.models.flux.spec import FLUX1, FLUX2, TINY_FLUX, TINY_FLUX2, TINY_FLUX2_KLEIN
from deepspeed_knap.models.loading import pipeline_index

MAX_SEQUENCE_LENGTH = 512  # FluxPipeline refuses a larger max_sequence_length (it truncates prompts)


@dataclass
class FluxDenoising(Denoising):
    """One FLUX request's state (:class:`~deepspeed_knap.generation.denoising.Denoising`):
    ``latents [L, C]`` packed; each branch holds ``encoder_hidden_states [Tt, Dj]``, ``img_ids
    [L + Lr, A]``, ``txt_ids [Tt, A]`` (``A`` position axes: FLUX.1 3, FLUX.2 4), ``guidance`` and
    FLUX.1's ``pooled_projections [Dp]``. ``reference [Lr, C]``: FLUX.2's reference images' packed
    latents, put after the noise every step (their ids after the noise's), or ``None``."""

    reference: Tensor | None = None

    def step_inputs(self, timestep: Tensor) -> dict[str, Tensor]:
        """The pipeline's ``timestep = t.to(latents.dtype) / 1000`` and, with references,
        ``cat([latents, reference])``."""
        hidden = self.latents
        if self.reference is not None:
            hidden = torch.cat([self.latents, self.reference.to(self.latents.dtype)])
        return {"hidden_states": hidden, "timestep": timestep.to(self.latents.dtype) / 1000}

    def target_rows(self, prediction: Tensor) -> Tensor:
        """The noise's rows (``Flux2Pipeline`` keeps ``noise_pred[:, :L]``)."""
        return prediction[: len(self.latents)]

    def for_decode(self) -> FluxDenoising:
        """Without the scheduler and the branches but the conditional one's ``img_ids`` (FLUX.2's
        decode unpacks the latents by them)."""
        return dataclasses.replace(self, scheduler=None, branches=[{"img_ids": self.branches[0]["img_ids"]}])


class FluxGenerator(Generator):
    """FLUX.1 requests: token counts and checks, start (encode, noise, scheduler), decode, around a
    diffusers ``FluxPipeline`` (:class:`~deepspeed_knap.generation.generator.Generator`'s arguments)."""

    spec = FLUX1
    pipeline_class = FLUX1.pipeline  # the diffusers pipeline of a directory this generator runs (model_index.json)
    tiny_transformer = TINY_FLUX  # the tiny random model's config (tiny)
    default_guidance = 3.5  # FluxPipeline's guidance_scale
    default_steps = 28  # its num_inference_steps
    pipeline_embeddings = ("prompt_embeds", "pooled_prompt_embeds", "negative_prompt_embeds",
                           "negative_pooled_prompt_embeds")  # fmt: skip

    @classmethod
    def tiny_config(cls, heads: int, head_dim: int) -> dict[str, Any]:
        return {**super().tiny_config(heads, head_dim), "axes_dims_rope": rope_axes(head_dim)}

    def pipeline_options(self, request: Request) -> dict[str, Any]:
        options = super().pipeline_options(request)
        if request.true_cfg_scale is not None:
            options.update(true_cfg_scale=request.true_cfg_scale, negative_prompt=request.negative_prompt)
        return options

    takes_references = False  # FLUX.2's pipeline takes reference images (a request's "image")

    def _reference_grids(self, request: Request) -> list[tuple[int, int]]:
        """``(height, width)`` in latent tokens of each reference image the request names, as the
        pipeline prepares them; none here (:class:`Flux2Generator` takes them)."""
        return []

    @property
    def patch_pixels(self) -> int:
        """Pixels per latent token along each side: the VAE's scale times the 2x2 patches."""
        return self.pipeline.vae_scale_factor * 2

    def request_seq_lens(self, request: Request) -> tuple[int, ...]:
        """Text + image tokens (FLUX.2's reference images' too) of each sequence ``request`` runs per
        step (two with true CFG): what the planner balances.

        Raises:
            RequestError: a size the VAE and the patching cannot take (the pipeline would silently
                resize it), a ``max_sequence_length`` over T5's 512 (a longer prompt is truncated, as
                diffusers does), an embeddings file that is unreadable or does not fit the model,
                a key the family does not take (``frames``, ``image``, ``guidance_2``; FLUX.2's
                ``negative_prompt``), guidance
                keys that would be ignored.
        """
        branches = self._branches(request)
        self.check_size_given(request)
        patch, line = self.patch_pixels, request.line
        if request.height % patch or request.width % patch:
            fit = f"{_nearest(request.height, patch)}x{_nearest(request.width, patch)}"
            raise RequestError(f"line {line}: {request.height}x{request.width} px: {self.name}'s VAE ({patch // 2}x) "
                               f"and 2x2 patches need height and width in multiples of {patch} px; e.g. {fit}")  # fmt: skip
        grid, most = (request.height // patch, request.width // patch), self.position_extent
        if most is not None and max(grid) > most:
            raise RequestError(f"line {line}: {request.height}x{request.width} px is {grid[0]}x{grid[1]} latent "
                               f"patches: {self.name}'s image positions are {str(self.dtype).removeprefix('torch.')} "
                               f"(as {type(self.pipeline).__name__} makes them), exact up to {most} a side; make it at "
                               f"most {most * patch} px a side")  # fmt: skip
        image_tokens = grid[0] * grid[1] + sum(height * width for height, width in self._reference_grids(request))
        return tuple(text + image_tokens for text in self._text_tokens(request, branches))

    def _text_tokens(self, request: Request, branches: int) -> tuple[int, ...]:
        """Text tokens of each of the request's ``branches``: the embeddings file's rows of each text
        it gives (:meth:`_embedding_rows`); a prompt, or a branch's text the file does not give
        (FLUX.2 [klein]'s unconditional ``""``), padded to ``max_sequence_length``.

        Raises:
            RequestError: a ``max_sequence_length`` past the text encoder's positions, an embeddings
                file that does not fit.
        """
        given = () if request.embeddings is None else self._embedding_rows(request, branches)
        if len(given) == branches:
            return given
        most, encoder, length = *self.text_positions, self.max_sequence_length(request)
        if length > most:
            raise RequestError(f"line {request.line}: max_sequence_length {length} is over {encoder}'s "
                               f"{most} that {type(self.pipeline).__name__} takes")  # fmt: skip
        return given + (length,) * (branches - len(given))

    def _check_keys(self, request: Request) -> None:
        """Refuse the keys no FLUX.1 or FLUX.2 pipeline takes: ``frames``, ``guidance_2``, and
        ``image`` where the pipeline takes no reference images."""
        line, name = request.line, self.name
        if request.frames is not None:
            raise RequestError(f"line {line}: {name} makes images: drop 'frames'")
        if request.image is not None and not self.takes_references:
            raise RequestError(f"line {line}: {name} generates from text alone here: drop 'image'")
        if request.guidance_2 is not None:
            raise RequestError(f"line {line}: 'guidance_2' is a two-expert Wan pipeline's; {name} takes 'guidance': "
                               "drop 'guidance_2'")  # fmt: skip

    def _branches(self, request: Request) -> int:
        """Sequences per step: 2 with true classifier-free guidance (``true_cfg_scale`` above 1 and a
        negative prompt, as ``FluxPipeline`` runs it), else 1. Refuses what would be ignored."""
        self._check_keys(request)
        line, name, scale = request.line, self.name, request.true_cfg_scale
        if request.guidance is not None and not self.embeds_guidance:
            raise RequestError(f"line {line}: this {name} transformer has no guidance embedding (as FLUX.1 [schnell]): "
                               f"{type(self.pipeline).__name__} ignores 'guidance'; drop it")  # fmt: skip
        guided = scale is not None and scale > 1
        # With embeddings the negative branch is the file's: there when the scale asks for it.
        negative = request.negative_prompt is not None or (request.embeddings is not None and guided)
        if not self.true_cfg and (request.negative_prompt is not None or scale is not None):
            raise RequestError(f"line {line}: {name} is guidance-distilled: its 'guidance' goes into the transformer and "
                               f"{type(self.pipeline).__name__} takes no negative prompt; drop 'negative_prompt' and "
                               "'true_cfg_scale'")  # fmt: skip
        if guided != negative:
            raise RequestError(f"line {line}: true classifier-free guidance needs both 'true_cfg_scale' above 1 and a "
                               f"negative prompt ('negative_prompt', or the embeddings file's negative_prompt_embeds); "
                               f"got true_cfg_scale {scale} and negative_prompt {request.negative_prompt!r}: "
                               f"{type(self.pipeline).__name__} would ignore the one given")  # fmt: skip
        return 2 if negative else 1

    @property
    def true_cfg(self) -> bool:
        """Whether the family's pipeline runs true classifier-free guidance (``true_cfg_scale``)."""
        return True

    def cfg_scale(self, request: Request) -> float:
        """The scale of the request's classifier-free guidance (when it runs two branches):
        ``FluxPipeline``'s ``true_cfg_scale``."""
        return request.true_cfg_scale

    @property
    def embeds_guidance(self) -> bool:
        """Whether the pipeline gives the transformer the guidance scale (``guidance``): FLUX.1 and
        FLUX.2 [dev] do where their transformer has a guidance embedding."""
        return bool(self.model.config["guidance_embeds"])

    @property
    def position_extent(self) -> int | None:
        """The most latent patches a side of an image may have, or ``None``: FLUX.1's pipeline makes
        the image position ids in the model's dtype (``prepare_latents``), whose whole numbers are
        exact up to ``2 ** (mantissa bits + 1)`` (bfloat16: 256, 4,096 px; float16: 2,048): past it
        two rows would share a position. FLUX.1 was trained up to about 2 megapixels."""
        return int(2 / torch.finfo(self.dtype).eps)  # eps = 2 ** -(mantissa bits)

    @property
    def text_positions(self) -> tuple[int, str]:
        """The longest ``max_sequence_length`` a prompt may be padded to, and the text encoder's name."""
        return MAX_SEQUENCE_LENGTH, "T5"

    def _embeddings_shapes(self, tensors: Mapping[str, Tensor], branches: int) -> dict[str, tuple[int | str, ...]]:
        """The tensors an embeddings file of ``tensors`` must hold for ``branches`` and their shapes, a
        text's rows by name (``"Tt"``: any number, the same wherever it is named): with true CFG the
        negative ones too, of the same shapes (``FluxPipeline`` requires it)."""
        config = self.model.config
        shapes = {"prompt_embeds": ("Tt", config["joint_attention_dim"]),
                  "pooled_prompt_embeds": (config["pooled_projection_dim"],)}  # fmt: skip
        if branches == 2:
            shapes.update({f"negative_{key}": shape for key, shape in shapes.items()})
        return shapes

    def _embedding_rows(self, request: Request, branches: int) -> tuple[int, ...]:
        """The rows of each text a request's embeddings file gives its ``branches``, in their order
        (``prompt_embeds``', then ``negative_prompt_embeds``' where taken), checked against the model.

        Raises:
            RequestError: a tensor missing or of another shape, a text of no rows, values no text
                encoder gives; naming the line and the file.
        """
        tensors = self.embeddings_file(request)
        wanted = self._embeddings_shapes(tensors, branches)
        expected = {key: "[" + ", ".join(map(str, shape)) + "]" for key, shape in wanted.items()}
        shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
        named: dict[str, set[int]] = {}  # each named size: the sizes found for it
        fits = all(len(shapes.get(key, ())) == len(shape) for key, shape in wanted.items())
        for key, shape in wanted.items() if fits else ():
            for want, size in zip(shape, shapes[key], strict=True):
                if isinstance(want, str):
                    named.setdefault(want, set()).add(size)
                else:
                    fits = fits and want == size
        rows = dict.fromkeys(d for shape in wanted.values() for d in shape if isinstance(d, str))  # in order
        # One size per name, and a text of at least one row: with none there is nothing to condition on.
        if not fits or any(len(sizes) != 1 or min(sizes) < 1 for sizes in named.values()):
            raise RequestError(f"line {request.line}: embeddings {request.embeddings} hold {shapes}; this model takes "
                               f"{expected}, {', '.join(f'{name} >= 1' for name in rows)} (one prompt, unbatched; a "
                               "size named twice the same)")  # fmt: skip
        self.check_embedding_values(request, tensors, list(wanted))
        return tuple(shapes[key][0] for key in ("prompt_embeds", "negative_prompt_embeds") if key in wanted)

    @torch.no_grad()
    def start(self, request: Request) -> FluxDenoising:
        """Encode the prompt (or read the embeddings), draw the seeded noise and set the request's
        own scheduler, as the pipeline's ``__call__`` does for it alone."""
        from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

        pipe, device = self.pipeline, self.device
        guided = self._branches(request) == 2  # FLUX.1: true_cfg_scale 1 or below is off, as in FluxPipeline
        branches = [self._encode(request)]
        if guided:
            branches.append(self._encode(request, negative=True))
        generator = torch.Generator().manual_seed(request.seed)
        latents, img_ids = pipe.prepare_latents(1, self.model.config["in_channels"] // 4, request.height, request.width,
                                                branches[0]["encoder_hidden_states"].dtype, device, generator)  # fmt: skip
        latents, steps = latents[0], request.steps
        sigmas = None if pipe.scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        scheduler = copy.deepcopy(pipe.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=self._shift(len(latents), steps))
        scheduler.set_begin_index(0)
        shared = {"img_ids": img_ids.reshape(len(latents), -1)}  # FLUX.2's come batched
        reference = self._reference_latents(request, generator)
        if reference is not None:
            reference, reference_ids = reference
            shared["img_ids"] = torch.cat([shared["img_ids"], reference_ids.to(shared["img_ids"])])
        if self.embeds_guidance:
            # The pipeline's float32 guidance, in the latents' dtype as every rank packs it (an empty
            # rank's columns are all in the model's dtype); the model casts it to that dtype anyway.
            guidance = torch.tensor(self.guidance_scale(request), dtype=torch.float32, device=device)
            shared["guidance"] = guidance.to(latents.dtype)
        branches = [{**branch, **shared} for branch in branches]
        return FluxDenoising(request, latents, scheduler, timesteps, branches,
                             self.cfg_scale(request) if guided else None, reference=reference)  # fmt: skip

    def _reference_latents(self, request: Request, generator: torch.Generator) -> tuple[Tensor, Tensor] | None:
        """``(reference [Lr, C], ids [Lr, A])`` of the request's reference images, or ``None``."""
        return None

    def _encode(self, request: Request, negative: bool = False) -> dict[str, Tensor]:
        """The text conditioning of one branch: ``encoder_hidden_states``, ``txt_ids`` and
        ``pooled_projections``, from ``encode_prompt`` or the embeddings file (``negative``: of the
        negative prompt)."""
        pipe, device = self.pipeline, self.device
        if request.prompt is not None:
            prompt = request.negative_prompt if negative else request.prompt
            text, pooled, text_ids = pipe.encode_prompt(prompt=prompt, prompt_2=None, device=device,
                                                        max_sequence_length=self.max_sequence_length(request))  # fmt: skip
        else:
            saved, prefix = self.embeddings_file(request), "negative_" if negative else ""
            text = saved[f"{prefix}prompt_embeds"][None].to(device, self.dtype)
            pooled = saved[f"{prefix}pooled_prompt_embeds"][None].to(device, self.dtype)
            text_ids = torch.zeros(text.shape[1], 3, device=device, dtype=self.dtype)
        return {"encoder_hidden_states": text[0], "pooled_projections": pooled[0], "txt_ids": text_ids}

    def _shift(self, image_tokens: int, steps: int) -> float:
        """``mu`` of the scheduler's resolution-dependent shift: ``FluxPipeline``'s ``calculate_shift``
        from the scheduler's config."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipeline.scheduler.config
        return calculate_shift(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                               config.get("base_shift", 0.5), config.get("max_shift", 1.15))  # fmt: skip

    @torch.no_grad()
    def decode(self, state: FluxDenoising) -> np.ndarray:
        """``[height, width, 3]`` float image in ``[0, 1]``: the pipeline's unpacking, VAE decode and
        post-processing (``output_type="np"``)."""
        pipe, request = self.pipeline, state.request
        latents = pipe._unpack_latents(state.latents[None], request.height, request.width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")[0]

    @classmethod
    def tiny(cls, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
             config: Mapping[str, Any] | None = None) -> FluxGenerator:  # fmt: skip
        """A tiny random generator of this pipeline (:attr:`tiny_transformer` or ``config``, and
        :meth:`tiny_components`), the same on every rank for a ``seed``: for CPU runs, tests and
        benchmarks without downloaded weights."""
        import diffusers

        config = dict(cls.tiny_transformer if config is None else config)
        pipeline = getattr(diffusers, cls.pipeline_class)(**cls.tiny_components(config, seed), transformer=None)
        torch.manual_seed(seed)
        model = cls.spec.model_class(**config).to(device, dtype).eval()
        return cls(pipeline.to(device, dtype), model)

    @classmethod
    def tiny_components(cls, config: Mapping[str, Any], seed: int) -> dict[str, Any]:
        """The pipeline's tiny parts but the transformer:
        :func:`~deepspeed_knap.models.flux.finetune.tiny_pipeline_components`."""
        from deepspeed_knap.models.flux.finetune import tiny_pipeline_components

        return tiny_pipeline_components(config, seed)

    @classmethod
    def load(cls, model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> FluxGenerator:
        """A pipeline directory of this family (:func:`load_flux_generator`)."""
        return load_flux_generator(model_path, dtype, device)


class Flux2Generator(FluxGenerator):
    """FLUX.2 requests, around a diffusers ``Flux2Pipeline`` (its ``transformer`` may be ``None``) and
    a :class:`~deepspeed_knap.models.flux.flux2.PackedFlux2Transformer`. An embeddings file holds
    ``prompt_embeds [Tt, Dj]`` alone (FLUX.2 has no pooled text)."""

    spec = FLUX2
    pipeline_class = FLUX2.pipeline
    tiny_transformer = TINY_FLUX2
    default_guidance = 4.0  # Flux2Pipeline's guidance_scale
    default_steps = 50  # its num_inference_steps (and Flux2KleinPipeline's)
    pipeline_embeddings = ("prompt_embeds",)

    @classmethod
    def tiny_components(cls, config: Mapping[str, Any], seed: int) -> dict[str, Any]:
        """:func:`~deepspeed_knap.models.flux.finetune.tiny_flux2_pipeline_components`."""
        from deepspeed_knap.models.flux.finetune import tiny_flux2_pipeline_components

        return tiny_flux2_pipeline_components(config, seed)

    @classmethod
    def tiny_config(cls, heads: int, head_dim: int) -> dict[str, Any]:  # four RoPE axes of equal size
        return {**Generator.tiny_config.__func__(cls, heads, head_dim), "axes_dims_rope": (head_dim // 4,) * 4}

    @property
    def text_positions(self) -> tuple[int, str]:
        """The text encoder's positions (``Flux2Pipeline`` pads a prompt to ``max_sequence_length``
        tokens and refuses no length; past these positions the encoder was not trained). Mistral 3's
        are its text model's, Qwen3's (FLUX.2 [klein]) its own."""
        return self.pipeline.text_encoder.config.get_text_config().max_position_embeddings, "the text encoder"

    @property
    def true_cfg(self) -> bool:
        return False  # Flux2Pipeline has no negative prompt

    takes_references = True

    def pipeline_options(self, request: Request) -> dict[str, Any]:
        options = super().pipeline_options(request)
        if request.image is not None:
            options["image"] = [self.image_file(request, index) for index in range(len(request.image))]
        return options

    def _reference_images(self, request: Request) -> list[Any]:
        """The request's reference images as ``Flux2Pipeline.__call__`` prepares them: checked
        (``check_image_input``), brought down to 1024 x 1024 px of area where larger, each side
        floored to the VAE's scale times the 2x2 patch; PIL images of those sizes.

        Raises:
            RequestError: an image the pipeline refuses (too small, too elongated), naming it.
        """
        processor, multiple = self.pipeline.image_processor, self.patch_pixels
        images = []
        for index, path in enumerate(request.image):
            image = self.image_file(request, index)
            try:
                processor.check_image_input(image)
            except ValueError as error:
                raise RequestError(f"line {request.line}: image {path}: {error}") from None
            if image.width * image.height > 1024 * 1024:
                image = processor._resize_to_target_area(image, 1024 * 1024)
            images.append((image, image.height // multiple * multiple, image.width // multiple * multiple))
        return images

    def _reference_grids(self, request: Request) -> list[tuple[int, int]]:
        if request.image is None:
            return []
        multiple = self.patch_pixels
        return [(height // multiple, width // multiple) for _, height, width in self._reference_images(request)]

    def _reference_latents(self, request: Request, generator: torch.Generator) -> tuple[Tensor, Tensor] | None:
        """``Flux2Pipeline``'s ``preprocess(image, height, width, resize_mode="crop")`` and
        ``prepare_image_latents`` (the VAE's posterior mode, normalised by its batch-norm statistics,
        packed; ids ``(10 + 10 i, h, w, 0)`` for reference ``i``)."""
        if request.image is None:
            return None
        pipe = self.pipeline
        pixels = [pipe.image_processor.preprocess(image, height=height, width=width, resize_mode="crop")
                  for image, height, width in self._reference_images(request)]  # fmt: skip
        latents, ids = pipe.prepare_image_latents(images=pixels, batch_size=1, generator=generator,
                                                  device=self.device, dtype=pipe.vae.dtype)  # fmt: skip
        return latents[0], ids[0]

    @property
    def position_extent(self) -> int | None:
        return None  # Flux2Pipeline's position ids are whole numbers (int64): the token ceiling bounds the size

    def _embeddings_shapes(self, tensors: Mapping[str, Tensor], branches: int) -> dict[str, tuple[int | str, ...]]:
        return {"prompt_embeds": ("Tt", self.model.config["joint_attention_dim"])}

    def _encode(self, request: Request, negative: bool = False) -> dict[str, Tensor]:
        """``encoder_hidden_states`` and ``txt_ids`` from the pipeline's ``encode_prompt``, of the
        branch's text or given embeddings (:meth:`_branch_text`)."""
        prompt, given = self._branch_text(request, negative)
        text, text_ids = self.pipeline.encode_prompt(prompt=prompt, prompt_embeds=given, device=self.device,
                                                     max_sequence_length=self.max_sequence_length(request))  # fmt: skip
        return {"encoder_hidden_states": text[0], "txt_ids": text_ids[0]}

    def _branch_text(self, request: Request, negative: bool) -> tuple[str | None, Tensor | None]:
        """What ``encode_prompt`` encodes for a branch: ``(prompt, None)``, or ``(None, prompt_embeds
        [1, Tt, Dj])`` of the embeddings file on the device in the model's dtype (FLUX.2 [dev] runs
        the conditional branch alone)."""
        if request.prompt is not None:
            return request.prompt, None
        return None, self.embeddings_file(request)["prompt_embeds"][None].to(self.device, self.dtype)

    def _shift(self, image_tokens: int, steps: int) -> float:
        """``Flux2Pipeline``'s ``mu = compute_empirical_mu(image tokens, steps)``."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len=image_tokens, num_steps=steps)

    @torch.no_grad()
    def decode(self, state: FluxDenoising) -> np.ndarray:
        """``[height, width, 3]`` float image in ``[0, 1]``: ``Flux2Pipeline``'s unpacking by the
        position ids, the VAE batch-norm statistics undone, unpatchify, VAE decode, post-processing."""
        pipe = self.pipeline
        ids = state.branches[0]["img_ids"][: len(state.latents)]  # the noise's, not the references'
        latents = pipe._unpack_latents_with_ids(state.latents[None], ids[None])
        bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(latents.device, latents.dtype)
        latents = pipe._unpatchify_latents(latents * std + mean)
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="np")[0]


class Flux2KleinGenerator(Flux2Generator):
    """FLUX.2 [klein] requests, around a diffusers ``Flux2KleinPipeline``: :class:`Flux2Generator`'s
    noise, reference images, schedule and decode (the two pipelines agree there), the text through
    the klein pipeline's ``encode_prompt`` (Qwen3's hidden states 9, 18 and 27 stacked, padded to
    ``max_sequence_length``), and its guidance. Nothing goes into the transformer (klein's has no
    guidance embedding): above guidance 1 a base checkpoint runs classifier-free guidance, whose
    unconditional branch is the text ``""`` (the pipeline takes no negative prompt) padded like the
    prompt, with the request's reference images too; a step-distilled checkpoint (``is_distilled``)
    runs the conditional branch alone. An embeddings file holds ``prompt_embeds [Tt, Dj]`` and,
    for the unconditional branch, optionally ``negative_prompt_embeds [Tn, Dj]`` (else ``""`` is
    encoded), as the pipeline takes them."""

    pipeline_class = "Flux2KleinPipeline"
    tiny_transformer = TINY_FLUX2_KLEIN
    pipeline_embeddings = ("prompt_embeds", "negative_prompt_embeds")

    @classmethod
    def tiny_components(cls, config: Mapping[str, Any], seed: int) -> dict[str, Any]:
        """:func:`~deepspeed_knap.models.flux.finetune.tiny_flux2_klein_pipeline_components`."""
        from deepspeed_knap.models.flux.finetune import tiny_flux2_klein_pipeline_components

        return tiny_flux2_klein_pipeline_components(config, seed)

    @property
    def distilled(self) -> bool:
        """Whether the checkpoint is step-distilled (``model_index.json``'s ``is_distilled``): its
        pipeline then runs no guidance."""
        return bool(self.pipeline.config.is_distilled)

    def guidance_scale(self, request: Request) -> float:
        """The request's guidance, else the pipeline's 4.0; a step-distilled checkpoint's 1.0 (it
        guides not at all, and its pipeline warns that it ignores a scale above 1)."""
        if self.distilled and request.guidance is None:
            return 1.0
        return super().guidance_scale(request)

    def _branches(self, request: Request) -> int:
        """2 where ``Flux2KleinPipeline`` runs classifier-free guidance (``guidance`` above 1 on a base
        checkpoint), else 1.

        Raises:
            RequestError: ``negative_prompt`` or ``true_cfg_scale`` (the pipeline takes neither),
                ``guidance`` above 1 on a step-distilled checkpoint (it would be ignored), a key no
                FLUX.2 pipeline takes.
        """
        self._check_keys(request)
        line, pipeline, scale = request.line, self.pipeline_class, self.guidance_scale(request)
        if request.negative_prompt is not None or request.true_cfg_scale is not None:
            raise RequestError(f"line {line}: {pipeline} guides by 'guidance' alone, its unconditional text \"\" "
                               "(it takes no negative prompt): drop 'negative_prompt' and 'true_cfg_scale' (another "
                               "unconditional text goes in an embeddings file's negative_prompt_embeds)")  # fmt: skip
        if self.distilled and scale > 1:
            raise RequestError(f"line {line}: guidance {scale}: this {pipeline} is step-distilled (is_distilled in "
                               "model_index.json) and runs without guidance, ignoring it; drop 'guidance'")  # fmt: skip
        return 1 if self.distilled or scale <= 1 else 2

    def cfg_scale(self, request: Request) -> float:
        """``guidance``: the klein pipeline's ``guidance_scale`` is its classifier-free guidance's."""
        return self.guidance_scale(request)

    @property
    def embeds_guidance(self) -> bool:
        return False  # Flux2KleinPipeline gives the transformer guidance=None

    def _embeddings_shapes(self, tensors: Mapping[str, Tensor], branches: int) -> dict[str, tuple[int | str, ...]]:
        """FLUX.2's ``prompt_embeds``; with guidance the file's ``negative_prompt_embeds`` where it
        holds them, of any number of rows ``Tn``."""
        shapes = super()._embeddings_shapes(tensors, branches)
        if branches == 2 and "negative_prompt_embeds" in tensors:
            shapes["negative_prompt_embeds"] = ("Tn", self.model.config["joint_attention_dim"])
        return shapes

    def _branch_text(self, request: Request, negative: bool) -> tuple[str | None, Tensor | None]:
        """The conditional branch's as FLUX.2's; the unconditional one's the embeddings file's
        ``negative_prompt_embeds [1, Tn, Dj]`` where it holds them, else the pipeline's ``""``."""
        if not negative:
            return super()._branch_text(request, negative)
        saved = {} if request.embeddings is None else self.embeddings_file(request)
        if "negative_prompt_embeds" in saved:
            return None, saved["negative_prompt_embeds"][None].to(self.device, self.dtype)
        return "", None


def _nearest(pixels: int, multiple: int) -> int:
    return max(multiple, round(pixels / multiple) * multiple)


# The families deepspeed-knap generate runs, and the generator of each one's tiny model.
GENERATORS = {"flux": FluxGenerator, "flux2": Flux2Generator}
# The generator of each diffusers pipeline a FLUX.1 or FLUX.2 directory may name (model_index.json).
PIPELINE_GENERATORS = {generator.pipeline_class: generator
                       for generator in (FluxGenerator, Flux2Generator, Flux2KleinGenerator)}  # fmt: skip


def load_flux_generator(model_path: str | Path, dtype: torch.dtype, device: torch.device | str) -> FluxGenerator:
    """A diffusers FLUX.1 or FLUX.2 pipeline directory (``model_index.json``, ``transformer/``, text
    encoders, VAE, scheduler) as the generator of the pipeline ``model_index.json`` names
    (:data:`PIPELINE_GENERATORS`: ``FluxPipeline``, ``Flux2Pipeline``, ``Flux2KleinPipeline``) where
    it is one of the transformer's family: the transformer packed, the rest diffusers' own.

    Raises:
        ValueError: the checkpoint is another family's (FLUX.3, Wan), or its pipeline
            (``model_index.json``) is not one of its transformer's family's.
    """
    import diffusers

    from deepspeed_knap.models.auto import checkpoint_family, from_pretrained, model_class
    from deepspeed_knap.models.registry import SPECS

    family = checkpoint_family(model_path)
    if family not in GENERATORS:
        raise ValueError(f"{model_path} holds a {family!r} transformer; this loads {sorted(GENERATORS)} pipelines "
                         "(deepspeed_knap.models.generators.load_generator loads any family's)")  # fmt: skip
    spec = model_class(family).spec
    # A transformer of one family in another's pipeline directory loads, then every request fails
    # inside the pipeline's parts (its text encoders are the other family's).
    named = pipeline_index(model_path).get("_class_name")
    generator = PIPELINE_GENERATORS.get(named)
    if generator is None or generator.family != family:
        takes = {**{other.pipeline: other.diffusers_class for other in SPECS.values() if other.pipeline},
                 **{name: other.spec.diffusers_class for name, other in PIPELINE_GENERATORS.items()}}.get(named)  # fmt: skip
        pipelines = " or ".join(name for name, other in PIPELINE_GENERATORS.items() if other.family == family)
        raise ValueError(f"{model_path}: its transformer is a {spec.diffusers_class} but model_index.json "
                         f"names a {named}" + (f", which takes a {takes}" if takes else "") + "; give a "
                         f"{pipelines} directory (its transformer of the same family)")  # fmt: skip
    pipeline = getattr(diffusers, named).from_pretrained(model_path, transformer=None, torch_dtype=dtype).to(device)
    model = from_pretrained(model_path, torch_dtype=dtype).to(device).eval()
    return generator(pipeline, model)


def tiny_flux_generator(dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                        config: Mapping[str, Any] | None = None, family: str = "flux") -> FluxGenerator:  # fmt: skip
    """A tiny random FLUX.1 (``TINY_FLUX`` or ``config``) with
    :func:`~deepspeed_knap.models.flux.finetune.tiny_pipeline_components`, or with ``family="flux2"``
    a FLUX.2 (``TINY_FLUX2`` or ``config``) with
    :func:`~deepspeed_knap.models.flux.finetune.tiny_flux2_pipeline_components`, the same on every
    rank for a ``seed`` (:meth:`FluxGenerator.tiny`; FLUX.2 [klein]'s is
    ``Flux2KleinGenerator.tiny``): for CPU runs, tests and benchmarks without downloaded weights.

    Raises:
        ValueError: a family other than ``flux`` and ``flux2``.
    """
    if family not in GENERATORS:
        raise ValueError(f"family {family!r}: deepspeed-knap generate runs {sorted(GENERATORS)}; pick one of them")
    return GENERATORS[family].tiny(dtype, device, seed, config)
