"""Data for FLUX training steps: precomputed latents per sample, synthetic or from ``.safetensors``
files, and the rectified-flow objective that turns them into model inputs and targets.

A *latent sample* is a dict of unbatched tensors (the text encoders and the VAE run before training):

===========================  ===============  =============================================
key                          shape            what
===========================  ===============  =============================================
``latents``                  ``[L, C]``       packed VAE latents (FLUX: 2x2 patches, C = 64)
``img_ids``                  ``[L, 3]``       positions ``(t, h, w)``; ``t = 0`` for images
``encoder_hidden_states``    ``[Tt, Dj]``     T5 token embeddings (FLUX: Dj = 4096)
``txt_ids``                  ``[Tt, 3]``      zeros
``pooled_projections``       ``[Dp]``         pooled CLIP embedding (FLUX: Dp = 768)
===========================  ===============  =============================================

On disk, one sample is one ``.safetensors`` file holding exactly these keys (see
:func:`save_latent_sample` and ``examples/prepare_flux_latents.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from deepspeed_knap.workloads import SampleShape, sample_shapes

LATENT_KEYS = ("latents", "img_ids", "encoder_hidden_states", "txt_ids", "pooled_projections")


def grid_ids(visual: int, frames: int) -> Tensor:
    """``[visual, 3]`` positions ``(t, h, w)`` of ``visual`` tokens over ``frames`` frames, each
    frame a near-square grid filled row by row (the last row and frame may be partial)."""
    per_frame = math.ceil(visual / frames)
    width = math.ceil(math.sqrt(per_frame))
    index = torch.arange(visual)
    within = index % per_frame
    return torch.stack([index // per_frame, within // width, within % width], dim=1).float()


def synthetic_samples(
    shapes: Sequence[SampleShape], config: Mapping, seed: int, token_scale: float = 1.0, dtype=torch.float32
) -> list[dict[str, Tensor]]:
    """Random latent samples of the given sizes, scaled by ``token_scale`` (at least one visual
    token each); ``config`` is the model's (``in_channels``, ``joint_attention_dim``,
    ``pooled_projection_dim``). A function of ``seed`` only."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(dtype)

    samples = []
    for shape in shapes:
        scaled = shape.scaled(token_scale)
        text, visual = scaled.text, scaled.visual
        samples.append({
            "latents": randn(visual, config["in_channels"]),
            "img_ids": grid_ids(visual, min(shape.frames, visual)),
            "encoder_hidden_states": randn(text, config["joint_attention_dim"]),
            "txt_ids": torch.zeros(text, 3),
            "pooled_projections": randn(config["pooled_projection_dim"]),
        })  # fmt: skip
    return samples


class SyntheticLatents:
    """Each step, each rank's samples drawn from a bundled workload (``deepspeed-knap plan
    --workload``'s names): the same sizes the planner benchmarks, with random latents."""

    def __init__(self, workload: str, config: Mapping, token_scale: float = 1.0, seed: int = 0) -> None:
        sample_shapes(workload, 1)  # an unknown name raises here, not at the first step
        self.workload, self.config, self.token_scale, self.seed = workload, config, token_scale, seed

    def step_samples(self, step: int, rank: int, world_size: int, dtype=torch.float32) -> list[dict[str, Tensor]]:
        shapes = sample_shapes(self.workload, world_size, seed=self.seed * 100_003 + step)[rank]
        return synthetic_samples(
            shapes, self.config, (self.seed * 100_003 + step) * 4099 + rank, self.token_scale, dtype
        )


class LatentDirectory:
    """A directory of latent samples, one ``.safetensors`` file each (sorted by name). Step ``s``
    gives rank ``r`` of ``W`` files ``(s * W + r) * k`` to ``+ k`` (wrapping), ``k = samples_per_rank``."""

    def __init__(self, path: str | Path, samples_per_rank: int = 1) -> None:
        self.files = sorted(Path(path).glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(
                f"no .safetensors files in {path}; write some with examples/prepare_flux_latents.py"
            )
        if samples_per_rank < 1:
            raise ValueError(f"samples_per_rank must be at least 1; got {samples_per_rank}")
        self.samples_per_rank = samples_per_rank

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        from safetensors.torch import load_file

        sample = load_file(self.files[index])
        missing = [key for key in LATENT_KEYS if key not in sample]
        if missing:
            raise ValueError(f"{self.files[index]} has no {missing}; a latent sample holds {list(LATENT_KEYS)}")
        return sample

    def step_samples(self, step: int, rank: int, world_size: int, dtype=torch.float32) -> list[dict[str, Tensor]]:
        first = (step * world_size + rank) * self.samples_per_rank
        samples = [self[(first + k) % len(self)] for k in range(self.samples_per_rank)]
        return [{key: t.to(dtype) if t.is_floating_point() and "ids" not in key else t for key, t in s.items()}
                for s in samples]  # fmt: skip


def save_latent_sample(path: str | Path, sample: Mapping[str, Tensor]) -> None:
    """Write one latent sample (the keys of :data:`LATENT_KEYS`) as a ``.safetensors`` file."""
    from safetensors.torch import save_file

    missing = [key for key in LATENT_KEYS if key not in sample]
    if missing:
        raise ValueError(f"a latent sample needs {list(LATENT_KEYS)}; missing {missing}")
    save_file({key: sample[key].detach().contiguous().cpu() for key in LATENT_KEYS}, str(path))


def rectified_flow(
    samples: Sequence[Mapping[str, Tensor]], generator: torch.Generator, guidance: float | None = None
) -> tuple[list[dict[str, Tensor]], list[Tensor]]:
    """The flow-matching objective of FLUX fine-tuning, per sample.

    ``sigma = sigmoid(n)``, ``n ~ N(0, 1)`` (logit-normal); ``noisy = (1 - sigma) * x0 + sigma * noise``;
    the model sees ``noisy`` at timestep ``sigma`` and must predict ``noise - x0``.

    Returns:
        ``(model_samples, targets)``: per-sample inputs for ``PackedFluxTransformer.pack`` (with
        ``guidance`` when given) and the ``[L, C]`` targets.
    """
    model_samples, targets = [], []
    for sample in samples:
        x0 = sample["latents"]
        sigma = torch.sigmoid(torch.randn((), generator=generator)).to(x0.dtype)
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0.dtype)
        model_sample = {
            "hidden_states": (1 - sigma) * x0 + sigma * noise,
            "timestep": sigma,
            **{key: sample[key] for key in ("img_ids", "encoder_hidden_states", "txt_ids", "pooled_projections")},
        }
        if guidance is not None:
            model_sample["guidance"] = torch.tensor(guidance, dtype=x0.dtype)
        model_samples.append(model_sample)
        targets.append(noise - x0)
    return model_samples, targets
