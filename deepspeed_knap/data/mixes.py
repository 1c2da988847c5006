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
* ``flux_buckets``: FLUX fine-tuning with aspect-ratio buckets. Each rank draws one bucket per step
  (a bucketed loader gives a batch one shape): base resolution 512 / 768 / 1024 (weights 0.3 / 0.3 /
  0.4) times one of nine aspect ratios from 1:1 to 12:5 either way, sides rounded to 64 px; the batch
  holds as many images as fit 16,384 image tokens (at least one); text U{64..512} per sample.
* ``long_video``: one video per rank per step: 480p (480x832, 1,560 tokens per latent frame) with
  probability 0.6, else 720p (720x1280, 3,600); 33 to 129 frames in steps of 16 (9 to 33 latent
  frames); text U{1..512}. From 14,040 to 118,800 visual tokens.
* ``flux2_buckets``: ``flux_buckets`` for FLUX.2, whose image tokens are the same (its VAE is 8x
  and latents are patched 2x2) but whose text is always 512 tokens: the pipeline pads the Mistral
  prompt to 512 and the transformer attends to the padding too.
* ``flux2_edit``: FLUX.2 multi-reference editing. A sample is a target image (a bucket as above),
  1 to 4 reference images (each a bucket, at most 1024x1024 px as the pipeline resizes them:
  4,096 tokens) and 512 text tokens; ``frames`` counts the images. Each rank holds samples until
  its image tokens reach 16,384.
