"""What the trainer (:class:`~deepspeed_knap.training.trainer.Trainer`) asks of a model family.

A family's ``finetune.py`` subclasses :class:`TrainingHooks` and names it in its spec
(``training="deepspeed_knap.models.wan.finetune:WanTraining"``); the trainer keeps the loop,
checkpoints, resume, LoRA, validation's timing and the per-step agreement, and calls these for what
differs between families: the data (synthetic or prepared files), the objective, how a batch is
packed, and validation through the family's diffusers pipeline. Nothing here communicates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from deepspeed_knap.models.latents import LatentDirectory, SyntheticMixLatents
from deepspeed_knap.models.lora import adapter_state_dict, lora_config, save_adapter
from deepspeed_knap.models.spec import ModelSpec


@dataclass(frozen=True)
class Objective:
    """One step's samples as the model takes them and what it must predict.

    Attributes:
        samples: the noised per-sample inputs ``model.pack`` takes.
        targets: ``[L_i, C]`` each sample's target rows, in the order of the model's packed output.
        weights: ``[L_i]`` each row's weight in the loss (0: none, e.g. a clean conditioning
            frame's), or ``None``: every row 1.
    """

    samples: list[dict[str, Tensor]]
    targets: list[Tensor]
    weights: list[Tensor] | None = None


@dataclass(frozen=True)
class ValidationSettings:
    """What validation renders, as the user gave it (``None``: the family's default)."""

    tiny: bool
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    steps: int | None = None
    guidance: float | None = None


class ValidationHooks(ABC):
    """Validation renders through a family's diffusers pipeline (its spec's ``pipeline``;
    :attr:`TrainingHooks.validation`); the defaults are FLUX.1's images, through a pipeline class
    built from its parts (:meth:`build_pipeline`).

    Attributes:
        default_guidance: the guidance scale validation renders at unless told (the pipeline's).
        model_path: the pipeline folder the parts come from (``--model-path``), or ``None`` (tiny).
    """

    default_guidance: ClassVar[float] = 3.5

    def __init__(self, spec: ModelSpec, model_path: str | None = None) -> None:
        self.spec, self.model_path = spec, model_path

    def options(self, settings: ValidationSettings) -> dict[str, Any]:
        """The pipeline's call arguments (sizes, steps, guidance) of a validation render."""
        side = settings.height or (32 if settings.tiny else 1024)
        options = dict(height=side, width=settings.width or side, num_inference_steps=28,
                       max_sequence_length=32 if settings.tiny else 512)  # fmt: skip
        if settings.steps or settings.tiny:
            options.update(num_inference_steps=settings.steps or 2)
        guidance = self.default_guidance if settings.guidance is None else settings.guidance
        return {**options, "guidance_scale": guidance}

    def pipeline(self, model: nn.Module) -> tuple[str, dict[str, Any]]:
        """The diffusers pipeline class that renders ``model`` and the pipeline config it is built
        with beside its parts (a two-expert model's ``boundary_ratio``)."""
        return self.spec.pipeline, {}

    def model_path_problem(self, model_path: str) -> str | None:
        """Why the parts of the pipeline cannot come from ``model_path``, or ``None``: here, a folder
        without the ``model_index.json`` of the pipeline class. Reads no weights (start-up, every rank)."""
        if (Path(model_path) / "model_index.json").is_file():
            return None
        return (f"--validation-every needs --model-path to be a {self.spec.pipeline} directory (with "
                f"model_index.json); {model_path} is not")  # fmt: skip

    def build_pipeline(self, model: nn.Module, components: Mapping[str, Any],
                       transformers: Mapping[str, nn.Module]) -> Any:  # fmt: skip
        """The pipeline that renders ``model``: :meth:`pipeline`'s class built from ``components``
        (:meth:`components`, less the transformers), ``transformers`` (diffusers' models of the
        current weights) and the pipeline config."""
        import diffusers

        name, config = self.pipeline(model)
        return getattr(diffusers, name)(**components, **transformers, **config)

    @abstractmethod
    def tiny_components(self, model: nn.Module, seed: int) -> dict[str, Any]:
        """Small random pipeline parts but the transformers that fit a tiny model (no download)."""

    def components(self, model_path: str | None, model: nn.Module, seed: int, dtype: torch.dtype) -> dict[str, Any]:
        """The pipeline's parts but the transformers: the checkpoint's, or tiny random ones without a
        ``model_path``."""
        if model_path is None:
            return self.tiny_components(model, seed)
        import diffusers

        pipeline = getattr(diffusers, self.pipeline(model)[0])
        second = {"transformer_2": None} if "transformer_2" in pipeline._optional_components else {}
        return pipeline.from_pretrained(model_path, transformer=None, **second, torch_dtype=dtype).components

    def render_options(self, model: nn.Module) -> dict[str, Any]:
        """Call arguments ``model`` needs whatever the settings (none by default)."""
        return {}

    def call(self, line: str, directory: Path, model: nn.Module) -> dict[str, Any]:
        """A prompts file's line as the pipeline's arguments for rendering ``model`` (``directory``:
        the file's, for paths it names). Made at start-up, so a line the pipeline cannot take is
        refused before any training step.

        Raises:
            ValueError: a line this model's pipeline cannot render (naming it), or an unreadable file.
        """
        return {"prompt": line}

    def render(self, pipe: Any, call: Mapping[str, Any], generator: torch.Generator, options: Mapping,
               path: Path) -> Path:  # fmt: skip
        """Render one validation prompt to ``path`` (without its suffix); returns the file written."""
        file = path.with_suffix(".png")
        pipe(**call, generator=generator, **options).images[0].save(file)
        return file


class TrainingHooks(ABC):
    """A family's part of training (subclass per family).

    Attributes:
        spec: the family's spec.
        validation: the family's validation renders, or ``None`` where none is wired up.
        segment_columns: attention segments per sequence the balancer plans with (FLUX.3's 3 token
            modes: its packed inputs' ``segments``), or ``None``.
        expert: the one expert of a two-expert model the run trains (Wan 2.2 A14B's ``"high"`` or
            ``"low"``, set by :meth:`load_model`), or ``None``: a checkpoint records it, and a
            resume with the other is refused (the two have the same parameter names).
    """

    validation: ClassVar[type[ValidationHooks] | None] = None
    segment_columns: ClassVar[int | None] = None

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.expert: str | None = None

    def check_arguments(self, arguments: Any) -> None:
        """Refuse arguments this family cannot train with, before any weight loads (reads only
        small files, such as a pipeline's ``model_index.json``; the trainer agrees on the outcome).

        Raises:
            ValueError: naming the argument and the fix: here, Wan's ``expert``, ``high_noise_share``
                and ``first_frame_share``, which a family without experts or image-conditioned frames
                would silently ignore.
        """
        given = [f"--{name.replace('_', '-')} {value}" for name in ("expert", "high_noise_share")
                 if (value := getattr(arguments, name)) is not None]  # fmt: skip
        if given:
            raise ValueError(f"{' and '.join(given)}: {self.spec.title} has one transformer (--expert chooses among "
                             "Wan 2.2 A14B's two, --high-noise-share splits the samples between them); drop "
                             f"{'it' if len(given) == 1 else 'them'}")  # fmt: skip
        if arguments.first_frame_share is not None:
            raise ValueError(f"--first-frame-share {arguments.first_frame_share}: {self.spec.title} has no "
                             "image-conditioned first frame (Wan 2.2 TI2V's); drop it")  # fmt: skip

    def load_model(self, arguments: Any, options: Mapping[str, Any]) -> nn.Module:
        """The model to train: ``arguments.model_path``'s checkpoint (collective; under ZeRO-3 each
        rank reads only its partitions) or a tiny random one, with ``options``
        (``gradient_checkpointing``)."""
        if arguments.model_path is None:
            return self.spec.tiny_model(**options)
        return self.spec.model_class.from_pretrained(arguments.model_path, ds_config=arguments.deepspeed_config,
                                                     **options)  # fmt: skip

    def refuse(self, model: nn.Module, model_path: str | None) -> str | None:
        """Why this checkpoint cannot be trained here, or ``None``. Read from the config (and files
        that are the same on every rank): the trainer still agrees on the answer."""
        return None

    def save_adapters(self, model: nn.Module, state: Mapping[str, Tensor], directory: Path) -> list[tuple[Path, dict]]:
        """Write the LoRA adapter of ``model``'s full ``state`` as the family's pipeline loads it;
        returns each file written and the ``load_lora_weights`` keywords that load it."""
        adapter = adapter_state_dict(model, state)
        return [(save_adapter(directory, adapter, lora_config(model), self.spec.lora_loader), {})]

    @abstractmethod
    def synthetic_data(self, mix: str, config: Mapping, token_scale: float, seed: int) -> SyntheticMixLatents:
        """Random latent samples of a bundled mix's sizes, each step and rank its own."""

    @abstractmethod
    def latent_directory(self, path: str | Path, samples_per_rank: int, repeat: bool) -> LatentDirectory:
        """A directory of this family's prepared samples."""

    @abstractmethod
    def objective(self, latents: Sequence[Mapping[str, Tensor]], generator: torch.Generator, config: Mapping,
                  guidance: float | None) -> Objective:  # fmt: skip
        """The noised inputs ``model.pack`` takes and each sample's target rows, in the order of the
        model's packed output."""

    def pack(self, model: nn.Module, samples: list[dict[str, Tensor]], balanced: bool) -> tuple[Any, str | None]:
        """``(packed inputs, None)``, or ``(None, why)`` for samples the model cannot pack where the
        trainer must agree on it first. Every family's model packs with ``on_problem="carry"``
        (its inputs then carry why, holding no samples): balanced, the step's first collective
        raises it on every rank (a ``ValueError`` from the forward); unbalanced, the trainer agrees
        on the ``why``."""
        inputs = model.pack(samples, on_problem="carry")
        if balanced or inputs.problem is None:
            return inputs, None
        return None, inputs.problem
