"""What every family's generator shares: its pipeline and packed model, the guidance default, and
reading a request's embeddings file. A family's generator (FLUX.1 and FLUX.2 in
:mod:`deepspeed_knap.models.flux.generate`, Wan in :mod:`deepspeed_knap.models.wan.generate`) adds
``request_seq_lens``, ``start`` and ``decode`` (:mod:`deepspeed_knap.generation.runner`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from deepspeed_knap.generation.requests import MAX_EMBEDDINGS_BYTES, Request, RequestError, read_regular_file


class Generator:
    """A family's generation around its diffusers pipeline.

    Args:
        pipeline: the family's diffusers pipeline (its ``transformer`` may be ``None``) on the device.
        model: the packed transformer with the pipeline transformer's weights, on the same device.
    """

    family: ClassVar[str]
    name: ClassVar[str]
    default_guidance: ClassVar[float]  # the pipeline's guidance_scale

    def __init__(self, pipeline: Any, model: nn.Module) -> None:
        self.pipeline = pipeline
        self.model = model
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    def guidance_scale(self, request: Request) -> float:
        """The request's guidance scale, or the pipeline's default where it gives none."""
        return self.default_guidance if request.guidance is None else request.guidance

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