* ``wan_image_video``: Wan 2.1 joint image + video training at 480p and 720p. The planner's
  sequence is the video tokens alone: Wan's text enters by cross-attention, not in the sequence, so
  a sample's 512 text rows are :attr:`SampleShape.cross_text` and its ``text`` is 0. Each sample is
  480p (832x480: 30 x 52 = 1,560 tokens per latent frame) or 720p (1280x720: 45 x 80 = 3,600),
  even odds, and an image (one latent frame) with probability 0.3, else a clip of ``4k + 1`` frames:
  81 (Wan's 5-second clips at 16 fps; 21 latent frames: 32,760 or 75,600 tokens) with probability
  0.5, else 17 to 77 (5 to 20 latent frames) uniformly. A rank draws samples until one would take
  its video tokens over 75,600 (one 720p 81-frame clip), and drops that one (its first sample always
  stays); images fill the gaps clips leave, so about 40% of the samples a step holds are images. Sources
  and assumptions at :func:`_wan_image_video`.
* ``flux3_edit``: FLUX.3 text-to-image plus editing with 1 to 3 reference images at mixed
  resolutions. A sample is text (a prompt's chat-templated tokens right-padded to a multiple of 80),
  a target image and its references, three attention segments (:attr:`SampleShape.segments`: the
  per-mode blocks attend within each). Half the samples are text-to-image (a bucket as above); the
  edits have one reference (0.5), kept whole up to 4 megapixels (16,384 tokens) with the target on
  its canvas, or two (0.3) or three (0.2), each fitted under 1 megapixel (4,096 tokens) with the
  target a bucket. Each rank holds samples until its image tokens (targets and references) reach
  16,384. Sources and assumptions at :data:`FLUX3_TEXT_PAD`.
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


_ASPECTS = [(1, 1), (9, 7), (7, 9), (19, 13), (13, 19), (7, 4), (4, 7), (12, 5), (5, 12)]


def _bucket_tokens(rng: np.random.Generator) -> int:
    """Image tokens of one aspect-ratio bucket: base 512 / 768 / 1024 px (0.3 / 0.3 / 0.4) times
    one of nine aspect ratios, sides rounded to 64 px."""
    base = rng.choice([512, 768, 1024], p=[0.3, 0.3, 0.4])
    wide, tall = _ASPECTS[rng.integers(len(_ASPECTS))]
    scale = base / np.sqrt(wide * tall)
    width, height = (max(64, round(side * scale / 64) * 64) for side in (wide, tall))
    return (width // 16) * (height // 16)


def _flux_buckets(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    shapes = []
    for _ in range(num_gpus):
        visual = _bucket_tokens(rng)
        batch = max(1, 16384 // visual)
        shapes.append([SampleShape(int(text), visual, 1) for text in rng.integers(64, 513, size=batch)])
    return shapes


# FLUX.2's text encoder output is padded to 512 tokens, and its transformer attends to all of them.
FLUX2_TEXT_TOKENS = 512


def _flux2_buckets(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    return [[SampleShape(FLUX2_TEXT_TOKENS, visual, 1) for _ in range(max(1, 16384 // visual))]
            for visual in (_bucket_tokens(rng) for _ in range(num_gpus))]  # fmt: skip


def _flux2_edit(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    shapes = []
    for _ in range(num_gpus):
        samples, visual_total = [], 0
        while not samples or visual_total < 16384:
            references = int(rng.integers(1, 5))
            visual = _bucket_tokens(rng) + sum(min(4096, _bucket_tokens(rng)) for _ in range(references))
            samples.append(SampleShape(FLUX2_TEXT_TOKENS, visual, 1 + references))
            visual_total += visual
        shapes.append(samples)
    return shapes


def _long_video(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    shapes = []
    for _ in range(num_gpus):
        per_latent_frame = 1560 if rng.random() < 0.6 else 3600
        frames = int(rng.choice(np.arange(33, 130, 16)))
        latent_frames = (frames - 1) // 4 + 1
        shapes.append([SampleShape(int(rng.integers(1, 513)), per_latent_frame * latent_frames, latent_frames)])
    return shapes


# Wan 2.1 joint image + video training. Sources: the Wan technical report (arXiv 2503.20314, section
# "Image-video joint training"): after 256px text-to-image pre-training, joint training of images
# and 5-second videos in stages of rising resolution, 256px/192px, then 480px, then 720px, images and
# videos at the same resolution; the released models generate 832x480 and 1280x720 at 16 fps, 81
# frames (Wan-Video/Wan2.1 README and generate.py; wan/configs/shared_config.py: sample_fps 16,
# text_len 512). Wan's VAE compresses 4x in time and 8x in space, and the DiT patches (1, 2, 2):
# (1 + (frames - 1) / 4) * (H / 16) * (W / 16) tokens, e.g. 81 frames at 720p = 21 * 45 * 80 =
# 75,600, and an image (1 frame) one latent frame. (Wan 2.2 TI2V-5B's VAE compresses 16x in space:
# a quarter of these tokens.) Assumptions, not from the report, which gives no ratios: the image
# share (0.3 of the samples), 480p and 720p at even odds (a fine-tuning mix of both stages' data), and
# half the clips shorter than 81 frames (short source videos kept whole, 4k + 1 frames, as trainers
# such as musubi-tuner's frame buckets do), and the 75,600-token budget per rank.
WAN_TEXT_TOKENS = 512
WAN_IMAGE_SHARE = 0.3
_WAN_TOKENS_PER_LATENT_FRAME = (30 * 52, 45 * 80)  # 832x480, 1280x720 over 16x16 pixels per token
_WAN_RANK_TOKENS = 21 * 45 * 80


def wan_tokens(frames: int, height: int, width: int) -> int:
    """Wan 2.1's video tokens of ``frames`` frames (``4k + 1``) of ``height x width`` pixels
    (multiples of 16): ``(1 + (frames - 1) / 4) * (height / 16) * (width / 16)``."""
    if frames < 1 or (frames - 1) % 4 or height % 16 or width % 16:
        raise ValueError(f"Wan takes 4k + 1 frames of multiples of 16 pixels; got {frames} frames of {height}x{width}")
    return (1 + (frames - 1) // 4) * (height // 16) * (width // 16)


def _wan_sample(rng: np.random.Generator) -> SampleShape:
    per_latent_frame = _WAN_TOKENS_PER_LATENT_FRAME[int(rng.integers(2))]
    if rng.random() < WAN_IMAGE_SHARE:
        latent_frames = 1
    elif rng.random() < 0.5:
        latent_frames = 21  # 81 frames
    else:
        latent_frames = int(rng.integers(5, 21))  # 17 to 77 frames
    return SampleShape(0, per_latent_frame * latent_frames, latent_frames, WAN_TEXT_TOKENS)


def _wan_image_video(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    shapes = []
    for _ in range(num_gpus):
        samples = [_wan_sample(rng)]
        tokens = samples[0].visual
        while True:
            sample = _wan_sample(rng)
            if tokens + sample.visual > _WAN_RANK_TOKENS:
                break
            samples.append(sample)
            tokens += sample.visual
        shapes.append(samples)
    return shapes


# FLUX.3. Sources: diffusers 0.42.1's FLUX.3 modular pipeline (diffusers/modular_pipelines/flux3):
# the text encoder step (Qwen3-VL, encoders.py) right-pads the chat-templated prompt to a multiple of
# 80 tokens (pad_multiple=80; the transformer attends to the padding), capped at 8,192; one
# reference image is kept whole, downscaled only to fit its 16-pixel-grid canvas under 4 megapixels
# (sides at most 4,096 px: 16,384 tokens), and the generation defaults to that canvas; each of
# several references is fitted under 1 megapixel (4,096 tokens) and cropped to the grid
# (image_processor.py, Flux3ProcessImagesInputStep). Tokens: 16x16 pixels each (8x VAE, 2x2
# patches, as FLUX.2). Assumptions, not from the pipeline, which gives no training data: half the
# samples text-to-image; edits with 1, 2 or 3 references at 0.5 / 0.3 / 0.2; a single reference a
# bucket as flux_buckets' (512 / 768 / 1024 px base) or, with probability 0.25, a 2048 px-base one
# (about 4 megapixels, the pipeline's limit); prompts of 20 to 400 tokens before padding; 16,384
# image tokens per rank, as flux2_edit.
FLUX3_TEXT_PAD = 80
FLUX3_EDIT_SHARE = 0.5
_FLUX3_REFERENCE_COUNTS = ((1, 0.5), (2, 0.3), (3, 0.2))
_FLUX3_WHOLE_REFERENCE_TOKENS = 4 * 1024 * 1024 // 256  # 4 megapixels over 16x16 pixels per token
_FLUX3_REFERENCE_TOKENS = 1024 * 1024 // 256  # 1 megapixel


def _flux3_sample(rng: np.random.Generator) -> SampleShape:
    text = -(-int(rng.integers(20, 401)) // FLUX3_TEXT_PAD) * FLUX3_TEXT_PAD
    if rng.random() >= FLUX3_EDIT_SHARE:
        return SampleShape(text, _bucket_tokens(rng), 1)
    counts, odds = zip(*_FLUX3_REFERENCE_COUNTS, strict=True)
    references = int(rng.choice(counts, p=odds))
    if references == 1:  # kept whole on its canvas, and the target on the same canvas
        if rng.random() < 0.25:
            wide, tall = _ASPECTS[rng.integers(len(_ASPECTS))]
            scale = 2048 / np.sqrt(wide * tall)
            width, height = (round(side * scale / 64) * 64 for side in (wide, tall))
            tokens = min((width // 16) * (height // 16), _FLUX3_WHOLE_REFERENCE_TOKENS)
        else:
            tokens = _bucket_tokens(rng)
        return SampleShape(text, 2 * tokens, 2, reference=tokens)
    reference = sum(min(_FLUX3_REFERENCE_TOKENS, _bucket_tokens(rng)) for _ in range(references))
    return SampleShape(text, _bucket_tokens(rng) + reference, 1 + references, reference=reference)


def _flux3_edit(num_gpus: int, rng: np.random.Generator) -> list[list[SampleShape]]:
    shapes = []
    for _ in range(num_gpus):
        samples, visual_total = [], 0
        while not samples or visual_total < 16384:
            samples.append(_flux3_sample(rng))
            visual_total += samples[-1].visual
        shapes.append(samples)
    return shapes


MIXES: dict[str, Callable[[int, np.random.Generator], list[list[SampleShape]]]] = {
    **{name: _paper_mix(codes) for name, codes in _PAPER_MIXES.items()},
    "flux_buckets": _flux_buckets,
    "long_video": _long_video,
    "flux2_buckets": _flux2_buckets,
    "flux2_edit": _flux2_edit,
    "wan_image_video": _wan_image_video,
    "flux3_edit": _flux3_edit,
}


def sample_mix(name: str, num_gpus: int, seed: int | np.random.Generator = 0) -> list[list[int]]:
    """Sequence lengths of one step: ``num_gpus`` lists, one per rank.

    Args:
        name: a key of :data:`MIXES`.
        num_gpus: ranks in the balance group.
        seed: seed or generator; the same seed gives the same lengths.
    """
    return [[shape.length for shape in rank] for rank in sample_shapes(name, num_gpus, seed)]


def sample_segments(name: str, num_gpus: int, seed: int | np.random.Generator = 0) -> list[list[tuple[int, int, int]]]:
    """:func:`sample_mix`'s sequences as attention segments, ``(text, image, reference)`` tokens each
    (:attr:`SampleShape.segments`; the planner's ``seq_segments_per_rank``). Same arguments, same
    lengths."""
    return [[shape.segments for shape in rank] for rank in sample_shapes(name, num_gpus, seed)]


def sample_shapes(name: str, num_gpus: int, seed: int | np.random.Generator = 0) -> list[list[SampleShape]]:
    """:func:`sample_mix`'s samples with their text / visual split and latent frames (for
    generating synthetic data of the same sizes). Same arguments, same lengths."""
    if name not in MIXES:
        raise ValueError(f"unknown data mix {name!r}; choose one of {', '.join(MIXES)} or give --lengths FILE.json")
    if num_gpus <= 0:
        raise ValueError(f"num_gpus must be positive; got {num_gpus}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return MIXES[name](num_gpus, rng)
