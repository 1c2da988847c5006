"""Data for FLUX.3 training steps: precomputed latents and text embeddings per sample, synthetic (a
bundled mix, references included) or from ``.safetensors`` files, and the rectified-flow objective.

A *FLUX.3 latent sample* is a dict of unbatched tensors, named as
:meth:`~deepspeed_knap.models.flux3.PackedFlux3Transformer.pack` takes them except ``latents`` (the
clean image, which the objective noises into ``hidden_states``):

============================  ===============  ===============================================
key                           shape            what
============================  ===============  ===============================================
``latents``                   ``[L, C]``       packed VAE latents of the target image (FLUX.3:
                                               2x2 patches, ``C = in_channels`` = 128)
``img_ids``                   ``[L, 4]``       positions ``(0, h / 2, w / 2, 0)`` (:func:`flux3_image_ids`)
``encoder_hidden_states``     ``[Lt, Dj]``     text-encoder rows (FLUX.3: Qwen3-VL, Dj = 20480),
                                               ``Lt >= 1``
``txt_ids``                   ``[Lt, 4]``      positions ``(0, 0, 0, l)``
``image_cond_hidden_states``  ``[Lr, Cr]``     optional: packed latents of the reference images,
                                               concatenated (``Cr = cond_in_channels``)
``image_cond_ids``            ``[Lr, 4]``      with them: reference ``i`` at ``(0, h / 2, w / 2, -1 - i)``
============================  ===============  ===============================================

On disk one sample is one ``.safetensors`` file holding exactly these keys, floating point (the
references and their ids both or neither): :func:`save_flux3_sample` writes one,
:func:`check_flux3_latent_file` says what is wrong with one, and :func:`latent_directory` reads a
directory of them (:class:`~deepspeed_knap.models.latents.LatentDirectory`; write its manifest with
:func:`write_latent_manifest`, re-exported here, after the samples).
``examples/prepare_flux3_latents.py`` writes them from images and captions (and reference images)
with diffusers' modular FLUX.3 pipeline's own parts: its latents are the pipeline's (normalised by
the VAE's batch-norm statistics, patchified: :func:`flux3_latent_tokens`), what its decode undoes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.models.flux.base import text_ids
from deepspeed_knap.models.flux.data import latent_sample_shapes
from deepspeed_knap.models.latents import (
    LatentDirectory,
    SyntheticMixLatents,
    flow_noise,
    near_square_grid,
    non_float_tensors,
    reference_sizes,
    sample_file_header,
    write_latent_manifest,
)

__all__ = [
    "FLUX3_LATENT_KEYS",
    "FLUX3_REFERENCE_KEYS",
    "SyntheticFlux3Latents",
    "check_flux3_latent_file",
    "flux3_image_ids",
    "flux3_latent_tokens",
    "flux3_reference_tokens",
    "flux3_sample_shapes",
    "latent_directory",
    "rectified_flow",
    "save_flux3_sample",
    "synthetic_flux3_samples",
    "write_latent_manifest",
]

FLUX3_LATENT_KEYS = ("latents", "img_ids", "encoder_hidden_states", "txt_ids")
FLUX3_REFERENCE_KEYS = ("image_cond_hidden_states", "image_cond_ids")  # optional, together
WRITER = "save_flux3_sample and write_latent_manifest of deepspeed_knap.models.flux3.data"


def flux3_image_ids(height: int, width: int, reference: int | None = None) -> Tensor:
    """``[height * width, 4]`` float32 positions of a latent grid, row by row, as diffusers' modular
    FLUX.3 pipeline makes them (``before_denoise._prepare_image_ids`` with ``image_rope_scale=0.5``):
    ``(0, h / 2, w / 2, 0)`` for the generated image, ``(0, h / 2, w / 2, -1 - i)`` for reference
    image ``i`` (from 0). Half positions: FLUX.3's RoPE takes fractional ids (FLUX.2's are whole)."""
    h, w = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    layer = 0 if reference is None else -1 - reference
    ids = torch.stack([torch.zeros_like(h), h, w, torch.full_like(h, layer)], dim=-1).reshape(-1, 4).float()
    ids[:, 1:3] *= 0.5
    return ids


def flux3_latent_tokens(latents: Tensor, reference: int | None = None) -> tuple[Tensor, Tensor]:
    """``(tokens [h * w, C], ids [h * w, 4])`` of one image's packed latents ``[1, C, h, w]`` as the
    modular pipeline's VAE encoder step gives them (normalised, patchified): row by row, as its
    prepare steps flatten them and its decode reads them back; ids :func:`flux3_image_ids` (of
    reference image ``reference``, or the generated image)."""
    return latents[0].flatten(1).T, flux3_image_ids(*latents.shape[-2:], reference=reference)


def flux3_reference_tokens(latents: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """``(image_cond_hidden_states [Lr, Cr], image_cond_ids [Lr, 4])``: reference images' packed
    latents (each ``[1, Cr, h_i, w_i]``) concatenated in order, reference ``i`` at
    ``(0, h / 2, w / 2, -1 - i)``, as ``Flux3PrepareImageCondLatentsStep`` joins them."""
    tokens, ids = zip(*(flux3_latent_tokens(grid, index) for index, grid in enumerate(latents)), strict=True)
    return torch.cat(tokens), torch.cat(ids)


def flux3_sample_shapes(config: Mapping, image: int, text: int, reference: int = 0) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of one FLUX.3 latent sample with these token counts, for a model
    ``config`` (the reference keys only when ``reference`` > 0): FLUX.1's and FLUX.2's
    (:func:`~deepspeed_knap.models.flux.data.latent_sample_shapes`), and the references'."""
    shapes = latent_sample_shapes(config, image, text)
    if reference:
        axes = len(config["axes_dims_rope"])
        shapes.update(
            image_cond_hidden_states=(reference, config["cond_in_channels"]), image_cond_ids=(reference, axes)
        )
    return shapes


