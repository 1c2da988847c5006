"""What every family's generator shares: its pipeline and packed model, the guidance and text-length
defaults, reading a request's embeddings file and images, and the diffusers pipeline call that
draws one request alone. A family's generator (FLUX.1 and FLUX.2 in
:mod:`deepspeed_knap.models.flux.generate`, FLUX.3 in :mod:`deepspeed_knap.models.flux3.generate`,
Wan in :mod:`deepspeed_knap.models.wan.generate`) adds ``request_seq_lens``, ``start`` and
``decode`` (:mod:`deepspeed_knap.generation.runner`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from deepspeed_knap.generation.requests import (
    MAX_EMBEDDINGS_BYTES,
    Request,
    RequestError,
    read_image,
    read_regular_file,
)
from deepspeed_knap.models.spec import ModelSpec


class Generator:
    """A family's generation around its diffusers pipeline.

    Args:
        pipeline: the family's diffusers pipeline (its ``transformer`` may be ``None``) on the device.
        model: the packed transformer with the pipeline transformer's weights, on the same device.
    """

    spec: ClassVar[ModelSpec]  # the family's; gives ``family`` (its name) and ``name`` (its title)
    family: ClassVar[str]
    name: ClassVar[str]
    default_guidance: ClassVar[float]  # the pipeline's guidance_scale
    default_steps: ClassVar[int] = 50  # the pipeline's num_inference_steps (FluxPipeline's 28)
    default_max_sequence_length: ClassVar[int] = 512  # the pipeline's max_sequence_length
    frames_per_second = 16  # a video family's clips' frame rate (a Wan pipeline's own)
    # The embeddings file's tensors the family's pipeline takes by the same names (pipeline_call).
    pipeline_embeddings: ClassVar[tuple[str, ...]] = ("prompt_embeds", "negative_prompt_embeds")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__:
            cls.family, cls.name = cls.spec.name, cls.spec.title

    def __init__(self, pipeline: Any, model: nn.Module) -> None:
        self.pipeline = pipeline
        self.model = model
        # The dtype the model computes in (a packed model's: outside the modules kept in float32).
        self.device, self.dtype = next(model.parameters()).device, model.dtype

    def guidance_scale(self, request: Request) -> float:
        """The request's guidance scale, or the pipeline's default where it gives none."""
        return self.default_guidance if request.guidance is None else request.guidance

    def max_sequence_length(self, request: Request) -> int:
        """The request's ``max_sequence_length``, or the pipeline's default where it gives none."""
        return self.default_max_sequence_length if request.max_sequence_length is None else request.max_sequence_length

    def check_size_given(self, request: Request) -> None:
        """Refuse a request without ``height`` or ``width`` (the intake lets a request with ``image``
        leave them out, for a family whose pipeline sizes the output by its image).

        Raises:
            RequestError: naming the line and the missing key.
        """
        missing = [key for key in ("height", "width") if getattr(request, key) is None]
        if missing:
            raise RequestError(f"line {request.line}: {self.name} needs {' and '.join(map(repr, missing))} (pixels) "
                               f"with an image too; e.g. \"{missing[0]}\": 1024")  # fmt: skip

    @staticmethod
    def embeddings_file(request: Request) -> dict[str, Tensor]:
        """Every tensor of ``request``'s embeddings file, on the CPU. The file is read only if it is
        a regular file of at most :data:`~deepspeed_knap.generation.requests.MAX_EMBEDDINGS_BYTES`
        (:func:`~deepspeed_knap.generation.requests.read_regular_file`).

        Raises:
            RequestError: the file is missing, unreadable, not a regular file, too large or not
                safetensors (the message names the line and the file).
        """
        from safetensors.torch import load

        try:
            return load(read_regular_file(request.embeddings, MAX_EMBEDDINGS_BYTES))
        except Exception as error:  # safetensors raises its own types for a damaged file
            raise RequestError(f"line {request.line}: cannot read embeddings {request.embeddings}: {error}") from None

    @staticmethod
    def image_file(request: Request, index: int = 0) -> Any:
        """``request``'s image ``index`` as an RGB ``PIL.Image``, oriented by its EXIF tag (as
        diffusers' ``load_image``). The file is read only if it is a regular file of at most
        :data:`~deepspeed_knap.generation.requests.MAX_IMAGE_BYTES`.

        Raises:
            RequestError: the file is missing, unreadable, not a regular file, too large or not an
                image PIL reads (the message names the line and the file).
        """
        try:
            return read_image(request.image[index])
        except ValueError as error:
            raise RequestError(f"line {request.line}: {error}") from None

    @classmethod
    def tiny_config(cls, heads: int, head_dim: int) -> dict[str, Any]:
        """The family's tiny transformer config at ``heads`` heads of ``head_dim`` (benchmarks)."""
        return {**cls.spec.tiny_config, "num_attention_heads": heads, "attention_head_dim": head_dim}

    def pipeline_options(self, request: Request) -> dict[str, Any]:
        """The family's diffusers pipeline's call arguments for ``request`` alone, but its text."""
        return {"guidance_scale": self.guidance_scale(request)}

    def pipeline_call(self, request: Request) -> dict[str, Any]:
        """Everything the family's diffusers pipeline takes to draw ``request`` alone (the reference
        ``bench generate`` times): its prompt, or its embeddings file's tensors batched on the
        pipeline's device and dtype; sizes, steps, seed and guidance as the generator reads them."""
        import torch

        length = self.max_sequence_length(request)
        if request.prompt is not None:
            text: Mapping[str, Any] = {"prompt": request.prompt, "max_sequence_length": length}
        else:  # max_sequence_length too: a pipeline may cut given embeddings to it (Qwen-Image's does)
            saved = self.embeddings_file(request)
            device = next(self.pipeline.vae.parameters()).device
            text = {key: saved[key][None].to(device, self.dtype) for key in self.pipeline_embeddings if key in saved}
            text["max_sequence_length"] = length
        return {**text, "height": request.height, "width": request.width, "num_inference_steps": request.steps,
                "generator": torch.Generator().manual_seed(request.seed), **self.pipeline_options(request)}  # fmt: skip

    def reference_pipeline(self, transformers: Mapping[str, nn.Module]) -> Any:
        """The family's diffusers pipeline of this generator's parts and settings with diffusers'
        ``transformers`` (the packed model's weights, by the pipeline's names:
        ``type(model).pipeline_transformers(...)``, both experts of Wan 2.2 A14B): what
        ``bench generate``'s ``pipeline`` mode times. The settings are the pipeline's config that is
        no part (Wan 2.2's ``boundary_ratio`` and ``expand_timesteps``, FLUX.2 klein's
        ``is_distilled``): the parts alone would make a pipeline that runs otherwise."""
        parts = self.pipeline.components
        settings = {key: value for key, value in self.pipeline.config.items()
                    if key not in parts and not key.startswith("_")}  # fmt: skip
        return type(self.pipeline)(**{**parts, **transformers}, **settings)

    def run_pipeline(self, pipe: Any, request: Request) -> Any:
        """``pipe`` (:meth:`reference_pipeline`) drawing ``request`` alone (:meth:`pipeline_call`)."""
        return pipe(**self.pipeline_call(request))

    @staticmethod
    def check_embedding_values(request: Request, tensors: dict[str, Tensor], keys: list[str]) -> None:
        """Refuse text embeddings ``keys`` of ``tensors`` that no text encoder gives: whole numbers or
        booleans (a cast would turn them into text the model never saw), or NaN or infinite values
        (the image would be NaN: black, with nothing said).

        Raises:
            RequestError: naming the line, the file, the tensor and what is wrong.
        """
        for key in keys:
            tensor = tensors[key]
            problem = None
            if not tensor.is_floating_point():
                problem = f"{key} is {str(tensor.dtype).removeprefix('torch.')}; text embeddings are floating point"
            elif not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                problem = f"{key} holds {bad:,} NaN or infinite value(s) of {tensor.numel():,}"
            if problem is not None:
                raise RequestError(f"line {request.line}: embeddings {request.embeddings}: {problem}; give the "
                                   "text encoder's output for the prompt")  # fmt: skip
