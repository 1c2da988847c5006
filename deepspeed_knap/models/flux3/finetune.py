"""FLUX.3 fine-tuning: the family's training hooks (:class:`Flux3Training`). FLUX.3 trains by the
image tokens' velocity (references and text are clean conditioning); diffusers 0.42.1 has no FLUX.3
pipeline class, so there is no validation here, and flow-map (step-distilled) checkpoints are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from deepspeed_knap.models.flux3.data import SyntheticFlux3Latents, latent_directory, rectified_flow
from deepspeed_knap.models.hooks import Objective, TrainingHooks
from deepspeed_knap.models.latents import LatentDirectory, SyntheticMixLatents


class Flux3Training(TrainingHooks):
    """FLUX.3 training: files of precomputed latents, references and text embeddings
    (:mod:`deepspeed_knap.models.flux3.data`'s format) or a synthetic mix (``flux3_edit``); the
    balancer plans each sample by its three token modes; a sample the model cannot pack is raised on
    every rank by the step's first collective."""

    segment_columns = 3
    carries_problems = True

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
