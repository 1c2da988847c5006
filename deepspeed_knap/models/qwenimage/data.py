"""Data for Qwen-Image training steps: precomputed latents and text embeddings per sample, synthetic
(a bundled mix, edits with reference images included) or from ``.safetensors`` files, and the
flow-matching objective.

A *Qwen-Image latent sample* is a dict of unbatched tensors:

=========================  ===============  ========================================================
key                        shape            what
=========================  ===============  ========================================================
``latents``                ``[L0, C]``      the target image's packed VAE latents (2x2 patches,
                                            ``C = in_channels`` = 64), normalised as the pipeline
                                            un-normalises them: ``(z - latents_mean) / latents_std``
``encoder_hidden_states``  ``[Lt, Dj]``     the text encoder's rows as ``encode_prompt`` gives them
                                            (the template's prefix dropped, no padding; Dj = 3584)
``img_shapes``             ``[K, 3]``       post-patch grids ``(frames, height, width)`` of the
                                            target, then each reference; whole numbers, stored as
                                            floats (``L0 = f0 * h0 * w0``)
``reference_latents``      ``[Lr, C]``      with ``K > 1``: the references' packed latents,
                                            concatenated (``Lr`` = the other grids' tokens)
=========================  ===============  ========================================================

On disk one sample is one ``.safetensors`` file holding exactly these keys, floating point:
:func:`save_qwen_image_sample` writes one (``examples/prepare_qwen_image_latents.py`` from images and
captions), :func:`check_qwen_image_latent_file` says what is wrong with one, and
:func:`latent_directory` reads a directory of them (write its manifest with
:func:`~deepspeed_knap.models.latents.write_latent_manifest` after the samples).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.models.latents import (
    LatentDirectory,
    SyntheticMixLatents,
    flow_noise,
    near_square_grid,
    non_float_tensors,
    reference_sizes,
    sample_file_header,
)
from deepspeed_knap.models.qwenimage.qwenimage import rope_range_problem

QWEN_IMAGE_LATENT_KEYS = ("latents", "encoder_hidden_states", "img_shapes")
REFERENCE_KEY = "reference_latents"  # with more than one grid in img_shapes
WRITER = "save_qwen_image_sample of deepspeed_knap.models.qwenimage.data (examples/prepare_qwen_image_latents.py)"


def synthetic_qwen_image_samples(
    shapes: Sequence[SampleShape], config: Mapping, seed: int, token_scale: float = 1.0, dtype=torch.float32
) -> list[dict[str, Tensor]]:
    """Random Qwen-Image latent samples of a mix's sizes (``qwen_edit``: :attr:`SampleShape.segments`)
    scaled by ``token_scale``: at least one text and one image token; a sample with references keeps
    ``frames - 1`` reference images (at most one per reference token), their tokens split evenly; each
    image a near-square grid. A function of ``seed`` only."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(dtype)

    samples = []
    for shape in shapes:
        text, image, reference = shape.scaled(token_scale).segments
        grids = [near_square_grid(image)]
        if reference:
            grids += [near_square_grid(n) for n in reference_sizes(shape, reference)]
        sample = {
            "latents": randn(image, config["in_channels"]),
            "encoder_hidden_states": randn(max(text, 1), config["joint_attention_dim"]),
            # Whole numbers, in float32 as the preparation script writes them (bfloat16 would round
            # a 733-token side to 732, and the grids would no longer count the latent rows).
            "img_shapes": torch.tensor([(1, h, w) for h, w in grids], dtype=torch.float32),
        }
        if reference:
            sample[REFERENCE_KEY] = randn(reference, config["in_channels"])
        samples.append(sample)
    return samples


class SyntheticQwenImageLatents(SyntheticMixLatents):
    """Each step, each rank's Qwen-Image latent samples drawn from a bundled data mix (``qwen_edit``:
    text-to-image and edits with references), with random latents and text
    (:func:`synthetic_qwen_image_samples`)."""

    make_samples = staticmethod(synthetic_qwen_image_samples)


