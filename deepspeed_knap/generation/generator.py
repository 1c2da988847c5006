"""What every family's generator shares: its pipeline and packed model, the guidance default, and
reading a request's embeddings file. A family's generator (FLUX.1 and FLUX.2 in
:mod:`deepspeed_knap.models.flux.generate`, Wan in :mod:`deepspeed_knap.models.wan.generate`) adds
``request_seq_lens``, ``start`` and ``decode`` (:mod:`deepspeed_knap.generation.runner`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from torch import nn

from deepspeed_knap.generation.requests import Request, RequestError
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
    # The embeddings file's tensors the family's pipeline takes by the same names (pipeline_call).
    pipeline_embeddings: ClassVar[tuple[str, ...]] = ("prompt_embeds", "negative_prompt_embeds")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__:
            cls.family, cls.name = cls.spec.name, cls.spec.title

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

        if request.prompt is not None:
            text: Mapping[str, Any] = {"prompt": request.prompt, "max_sequence_length": request.max_sequence_length}
        else:
            from safetensors.torch import load_file

            saved = load_file(request.embeddings)
            device = next(self.pipeline.vae.parameters()).device
            text = {key: saved[key][None].to(device, self.dtype) for key in self.pipeline_embeddings if key in saved}
        return {**text, "height": request.height, "width": request.width, "num_inference_steps": request.steps,
                "generator": torch.Generator().manual_seed(request.seed), **self.pipeline_options(request)}  # fmt: skip