def check_flux3_latent_file(file: str | Path, config: Mapping) -> str | None:
    """What is wrong with one FLUX.3 latent sample file for a ``PackedFlux3Transformer`` ``config``,
    or ``None``. Reads only the header: an unreadable file, missing or unexpected keys, references
    without their ids (or ids without them), non-float tensors, an image or text of zero tokens,
    shapes that do not fit each other or the model."""
    fix = f"write it again with {WRITER} or remove it"
    headers = sample_file_header(file, fix)
    if isinstance(headers, str):
        return headers
    allowed = FLUX3_LATENT_KEYS + FLUX3_REFERENCE_KEYS
    missing = [key for key in FLUX3_LATENT_KEYS if key not in headers]
    extra = sorted(set(headers) - set(allowed))
    if missing or extra:
        return (f"{file}: has keys {sorted(headers)}, missing {missing}, unexpected {extra}; a FLUX.3 latent sample "
                f"holds {list(FLUX3_LATENT_KEYS)} and optionally {list(FLUX3_REFERENCE_KEYS)}; {fix}")  # fmt: skip
    refs = [key in headers for key in FLUX3_REFERENCE_KEYS]
    if refs[0] != refs[1]:
        given, absent = FLUX3_REFERENCE_KEYS[:: 1 if refs[0] else -1]
        return f"{file}: has {given} without {absent}: reference latents and their position ids come together; {fix}"
    if problem := non_float_tensors(file, headers, fix):
        return problem
    rows = {key: shape[0] if len(shape) == 2 else -1 for key, (shape, _) in headers.items()}
    image, text, reference = rows["latents"], rows["encoder_hidden_states"], rows.get("image_cond_hidden_states", 0)
    if min(image, text) < 1 or (refs[0] and reference < 1):
        tensors = {key: list(headers[key][0]) for key in ("latents", "encoder_hidden_states", *FLUX3_REFERENCE_KEYS[:1])
                   if key in headers}  # fmt: skip
        return (f"{file}: {tensors} must be [L, C], [Lt, Dj] (and [Lr, Cr]) with at least one token each: FLUX.3 "
                f"attends within each mode, so an empty image, text or reference has nothing to attend to; {fix}")  # fmt: skip
    expected = flux3_sample_shapes(config, image, text, reference if refs[0] else 0)
    wrong = {key: f"{list(headers[key][0])} (expected {list(shape)})" for key, shape in expected.items()
             if headers[key][0] != shape}  # fmt: skip
    if wrong:
        dims = ", ".join(f"{key}={config[key]}" for key in ("in_channels", "cond_in_channels", "joint_attention_dim"))
        return f"{file}: shapes {wrong} do not fit the model ({dims}, {len(config['axes_dims_rope'])} position axes); {fix}"
    return None