def check_qwen_image_latent_file(file: str | Path, config: Mapping) -> str | None:
    """What is wrong with one Qwen-Image latent sample file for a ``PackedQwenImageTransformer``
    ``config``, or ``None``. Reads the header (and the few numbers of ``img_shapes``): an unreadable
    file, missing or unexpected keys, non-float tensors, grids that are not whole positive numbers or
    do not count the latents' rows, widths that do not fit the model, RoPE positions (of the grids and
    the text rows) past diffusers' tables."""
    fix = f"write it again with {WRITER} or remove it"
    headers = sample_file_header(file, fix)
    if isinstance(headers, str):
        return headers
    missing = [key for key in QWEN_IMAGE_LATENT_KEYS if key not in headers]
    extra = sorted(set(headers) - {*QWEN_IMAGE_LATENT_KEYS, REFERENCE_KEY})
    if missing or extra:
        return (f"{file}: has keys {sorted(headers)}, missing {missing}, unexpected {extra}; a Qwen-Image latent "
                f"sample holds {list(QWEN_IMAGE_LATENT_KEYS)} and, for an edit, {REFERENCE_KEY}; {fix}")  # fmt: skip
    if problem := non_float_tensors(file, headers, fix):
        return problem
    shapes = {key: shape for key, (shape, _) in headers.items()}
    grids_shape = shapes["img_shapes"]
    if len(grids_shape) != 2 or grids_shape[1] != 3 or not 1 <= grids_shape[0] <= 64:
        return f"{file}: img_shapes is {list(grids_shape)}; expected [K, 3] with 1 <= K <= 64 images; {fix}"
    from safetensors import safe_open

    with safe_open(str(file), "pt") as handle:
        grids = handle.get_tensor("img_shapes").double()
    if not bool(((grids == grids.round()) & (grids >= 1)).all()):
        return f"{file}: img_shapes {grids.tolist()} must be whole numbers of at least 1 (frames, height, width); {fix}"
    tokens = [int(math.prod(row)) for row in grids.long().tolist()]
    width, text_width = config["in_channels"], config["joint_attention_dim"]
    flat = {key: list(shape) for key, shape in shapes.items() if key != "img_shapes" and len(shape) != 2}
    if flat:  # (a 0-d tensor would stop the indexing below on this rank alone)
        return f"{file}: {flat} must be [rows, width] (2-D); {fix}"
    text_rows = shapes["encoder_hidden_states"][0]
    expected = {"latents": (tokens[0], width), "encoder_hidden_states": (text_rows, text_width)}
    if len(tokens) > 1 or REFERENCE_KEY in shapes:
        expected[REFERENCE_KEY] = (sum(tokens[1:]), width)
    wrong = {key: f"{list(shapes.get(key, ()))} (expected {list(shape)})" for key, shape in expected.items()
             if tuple(shapes.get(key, ())) != shape}  # fmt: skip
    if wrong or shapes["encoder_hidden_states"][0] < 1:
        return (f"{file}: shapes {wrong or {'encoder_hidden_states': list(shapes['encoder_hidden_states'])}} do not fit "
                f"img_shapes {grids.long().tolist()} and the model (in_channels={width}, joint_attention_dim="
                f"{text_width}; at least one text row); {fix}")  # fmt: skip
    if problem := rope_range_problem([tuple(row) for row in grids.long().tolist()], text_rows):
        return f"{file}: {problem}; {fix}"
    return None


def save_qwen_image_sample(path: str | Path, sample: Mapping[str, Tensor]) -> None:
    """Write one Qwen-Image latent sample (:data:`QWEN_IMAGE_LATENT_KEYS`, and ``reference_latents``
    for an edit) as a ``.safetensors`` file. Write the directory's manifest after the last sample.

    Raises:
        ValueError: a missing or unexpected key.
    """
    from safetensors.torch import save_file

    missing = [key for key in QWEN_IMAGE_LATENT_KEYS if sample.get(key) is None]
    extra = sorted(set(sample) - {*QWEN_IMAGE_LATENT_KEYS, REFERENCE_KEY})
    if missing or extra:
        raise ValueError(f"a Qwen-Image latent sample holds {list(QWEN_IMAGE_LATENT_KEYS)} and optionally "
                         f"{REFERENCE_KEY}; this one has {sorted(sample)}")  # fmt: skip
    save_file({key: tensor.detach().contiguous().cpu() for key, tensor in sample.items()}, str(path))


def latent_directory(path: str | Path, samples_per_rank: int = 1, repeat: bool = False) -> LatentDirectory:
    """A directory of Qwen-Image latent samples (:func:`save_qwen_image_sample`'s files), read and
    verified by :class:`~deepspeed_knap.models.latents.LatentDirectory`."""
    return LatentDirectory(path, samples_per_rank, repeat, check_file=check_qwen_image_latent_file, writer=WRITER)


def flow_matching(
    samples: Sequence[Mapping[str, Tensor]], generator: torch.Generator
) -> tuple[list[dict[str, Tensor]], list[Tensor]]:
    """The flow-matching objective of Qwen-Image fine-tuning, per latent sample: logit-normal ``sigma
    = sigmoid(n)``, ``n ~ N(0, 1)``; ``noisy = (1 - sigma) * x0 + sigma * noise`` on the target's
    tokens; the model sees ``[noisy | clean references]`` at timestep ``sigma`` (the pipelines'
    ``t / 1000``) and must predict ``noise - x0``, the velocity ``QwenImagePipeline``'s Euler
    scheduler integrates. References and text are clean conditioning; the model's output is the
    target's tokens only.

    Returns:
        ``(model_samples, targets)``: per-sample inputs for ``PackedQwenImageTransformer.pack`` and
        the ``[L0, C]`` targets.
    """
    model_samples, targets = [], []
    for sample in samples:
        sigma, noisy, velocity = flow_noise(sample["latents"], generator)
        hidden = noisy if REFERENCE_KEY not in sample else torch.cat([noisy, sample[REFERENCE_KEY].to(noisy.dtype)])
        model_samples.append({"hidden_states": hidden, "timestep": sigma,
                              "encoder_hidden_states": sample["encoder_hidden_states"],
                              "img_shapes": sample["img_shapes"].round().long()})  # fmt: skip
        targets.append(velocity)
    return model_samples, targets
