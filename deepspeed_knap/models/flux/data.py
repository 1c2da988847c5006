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
:func:`save_latent_sample` and ``examples/prepare_flux_latents.py``; :func:`check_latent_file` says
what is wrong with one), in a directory :class:`~deepspeed_knap.models.latents.LatentDirectory`
reads and verifies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.models.flux.base import position_ids
from deepspeed_knap.models.latents import (
    LatentDirectory,
    SyntheticMixLatents,
    flow_noise,
    non_float_tensors,
    sample_file_header,
)

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
        img_ids, txt_ids = position_ids(config, grid_ids(visual, min(shape.frames, visual)), text)
        sample = {"latents": randn(visual, config["in_channels"]), "img_ids": img_ids,
                  "encoder_hidden_states": randn(text, config["joint_attention_dim"]), "txt_ids": txt_ids}  # fmt: skip
        if "pooled_projection_dim" in config:  # FLUX.1; FLUX.2 has no pooled text
            sample["pooled_projections"] = randn(config["pooled_projection_dim"])
        samples.append(sample)
    return samples


class SyntheticLatents(SyntheticMixLatents):
    """Each step, each rank's samples drawn from a bundled data mix (``deepspeed-knap plan
    --mix``'s names): the same sizes the planner benchmarks, with random latents (:func:`synthetic_samples`)."""

    make_samples = staticmethod(synthetic_samples)


def latent_sample_shapes(config: Mapping, latent_len: int, text_len: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one latent sample's tensors for a model ``config`` (:data:`LATENT_KEYS` order): ids
    of one position axis per RoPE axis, and pooled text only for a family that has it (FLUX.1)."""
    axes = len(config["axes_dims_rope"])
    shapes = {
        "latents": (latent_len, config["in_channels"]),
        "img_ids": (latent_len, axes),
        "encoder_hidden_states": (text_len, config["joint_attention_dim"]),
        "txt_ids": (text_len, axes),
    }
    if "pooled_projection_dim" in config:
        shapes["pooled_projections"] = (config["pooled_projection_dim"],)
    return shapes


def check_latent_file(file: str | Path, config: Mapping) -> str | None:
    """What is wrong with one latent sample file for a model ``config``, or ``None``. Reads only the
    header: a truncated or garbage file, missing or extra keys, non-float tensors, shapes that do
    not fit each other or the model."""
    writer = "examples/prepare_flux_latents.py" if "pooled_projection_dim" in config else "save_latent_sample"
    fix = f"rewrite it with {writer} or remove it"
    headers = sample_file_header(file, fix)
    if isinstance(headers, str):
        return headers
    keys = list(latent_sample_shapes(config, 0, 0))
    missing = [key for key in keys if key not in headers]
    extra = sorted(set(headers) - set(keys))
    if missing or extra:
        return f"{file}: has keys {sorted(headers)}, missing {missing}, unexpected {extra}; a latent sample for this model holds exactly {keys}; {fix}"
    if problem := non_float_tensors(file, headers, fix):
        return problem
    latents, text = headers["latents"][0], headers["encoder_hidden_states"][0]
    if len(latents) != 2 or len(text) != 2 or latents[0] < 1:
        return f"{file}: latents {list(latents)} and encoder_hidden_states {list(text)} must be [L, C] and [Tt, Dj] with L >= 1; {fix}"
    expected = latent_sample_shapes(config, latents[0], text[0])
    wrong = {key: f"{list(headers[key][0])} (expected {list(shape)})" for key, shape in expected.items()
             if headers[key][0] != shape}  # fmt: skip
    if wrong:
        dims = ", ".join(f"{key}={config[key]}" for key in ("in_channels", "joint_attention_dim", "pooled_projection_dim",
                                                             "axes_dims_rope") if key in config)  # fmt: skip
        return f"{file}: shapes {wrong} do not fit the model ({dims}); {fix}"
    return None


def save_latent_sample(path: str | Path, sample: Mapping[str, Tensor]) -> None:
    """Write one latent sample (the keys of :data:`LATENT_KEYS`; FLUX.2's without
    ``pooled_projections``, which it has no pooled text for) as a ``.safetensors`` file."""
    from safetensors.torch import save_file

    needed = [key for key in LATENT_KEYS if key != "pooled_projections"]
    missing = [key for key in needed if key not in sample]
    if missing:
        raise ValueError(f"a latent sample needs {needed} (FLUX.1 also pooled_projections); missing {missing}")
    keys = [key for key in LATENT_KEYS if key in sample]
    save_file({key: sample[key].detach().contiguous().cpu() for key in keys}, str(path))


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
        sigma, noisy, velocity = flow_noise(sample["latents"], generator)
        model_sample = {
            "hidden_states": noisy,
            "timestep": sigma,
            **{key: sample[key] for key in LATENT_KEYS[1:] if key in sample},  # FLUX.2 has no pooled text
        }
        if guidance is not None:
            model_sample["guidance"] = torch.tensor(guidance, dtype=noisy.dtype)
        model_samples.append(model_sample)
        targets.append(velocity)
    return model_samples, targets


def latent_directory(path: str | Path, samples_per_rank: int = 1, repeat: bool = False) -> LatentDirectory:
    """A directory of FLUX latent samples (:data:`LATENT_KEYS`, as ``prepare_flux_latents.py``
    writes them), read and verified by :class:`~deepspeed_knap.models.latents.LatentDirectory`."""
    return LatentDirectory(path, samples_per_rank, repeat, check_file=check_latent_file,
                           writer="examples/prepare_flux_latents.py")  # fmt: skip
