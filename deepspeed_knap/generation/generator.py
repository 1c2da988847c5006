"""What every family's generator shares: its pipeline and packed model, the guidance default, and
reading a request's embeddings file. A family's generator (FLUX.1 and FLUX.2 in
:mod:`deepspeed_knap.models.flux.generate`, Wan in :mod:`deepspeed_knap.models.wan.generate`) adds
``request_seq_lens``, ``start`` and ``decode`` (:mod:`deepspeed_knap.generation.runner`)."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from deepspeed_knap.generation.requests import Request, RequestError


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
    def embeddings_file_shapes(request: Request) -> dict[str, tuple[int, ...]]:
        """Every tensor of ``request``'s embeddings file and its shape, read from the header only.

        Raises:
            RequestError: the file is missing or unreadable (the message names the line).
        """
        from safetensors import safe_open

        try:
            with safe_open(request.embeddings, "pt") as file:
                return {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}  # noqa: SIM118
        except Exception as error:  # safetensors raises its own types for a missing or damaged file
            raise RequestError(f"line {request.line}: cannot read embeddings {request.embeddings}: {error}") from None