def save_flux3_sample(path: str | Path, sample: Mapping[str, Tensor]) -> None:
    """Write one FLUX.3 latent sample (:data:`FLUX3_LATENT_KEYS`, and :data:`FLUX3_REFERENCE_KEYS`
    when it has references) as a ``.safetensors`` file. Write the directory's manifest after the
    last sample (:func:`write_latent_manifest`).

    Raises:
        ValueError: a missing key, references without their ids (or the reverse), or another key.
    """
    from safetensors.torch import save_file

    missing = [key for key in FLUX3_LATENT_KEYS if sample.get(key) is None]
    refs = [sample.get(key) is not None for key in FLUX3_REFERENCE_KEYS]
    extra = sorted(set(sample) - set(FLUX3_LATENT_KEYS + FLUX3_REFERENCE_KEYS))
    if missing or refs[0] != refs[1] or extra:
        raise ValueError(f"a FLUX.3 latent sample holds {list(FLUX3_LATENT_KEYS)} and optionally both of "
                         f"{list(FLUX3_REFERENCE_KEYS)}; this one has {sorted(sample)}")  # fmt: skip
    keys = FLUX3_LATENT_KEYS + (FLUX3_REFERENCE_KEYS if refs[0] else ())
    save_file({key: sample[key].detach().contiguous().cpu() for key in keys}, str(path))


def latent_directory(path: str | Path, samples_per_rank: int = 1, repeat: bool = False) -> LatentDirectory:
    """A directory of FLUX.3 latent samples (:func:`save_flux3_sample`'s files), read and verified by
    :class:`~deepspeed_knap.models.latents.LatentDirectory`."""
    return LatentDirectory(path, samples_per_rank, repeat, check_file=check_flux3_latent_file, writer=WRITER)


def synthetic_flux3_samples(
    shapes: Sequence[SampleShape], config: Mapping, seed: int, token_scale: float = 1.0, dtype=torch.float32
) -> list[dict[str, Tensor]]:
    """Random FLUX.3 latent samples of a mix's sizes (``flux3_edit``: :attr:`SampleShape.segments`)
    scaled by ``token_scale``: at least one text and one image token, and a sample with references
    keeps ``frames - 1`` reference images (at most one per reference token), their tokens split
    evenly; each image a near-square grid with the pipeline's ids. A function of ``seed`` only."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(dtype)

    samples = []
    for shape in shapes:
        text, image, reference = shape.scaled(token_scale).segments
        text = max(text, 1)
        sample = {
            "latents": randn(image, config["in_channels"]),
            "img_ids": flux3_image_ids(*near_square_grid(image)),
            "encoder_hidden_states": randn(text, config["joint_attention_dim"]),
            "txt_ids": text_ids(text),
        }
        if reference:
            sample["image_cond_hidden_states"] = randn(reference, config["cond_in_channels"])
            grids = [near_square_grid(n) for n in reference_sizes(shape, reference)]
            sample["image_cond_ids"] = torch.cat([flux3_image_ids(*grid, i) for i, grid in enumerate(grids)])
        samples.append(sample)
    return samples


class SyntheticFlux3Latents(SyntheticMixLatents):
    """Each step, each rank's FLUX.3 latent samples drawn from a bundled data mix (``flux3_edit``:
    text-to-image and edits with references), with random latents and text (:func:`synthetic_flux3_samples`)."""

    make_samples = staticmethod(synthetic_flux3_samples)


def rectified_flow(
    samples: Sequence[Mapping[str, Tensor]], generator: torch.Generator
) -> tuple[list[dict[str, Tensor]], list[Tensor]]:
    """The flow-matching objective of FLUX.3 fine-tuning, per latent sample: FLUX's (logit-normal
    ``sigma = sigmoid(n)``, ``n ~ N(0, 1)``; ``noisy = (1 - sigma) * x0 + sigma * noise``; the model
    sees ``noisy`` at timestep ``sigma``, diffusers' ``[0, 1]`` scale, and must predict ``noise - x0``,
    the velocity the modular pipeline's Euler scheduler integrates) on the image tokens only: the
    references and the text are clean conditioning, and the model gives no output for them.

    Not for flow-map (step-distilled) checkpoints, which also take the timestep they jump to
    (``target_timestep``) and learn another objective.

    Returns:
        ``(model_samples, targets)``: per-sample inputs for ``PackedFlux3Transformer.pack`` and the
        ``[L, C]`` targets of the image tokens.
    """
    model_samples, targets = [], []
    for sample in samples:
        sigma, noisy, velocity = flow_noise(sample["latents"], generator)
        model_samples.append({
            "hidden_states": noisy,
            "timestep": sigma,
            **{key: sample[key] for key in FLUX3_LATENT_KEYS[1:] + FLUX3_REFERENCE_KEYS if key in sample},
        })  # fmt: skip
        targets.append(velocity)
    return model_samples, targets
