"""Bundled synthetic data mixes: per-rank sequence lengths of one training step, by name.

Token counts follow FLUX-style latents: an 8x VAE and 2x2 patches give one token per 16x16 pixels
(a 1024px square image is 64 * 64 = 4,096 tokens), and video VAEs compress 4 frames into one latent
frame, ``(frames - 1) / 4 + 1``. A sequence is its text tokens plus its image/video tokens.

* ``kf_lowres``, ``kf_mixed_res``, ``kf_image_video``: the three 32-GPU mixes of the KnapFormer
  paper, from the data codes of its reference simulator. A code ``g{gpus}b{batch}i{res}f{frames}s{0|1}``
  gives ``gpus`` ranks ``batch`` samples of ``res``-pixel squares with ``frames`` frames; ``s1``
  marks video, whose temporal tokens are ``max(int(frames / 3.4), 1)`` (the simulator's 17 -> 5
  rule), ``s0`` keeps ``frames`` as is (keyframe stacks). Each step a rank scales its visual tokens by
  one factor drawn from U[0.96, 1.04] (aspect jitter); each sample draws its own text length from
  U{0..392}. On other than 32 GPUs, rank ``r`` takes the code of rank ``r * 32 // num_gpus``, so the
  proportions hold.
* ``long_video``: one video per rank per step: 480p (480x832, 1,560 tokens per latent frame) with
  probability 0.6, else 720p (720x1280, 3,600); 33 to 129 frames in steps of 16 (9 to 33 latent
  frames); text U{1..512}. From 14,040 to 118,800 visual tokens.

The families' own mixes (``flux_buckets``, ``flux2_buckets``, ``flux2_edit``, ``flux3_edit``,
``wan_image_video``, ...) live in their specs (``deepspeed_knap/models/<family>/spec.py``);
:mod:`deepspeed_knap.models.registry` holds every mix by name (``MIXES``, ``sample_mix``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PAPER_GPUS = 32


@dataclass(frozen=True)
class SampleShape:
    """One sample's tokens: ``text`` text tokens and ``visual`` image/video latent tokens over
    ``frames`` latent frames (1 for an image), which make up its sequence; and ``cross_text`` text
    tokens it attends to by cross-attention, outside the sequence (Wan: 512; 0 for the FLUX mixes,
    whose text is in the sequence)."""

    text: int
    visual: int
    frames: int
    cross_text: int = 0
    reference: int = 0  # of the visual tokens, those of reference images (FLUX.3 editing; 0 elsewhere)

    @property
    def length(self) -> int:
        return self.text + self.visual

    @property
    def segments(self) -> tuple[int, int, int]:
        """``(text, image, reference)`` tokens: the sequence's attention segments in FLUX.3's order
        (``Flux3Inputs.segments``), summing to :attr:`length`."""
        return self.text, self.visual - self.reference, self.reference

    def scaled(self, token_scale: float) -> SampleShape:
        """Text and visual tokens times ``token_scale``, rounded, keeping at least one visual token
        (and one image token beside the references; small stand-ins for CPU runs of the same mix)."""
        reference = round(self.reference * token_scale)
        visual = max(reference + 1 if self.reference else 1, round(self.visual * token_scale))
        return SampleShape(round(self.text * token_scale), visual, self.frames, round(self.cross_text * token_scale),
                           reference)  # fmt: skip


@dataclass(frozen=True)
class _DataCode:
    gpus: int
    batch: int
    resolution: int
    frames: int
    video: bool

    @property
    def visual_tokens(self) -> int:
        temporal = max(int(self.frames / 3.4), 1) if self.video else self.frames
        return (self.resolution // 16) ** 2 * temporal


def _parse_codes(codes: str) -> list[_DataCode]:
    parsed = []
    for code in codes.split(","):
        g, b, i, f, s = map(int, re.fullmatch(r"g(\d+)b(\d+)i(\d+)f(\d+)s([01])", code).groups())
        parsed.append(_DataCode(g, b, i, f, bool(s)))
    assert sum(c.gpus for c in parsed) == PAPER_GPUS, codes
    return parsed


_PAPER_MIXES = {
    "kf_lowres": _parse_codes("g32b32i256f1s0"),
    "kf_mixed_res": _parse_codes("g16b4i256f1s0,g4b5i512f1s0,g4b5i1024f1s0,g8b1i2048f1s0"),
    "kf_image_video": _parse_codes(
        "g8b4i256f1s0,g2b5i512f1s0,g2b5i1024f1s0,g4b1i2048f1s0,g1b10i256f4s0,g3b1i512f4s0,g8b2i256f85s1,g4b1i512f85s1"
    ),
}


def _paper_mix(codes: list[_DataCode]) -> Callable[[int, np.random.Generator], list[list[SampleShape]]]:
    code_of_paper_rank = [code for code in codes for _ in range(code.gpus)]

    def sample(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
        shapes = []
        for rank in range(num_gpus):
            code = code_of_paper_rank[rank * PAPER_GPUS // num_gpus]
            visual = int(code.visual_tokens * rng.uniform(0.96, 1.04))
            frames = max(int(code.frames / 3.4), 1) if code.video else code.frames
            shapes.append([SampleShape(int(text), visual, frames) for text in rng.integers(0, 393, size=code.batch)])
        return shapes

    return sample


ASPECTS = [(1, 1), (9, 7), (7, 9), (19, 13), (13, 19), (7, 4), (4, 7), (12, 5), (5, 12)]


def fill_ranks(num_gpus: int, rng: np.random.Generator, draw: Callable[[np.random.Generator], SampleShape],
               visual_tokens: int = 16384) -> list[list[SampleShape]]:  # fmt: skip
    """``num_gpus`` ranks' samples, each rank drawing samples (``draw(rng)``) until its visual tokens
    reach ``visual_tokens``: the editing mixes' step, where samples of a few large images each fill
    ranks unevenly."""
    shapes = []
    for _ in range(num_gpus):
        samples, visual_total = [], 0
        while not samples or visual_total < visual_tokens:
            samples.append(draw(rng))
            visual_total += samples[-1].visual
        shapes.append(samples)
    return shapes


def bucket_tokens(rng: np.random.Generator) -> int:
    """Image tokens of one aspect-ratio bucket: base 512 / 768 / 1024 px (0.3 / 0.3 / 0.4) times
    one of nine aspect ratios, sides rounded to 64 px."""
    base = rng.choice([512, 768, 1024], p=[0.3, 0.3, 0.4])
    wide, tall = ASPECTS[rng.integers(len(ASPECTS))]
    scale = base / np.sqrt(wide * tall)
    width, height = (max(64, round(side * scale / 64) * 64) for side in (wide, tall))
    return (width // 16) * (height // 16)


def _long_video(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    shapes = []
    for _ in range(num_gpus):
        per_latent_frame = 1560 if rng.random() < 0.6 else 3600
        frames = int(rng.choice(np.arange(33, 130, 16)))
        latent_frames = (frames - 1) // 4 + 1
        shapes.append([SampleShape(int(rng.integers(1, 513)), per_latent_frame * latent_frames, latent_frames)])
    return shapes


Mix = Callable[[int, np.random.Generator], list[list[SampleShape]]]

# The mixes of no one family: the KnapFormer paper's three, and long videos.
SHARED_MIXES: dict[str, Mix] = {
    **{name: _paper_mix(codes) for name, codes in _PAPER_MIXES.items()},
    "long_video": _long_video,
}


def draw_shapes(mix: Mix, num_gpus: int, seed: int | np.random.Generator = 0) -> list[list[SampleShape]]:
    """One step of ``mix``: ``num_gpus`` lists of samples, one per rank.

    Args:
        mix: a mix (a function of the GPU count and a generator).
        num_gpus: ranks in the balance group.
        seed: seed or generator; the same seed gives the same samples.
    """
    if num_gpus <= 0:
        raise ValueError(f"num_gpus must be positive; got {num_gpus}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return mix(num_gpus, rng)
