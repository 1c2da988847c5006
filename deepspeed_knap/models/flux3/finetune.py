"""FLUX.3 fine-tuning: the family's training hooks (:class:`Flux3Training`) and validation images
through diffusers' modular FLUX.3 pipeline over the trained weights (:class:`Flux3Validation`).
FLUX.3 trains by the image tokens' velocity (references and text are clean conditioning); flow-map
(step-distilled) checkpoints are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from deepspeed_knap.models.flux3.data import SyntheticFlux3Latents, latent_directory, rectified_flow
from deepspeed_knap.models.hooks import Objective, TrainingHooks, ValidationHooks, ValidationSettings
from deepspeed_knap.models.latents import LatentDirectory, SyntheticMixLatents

# What a FLUX.3 modular pipeline folder holds (generate.load_flux3_pipeline reads either).
FLUX3_INDEXES = ("modular_model_index.json", "model_index.json")


def quiet_progress(blocks: Any) -> None:
    """Turn off the progress bar of every loop in ``blocks``: diffusers' ``set_progress_bar_config``
    of a modular pipeline reaches its top blocks only, and the denoising loop is nested below them."""
    for block in getattr(blocks, "sub_blocks", {}).values():
        if hasattr(block, "set_progress_bar_config"):
            block.set_progress_bar_config(disable=True)
        quiet_progress(block)


class Flux3Validation(ValidationHooks):
    """Validation images through diffusers' modular FLUX.3 pipeline (``Flux3AutoBlocks`` without the
    prompt upsampler, :func:`~deepspeed_knap.models.flux3.generate.flux3_blocks`), as
    ``deepspeed-knap generate`` renders FLUX.3: text to image, or an edit of the reference images a
    prompts line names (``IMAGE<TAB>PROMPT``, several: ``IMAGE<TAB>IMAGE<TAB>PROMPT``), at the
    validation size (no crop back to a reference), with the pipeline's ``ClassifierFreeGuidance``
    at ``--validation-guidance`` (its 3.5 unless told), 50 steps and each prompt's own text length
    (the text encoder step's ``max_sequence_length``, 8192). A LoRA adapter loads through the
    modular pipeline's ``load_lora_weights`` (``Flux3LoraLoaderMixin``), as a user loads the export."""

    default_guidance = 3.5  # the modular pipeline's guider's

    def options(self, settings: ValidationSettings) -> dict[str, Any]:
        options = super().options(settings)
        del options["max_sequence_length"]  # the pipeline's: each prompt padded to a multiple of 80 tokens
        if not settings.steps and not settings.tiny:
            options["num_inference_steps"] = 50  # Flux3SetTimestepsStep's default
        return options

    def model_path_problem(self, model_path: str) -> str | None:
        if any((Path(model_path) / index).is_file() for index in FLUX3_INDEXES):
            return None
        return (f"--validation-every needs --model-path to be a FLUX.3 modular pipeline directory (with "
                f"{' or '.join(FLUX3_INDEXES)}: its VAE, text encoder and tokenizer render the images); "
                f"{model_path} has neither")  # fmt: skip

    def tiny_components(self, model: nn.Module, seed: int) -> dict[str, Any]:
        from deepspeed_knap.models.flux3.generate import tiny_flux3_pipeline_components

        return tiny_flux3_pipeline_components(model.config, seed)

    def components(self, model_path: str | None, model: nn.Module, seed: int, dtype: torch.dtype) -> dict[str, Any]:
        """The folder's parts as the modular pipeline loads them (on the host), or tiny random ones."""
        if model_path is None:
            return self.tiny_components(model, seed)
        from deepspeed_knap.models.flux3.generate import load_flux3_pipeline

        pipe = load_flux3_pipeline(model_path, dtype, "cpu")
        return {name: part for name, part in pipe.components.items() if part is not None}

    def build_pipeline(self, model: nn.Module, components: Mapping[str, Any],
                       transformers: Mapping[str, nn.Module]) -> Any:  # fmt: skip
        """A ``Flux3ModularPipeline`` of :func:`~deepspeed_knap.models.flux3.generate.flux3_blocks`
        holding ``components`` and the transformer (there is no pipeline class to build); the
        scheduler and guider are the blocks' defaults where ``components`` has none."""
        from deepspeed_knap.models.flux3.generate import flux3_blocks

        blocks = flux3_blocks()
        quiet_progress(blocks)  # before the pipeline is made: its .blocks is a copy
        pipe = blocks.init_pipeline()
        pipe.update_components(**components, **transformers)
        return pipe

    def call(self, line: str, directory: Path, model: nn.Module) -> dict[str, Any]:
        """Text to image: the line is the prompt. An edit: ``IMAGE<TAB>PROMPT`` (or several images,
        each before its own tab), the images' paths relative to the prompts file, read now.

        Raises:
            ValueError: an empty image name or prompt, or with several references one smaller than
                the 16 px grid the pipeline crops each to.
            OSError: an image that cannot be read.
        """
        *names, prompt = line.split("\t")
        if not names:
            return {"prompt": line}
        names = [name.strip() for name in names]
        if not prompt.strip() or not all(names):
            raise ValueError(f"{line[:60]!r}: an edit is IMAGE<TAB>PROMPT (several images: IMAGE<TAB>IMAGE<TAB>"
                             "PROMPT), each image's path relative to the prompts file; one of them is empty")  # fmt: skip
        from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

        from deepspeed_knap.generation.requests import read_image
        from deepspeed_knap.models.flux3.generate import reference_problem

        images = [read_image(directory / name) for name in names]
        problem = reference_problem(names, images, Flux3ImageProcessor().config.vae_scale_factor)
        if problem:
            raise ValueError(problem)
        return {"prompt": prompt, "image": images}

    def render(self, pipe: Any, call: Mapping[str, Any], generator: torch.Generator, options: Mapping,
               path: Path) -> Path:  # fmt: skip
        """The modular pipeline takes its guidance from its guider: set to the options' scale first."""
        from deepspeed_knap.models.flux3.generate import scaled_guider

        options = dict(options)
        pipe.update_components(guider=scaled_guider(pipe.guider, options.pop("guidance_scale")))
        file = path.with_suffix(".png")
        pipe(**call, generator=generator, **options, output="images")[0].save(file)
        return file


class Flux3Training(TrainingHooks):
    """FLUX.3 training: files of precomputed latents, references and text embeddings
    (:mod:`deepspeed_knap.models.flux3.data`'s format, ``examples/prepare_flux3_latents.py``) or a
    synthetic mix (``flux3_edit``); the balancer plans each sample by its three token modes; a sample
    the model cannot pack is raised on every rank by the step's first collective; validation images
    through the modular FLUX.3 pipeline (:class:`Flux3Validation`)."""

    validation = Flux3Validation
    segment_columns = 3

    def refuse(self, model: nn.Module, model_path: str | None) -> str | None:
        if model.config["flow_map"]:
            return (f"{model_path} is a FLUX.3 flow-map (step-distilled) checkpoint (flow_map=True): it predicts the "
                    "jump to a target_timestep, an objective this trainer does not train (it trains the velocity of "
                    "the base model); fine-tune the base FLUX.3 checkpoint (flow_map=False)")  # fmt: skip
        return None

    def synthetic_data(self, mix: str, config: Mapping, token_scale: float, seed: int) -> SyntheticMixLatents:
        return SyntheticFlux3Latents(mix, config, token_scale, seed)

    def latent_directory(self, path: str | Path, samples_per_rank: int, repeat: bool) -> LatentDirectory:
        return latent_directory(path, samples_per_rank, repeat)

    def objective(self, latents: Sequence[Mapping[str, Tensor]], generator: torch.Generator, config: Mapping,
                  guidance: float | None) -> Objective:  # fmt: skip
        return Objective(*rectified_flow(latents, generator))
