"""Prepared data for Wan: video files and images -> one ``.safetensors`` file of latents and text
embeddings per sample (``examples/prepare_video_latents.py`` writes them; docs/models.md, "Preparing
video data", has the rules).

A *video latent sample* on disk holds exactly two tensors, unbatched, each sample at its own size:

===========================  ================  =============================================
key                          shape             what
===========================  ================  =============================================
``latents``                  ``[C, F, H, W]``  ``AutoencoderKLWan`` latents, normalised as
                                               ``WanPipeline`` un-normalises them (an image is
                                               ``F = 1``)
``encoder_hidden_states``    ``[Lt, Dj]``      ``WanPipeline.encode_prompt``'s text rows (zero
                                               padded to ``max_sequence_length``, 512)
===========================  ================  =============================================

and, as string metadata in its header, where it came from (``source``, ``caption``, ``kind``,
``frames_read``: frames decoded, at most ``max_frames + 1``; ``frames``, ``fps``, ``source_size``,
``size``). ``PackedWanTransformer`` takes ``latents`` as ``hidden_states``. The directory holds a
``manifest.json`` (:mod:`deepspeed_knap.runtime.manifest`), as FLUX's prepared data does, written
after every sample.

The rules that turn a source into pixels the VAE takes (:func:`read_source`):

* **Upright**: a video is turned as its display matrix says (a phone's portrait clip is stored
  landscape with a quarter turn in its metadata, which players apply), as an image is by its EXIF
  orientation; the turn is reported. Only quarter turns are undone (ffmpeg's autorotate's common
  case); a flip in the matrix is not.
* **Frames**: ``AutoencoderKLWan`` encodes ``1 + 4k`` frames into ``1 + k`` latent frames; a clip keeps
  its first ``max(4k + 1 <= frames)`` frames (and at most ``max_frames``, itself ``4k + 1``); the
  frames dropped are reported.
* **Size**: a frame larger than ``max_area`` pixels is first scaled down (aspect ratio kept, bilinear
  with antialiasing); then each side is **center-cropped** to the largest multiple of
  ``multiple`` (the VAE's spatial factor times the transformer's patch: 8 x 2 = 16 for Wan 2.1) that
  fits: at most ``multiple - 1`` pixels of a side are cut, split between its two ends, and no pixel is
  resampled. Every sample keeps its own size: no buckets.
* **Captions**: a sidecar text file, ``clip.mp4`` -> ``clip.txt`` (the convention of FLUX's
  ``prepare_flux_latents.py`` and most video trainers' datasets).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.generation.requests import read_image
from deepspeed_knap.models.latents import (
    LatentDirectory,
    SyntheticMixLatents,
    non_float_tensors,
    read_caption_file,
    sample_file_header,
)

__all__ = [
    "CAPTION_SUFFIX",
    "IMAGE_SUFFIXES",
    "VIDEO_LATENT_KEYS",
    "VIDEO_SUFFIXES",
    "Refused",
    "SourcePixels",
    "SyntheticVideoLatents",
    "center_crop_multiple",
    "check_video_latent_file",
    "frames_per_second",
    "frames_to_keep",
    "latent_directory",
    "load_video_sample",
    "read_caption",
    "read_source",
    "save_video_sample",
    "synthetic_video_samples",
    "tiny_wan_pipeline",
    "write_tiny_wan_pipeline",
]

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
CAPTION_SUFFIX = ".txt"
VIDEO_LATENT_KEYS = ("latents", "encoder_hidden_states")
# Image-to-video samples also hold the pipeline's condition (``WanImageToVideoPipeline.prepare_latents``:
# the first-frame mask, 4 channels, then the VAE latents of the first frame and zeros), and for a model
# with ``image_dim`` (Wan 2.1 I2V) the CLIP image context.
CONDITION_KEY, IMAGE_CONTEXT_KEY = "condition", "encoder_hidden_states_image"
# Image context rows (CLIP ViT-H/14 at 224 px: 256 patches and the class token) before a mix's scale.
IMAGE_CONTEXT_TOKENS = 257
# A model with image context (Wan 2.1 I2V) takes its text as this many rows: diffusers' Wan attention
# splits the context it is given there (image rows first, then 512 of text), so the pipelines pad
# the prompt to 512 (their max_sequence_length) and shorter text would be split wrong.
I2V_TEXT_ROWS = 512


def frames_per_second(expand_timesteps: bool) -> int:
    """The frame rate a Wan model's clips play at: Wan 2.2 TI2V-5B's (its pipeline sets
    ``expand_timesteps``) 24, its 121 frames 5 s; Wan 2.1's and Wan 2.2 A14B's 16 (the model cards')."""
    return 24 if expand_timesteps else 16


class Refused(ValueError):
    """A source file that cannot be prepared. ``kind`` groups reasons in the summary (``"unreadable"``,
    ``"no video frames"``, ``"no caption"``, ...); the message says what is wrong and the fix."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def read_caption(source: Path) -> str:
    """The caption of ``source``: the text of its sidecar ``.txt`` (same name, ``.txt`` suffix), stripped.

    Raises:
        Refused: there is no sidecar file, it cannot be read, or it is empty.
    """
    sidecar = source.with_suffix(CAPTION_SUFFIX)
    if not sidecar.is_file():
        raise Refused("no caption", f"no caption: write it in {sidecar.name} next to it")
    try:
        caption = read_caption_file(sidecar)
    except ValueError as error:
        raise Refused("no caption", str(error)) from None
    if not caption:
        raise Refused("no caption", f"its caption {sidecar.name} is empty")
    return caption


def frames_to_keep(count: int, temporal: int = 4, max_frames: int | None = None) -> int:
    """The largest ``temporal * k + 1 <= min(count, max_frames)``: how many leading frames of a clip of
    ``count`` frames the VAE encodes (0 when ``count`` is 0)."""
    limit = count if max_frames is None else min(count, max_frames)
    return 0 if limit < 1 else (limit - 1) // temporal * temporal + 1


def center_crop_multiple(height: int, width: int, multiple: int) -> tuple[int, int, int, int]:
    """``(top, left, height', width')``: the centered crop of each side to the largest multiple of
    ``multiple`` that fits (0 when a side is smaller than ``multiple``)."""
    new_h, new_w = height // multiple * multiple, width // multiple * multiple
    return (height - new_h) // 2, (width - new_w) // 2, new_h, new_w


@dataclass
class SourcePixels:
    """One source made ready for the VAE.

    Attributes:
        pixels: ``[3, F, H, W]`` float32 in ``[-1, 1]`` (``F = 1`` for an image).
        is_video: a video file (else an image).
        source_frames: frames read from the file (with ``max_frames``: at most one past the limit, so
            ``source_frames > frames`` says frames were left).
        source_size: ``(height, width)`` as decoded (turned upright).
        fps: the frame rate of ``pixels`` (``None``: an image, or a stream that gives none).
        notes: what was done to it, for the summary: ``"rotated"`` (turned upright), ``"fps"``
            (subsampled), ``"frames"`` (4k+1 rule or ``max_frames``), ``"scaled"`` (``max_area``),
            ``"cropped"`` (to the multiple), each a short description.
    """

    pixels: Tensor
    is_video: bool
    source_frames: int
    source_size: tuple[int, int]
    fps: float | None = None
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def frames(self) -> int:
        return self.pixels.shape[1]

    @property
    def size(self) -> tuple[int, int]:
        return tuple(self.pixels.shape[2:])


def _decode_video(
    path: Path, read_limit: int | None, fps: float | None
) -> tuple[list[np.ndarray], float | None, dict[str, str]]:
    """RGB frames ``[H, W, 3]`` uint8 of the first video stream, upright, at most ``read_limit`` (kept
    after ``fps`` subsampling), the rate they are at, and notes (:class:`SourcePixels`) when they were
    turned upright or subsampled."""
    import av

    try:
        container = av.open(str(path))
    except (av.FFmpegError, OSError) as error:
        raise Refused("unreadable", f"unreadable: PyAV cannot open it ({error})") from None
    frames: list[np.ndarray] = []
    turns = set()  # quarter turns counterclockwise that make each frame upright
    with container:
        if not container.streams.video:
            raise Refused("no video frames", "no video frames: the file has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = float(stream.average_rate) if stream.average_rate else None
        step = None if fps is None or rate is None or fps >= rate else 1.0 / fps
        next_time = 0.0
        try:
            for index, frame in enumerate(container.decode(stream)):
                if step is not None:
                    time = frame.time if frame.time is not None else index / rate
                    if time + 1e-6 < next_time:
                        continue  # dropped to reach ``fps``: the next kept frame is the first at or after next_time
                    next_time += step * (math.floor((time + 1e-6 - next_time) / step) + 1)
                rotation = frame.rotation  # degrees the display matrix turns the frame counterclockwise (0: none)
                if rotation % 90:
                    raise Refused("unreadable", f"unreadable: its display matrix turns it {rotation} degrees; only "
                                  "quarter turns are undone: turn the clip upright with ffmpeg first")  # fmt: skip
                turns.add(rotation // 90 % 4)
                frames.append(np.rot90(frame.to_ndarray(format="rgb24"), rotation // 90))
                if read_limit is not None and len(frames) >= read_limit:
                    break
        except av.FFmpegError as error:
            if frames:  # a damaged clip is refused, not trained cut short
                raise Refused(
                    "unreadable", f"unreadable: decoding failed after {len(frames)} frames ({error})"
                ) from None
            raise Refused("no video frames", f"no video frames: decoding found none ({error})") from None
    if not frames:
        raise Refused("no video frames", "no video frames: the video stream holds none")
    shapes = {frame.shape for frame in frames}
    if len(shapes) > 1:
        sizes = sorted(f"{h}x{w}" for h, w, _ in shapes)
        raise Refused("unreadable", f"unreadable: its frames change size mid-clip ({', '.join(sizes)})")
    notes = {}
    if turns - {0}:
        quarter = {1: "90 degrees counterclockwise", 2: "180 degrees", 3: "90 degrees clockwise"}
        notes["rotated"] = "turned " + ", ".join(quarter[turn] for turn in sorted(turns - {0})) + " (display matrix)"
    if step is not None:
        notes["fps"] = f"{rate:g} -> {fps:g} fps ({index + 1} frames read, {len(frames)} kept)"
    return frames, fps if step is not None else rate, notes


def _load_image(path: Path) -> np.ndarray:
    """``[H, W, 3]`` uint8 pixels of the image at ``path``, oriented by its EXIF tag (as diffusers'
    ``load_image``: a phone's portrait photo is stored landscape with a tag saying so)."""
    try:
        return np.asarray(read_image(path))
    except ValueError as error:
        raise Refused("unreadable", f"unreadable: {error}") from None


def read_source(
    path: str | Path,
    multiple: int = 16,
    temporal: int = 4,
    max_frames: int | None = 81,
    max_area: int | None = None,
    fps: float | None = None,
) -> SourcePixels:
    """Decode a video (PyAV) or an image (PIL) and apply the frame and size rules (module docstring).

    Args:
        multiple: each side of the kept frames is a multiple of it (VAE spatial factor x patch).
        temporal: the VAE's temporal factor (``4k + 1`` frames).
        max_frames: at most this many frames (``temporal * k + 1``); ``None``: all.
        max_area: scale frames with more pixels than this down to it first; ``None``: never.
        fps: subsample a video to at most this frame rate (dropping frames); ``None``: its own rate.

    Raises:
        Refused: unreadable, no frames, or smaller than ``multiple`` on a side.
    """
    path = Path(path)
    is_video = path.suffix.lower() in VIDEO_SUFFIXES
    if max_frames is not None and (max_frames < 1 or (max_frames - 1) % temporal):
        raise ValueError(f"max_frames={max_frames} must be {temporal}k + 1 (1, {temporal + 1}, ..., 81)")
    if is_video:
        frames, rate, notes = _decode_video(path, None if max_frames is None else max_frames + 1, fps)
    else:
        frames, rate, notes = [_load_image(path)], None, {}
    source_frames, (height, width) = len(frames), frames[0].shape[:2]
    keep = frames_to_keep(source_frames, temporal, max_frames)
    if keep < source_frames:
        if max_frames is not None and source_frames > max_frames:
            notes["frames"] = f"more than {max_frames} -> the first {keep} frames (max_frames)"
        else:
            notes["frames"] = f"{source_frames} -> {keep} frames ({temporal}k+1)"
    pixels = torch.from_numpy(np.stack(frames[:keep])).permute(3, 0, 1, 2).float()  # [3, F, H, W], 0-255
    if max_area is not None and height * width > max_area:
        scale = math.sqrt(max_area / (height * width))
        size = (max(1, math.floor(height * scale + 1e-6)), max(1, math.floor(width * scale + 1e-6)))  # no 719 for 720
        pixels = torch.nn.functional.interpolate(
            pixels.permute(1, 0, 2, 3), size=size, mode="bilinear", antialias=True, align_corners=False
        ).permute(1, 0, 2, 3)
        notes["scaled"] = f"{height}x{width} -> {size[0]}x{size[1]} (max area {max_area})"
    h, w = pixels.shape[2:]
    top, left, new_h, new_w = center_crop_multiple(h, w, multiple)
    if new_h == 0 or new_w == 0:
        raise Refused(
            "too small",
            f"too small: {h}x{w} pixels (HxW), each side must be at least {multiple} (the VAE's "
            "spatial factor times the patch)",
        )
    if (new_h, new_w) != (h, w):
        pixels = pixels[:, :, top : top + new_h, left : left + new_w]
        notes["cropped"] = f"{h}x{w} -> {new_h}x{new_w}"
    pixels = (pixels / 127.5 - 1).clamp(-1, 1).contiguous()
    return SourcePixels(pixels, is_video, source_frames, (height, width), rate, notes)


def save_video_sample(path: str | Path, sample: Mapping[str, Tensor], metadata: Mapping[str, object] = ()) -> None:
    """Write one video latent sample (:data:`VIDEO_LATENT_KEYS`, and an image-to-video sample's
    ``condition`` and ``encoder_hidden_states_image``) as ``.safetensors``, ``metadata``
    (stringified) in its header."""
    from safetensors.torch import save_file

    missing = [key for key in VIDEO_LATENT_KEYS if key not in sample]
    if missing:
        raise ValueError(f"a video latent sample needs {list(VIDEO_LATENT_KEYS)}; missing {missing}")
    latents, text = sample["latents"], sample["encoder_hidden_states"]
    if latents.dim() != 4 or text.dim() != 2:
        raise ValueError(f"latents {list(latents.shape)} must be [C, F, H, W], text {list(text.shape)} [Lt, Dj]")
    keys = [key for key in (*VIDEO_LATENT_KEYS, CONDITION_KEY, IMAGE_CONTEXT_KEY) if key in sample]
    tensors = {key: sample[key].detach().contiguous().cpu() for key in keys}
    save_file(tensors, str(path), metadata={str(k): str(v) for k, v in dict(metadata).items()})


def load_video_sample(path: str | Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a file :func:`save_video_sample` wrote."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
        metadata = handle.metadata() or {}
    missing = [key for key in VIDEO_LATENT_KEYS if key not in tensors]
    if missing:
        raise ValueError(f"{path}: not a video latent sample (no {missing}); write it with prepare_video_latents.py")
    return tensors, metadata


def tiny_wan_pipeline(text_dim: int = 24, z_dim: int = 4, seed: int = 0, image_to_video: bool = False,
                      image_dim: int | None = None):  # fmt: skip
    """A ``WanPipeline`` of tiny random components for tests and CPU demos, built offline: an
    ``AutoencoderKLWan`` (spatial 8, temporal 4, ``z_dim`` channels), a 2-layer ``UMT5EncoderModel``
    of width ``text_dim``, a word-level tokenizer made with ``tokenizers`` (no download), a UniPC
    scheduler, no transformer. ``text_dim``/``z_dim`` match ``wan.TINY_WAN``. With
    ``image_to_video`` a ``WanImageToVideoPipeline`` of the same parts, and with ``image_dim`` a tiny
    CLIP vision encoder of that width (32 px images, 8 px patches: 17 context rows) and its image
    processor (Wan 2.1 I2V's). A function of ``seed``."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline, WanPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    vocabulary = "a an the of on in and with red green blue cat dog bird clip video image"
    words = ["<pad>", "</s>", "<unk>", *vocabulary.split(" ")]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(words),
            d_model=text_dim,
            d_kv=8,
            d_ff=2 * text_dim,
            num_layers=2,
            num_heads=3,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
        )
    ).eval()  # fmt: skip  (built in training mode, its dropout would make every encoding random)
    vae = AutoencoderKLWan(base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1] * z_dim,
                           latents_std=[2.0] * z_dim)  # fmt: skip
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=None,
                 scheduler=UniPCMultistepScheduler())  # fmt: skip
    if not image_to_video:
        return WanPipeline(**parts)
    if image_dim:
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        clip = CLIPVisionConfig(hidden_size=image_dim, intermediate_size=2 * image_dim, num_hidden_layers=2,
                                num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
        parts.update(image_encoder=CLIPVisionModel(clip).eval(),
                     image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}))  # fmt: skip
    return WanImageToVideoPipeline(**parts)


def write_tiny_wan_pipeline(directory: str | Path, text_dim: int = 24, z_dim: int = 4, seed: int = 0) -> Path:
    """:func:`tiny_wan_pipeline` saved as a pipeline folder (``model_index.json``, no transformer)."""
    tiny_wan_pipeline(text_dim, z_dim, seed).save_pretrained(str(directory))
    return Path(directory)


# ---- training on prepared (or synthetic) samples ----


def latent_channels(config: Mapping) -> int:
    """The VAE latent channels a ``PackedWanTransformer`` ``config`` denoises (its ``out_channels``)."""
    return config.get("out_channels") or config["in_channels"]


def condition_channels(config: Mapping) -> int:
    """The channels of an image-to-video model's condition (its input beyond the noisy latents: the
    4-channel first-frame mask and the first frame's latents), 0 for text-to-video."""
    return config["in_channels"] - latent_channels(config)


def sample_keys(config: Mapping) -> tuple[str, ...]:
    """The tensors one prepared sample holds for a model ``config``."""
    keys = VIDEO_LATENT_KEYS + ((CONDITION_KEY,) if condition_channels(config) else ())
    return keys + ((IMAGE_CONTEXT_KEY,) if config.get("image_dim") else ())


def check_video_latent_file(file: str | Path, config: Mapping) -> str | None:
    """What is wrong with one video latent sample file for a ``PackedWanTransformer`` ``config``, or
    ``None``. Reads only the header: an unreadable file, keys other than the model's
    (:func:`sample_keys`), non-float tensors, latents that are not ``[C, F, H, W]`` (``C`` the latent
    channels) with ``F``, ``H``, ``W`` positive multiples of the patch (within the RoPE table), text
    that is not ``[Lt >= 1, text_dim]`` (with image context: 512 rows, :data:`I2V_TEXT_ROWS`), an
    image-to-video condition not ``[in_channels - C, F, H, W]`` or image context not ``[Li >= 1,
    image_dim]``."""
    fix = "rewrite it with examples/prepare_video_latents.py (the VAE and text encoder of this model) or remove it"
    headers = sample_file_header(file, fix)
    if isinstance(headers, str):
        return headers
    keys = sample_keys(config)
    if sorted(headers) != sorted(keys):
        what = "an image-to-video sample" if condition_channels(config) else "a video latent sample"
        return f"{file}: has keys {sorted(headers)}; {what} for this model holds exactly {list(keys)}; {fix}"
    if problem := non_float_tensors(file, headers, fix):
        return problem
    latents, text = headers["latents"][0], headers["encoder_hidden_states"][0]
    patch = config["patch_size"]
    channels = latent_channels(config)
    if len(latents) != 4 or latents[0] != channels:
        return f"{file}: latents {list(latents)} must be [C, F, H, W] with C = {channels} latent channels; {fix}"
    sizes = latents[1:]
    bad = [f"{axis} {size}" for axis, size, p in zip(("frames", "height", "width"), sizes, patch, strict=True)
           if size == 0 or size % p]  # fmt: skip
    if bad:
        return f"{file}: latents {list(latents)}: {', '.join(bad)} not a positive multiple of the patch {list(patch)}; {fix}"
    grid = [size // p for size, p in zip(sizes, patch, strict=True)]
    if max(grid) > config["rope_max_seq_len"]:
        return (f"{file}: post-patch grid {grid} exceeds the model's rope_max_seq_len={config['rope_max_seq_len']} "
                f"positions on an axis; prepare it smaller (--max-area, --max-frames)")  # fmt: skip
    if len(text) != 2 or text[0] < 1 or text[1] != config["text_dim"]:
        return f"{file}: encoder_hidden_states {list(text)} must be [Lt >= 1, text_dim = {config['text_dim']}]; {fix}"
    if config.get("image_dim") is not None and text[0] != I2V_TEXT_ROWS:
        return (f"{file}: encoder_hidden_states {list(text)}: a model with image context (Wan 2.1 I2V) takes its text "
                f"as {I2V_TEXT_ROWS} rows (diffusers splits the context there); prepare it with --max-sequence-length "
                f"{I2V_TEXT_ROWS}")  # fmt: skip
    if CONDITION_KEY in headers and list(headers[CONDITION_KEY][0]) != [condition_channels(config), *sizes]:
        return (f"{file}: condition {list(headers[CONDITION_KEY][0])} must be [{condition_channels(config)}, "
                f"{', '.join(map(str, sizes))}]: the first-frame mask (4) and latents, as the latents' frames and size; "
                f"{fix}")  # fmt: skip
    if IMAGE_CONTEXT_KEY in headers:
        image = headers[IMAGE_CONTEXT_KEY][0]
        if len(image) != 2 or image[0] < 1 or image[1] != config["image_dim"]:
            return (
                f"{file}: {IMAGE_CONTEXT_KEY} {list(image)} must be [Li >= 1, image_dim = {config['image_dim']}]; {fix}"
            )
    return None


def latent_directory(path: str | Path, samples_per_rank: int = 1, repeat: bool = False) -> LatentDirectory:
    """A directory of video latent samples (as ``prepare_video_latents.py`` writes them), read and
    verified by :class:`~deepspeed_knap.models.latents.LatentDirectory`."""
    return LatentDirectory(path, samples_per_rank, repeat, check_file=check_video_latent_file,
                           writer="examples/prepare_video_latents.py")  # fmt: skip


def synthetic_video_samples(
    shapes: list[SampleShape], config: Mapping, seed: int, token_scale: float = 1.0, dtype=torch.float32
) -> list[dict[str, Tensor]]:
    """Random video latent samples (:func:`sample_keys`) of a data mix's sizes scaled by
    ``token_scale``: each sample keeps its latent frames, and a frame's tokens are laid out as a
    near-square post-patch grid (so a sample's video tokens are the mix's, scaled, to within
    rounding); text rows are the sample's cross-attention text (its in-sequence text for a FLUX
    mix), scaled, at least one. An image-to-video model's samples also hold a condition (the mask
    of the first latent frame, then random latents) and, with ``image_dim``, 257 image context rows
    scaled. A function of ``seed`` only."""
    generator = torch.Generator().manual_seed(seed)
    pt, ph, pw = config["patch_size"]
    samples = []
    for shape in shapes:
        scaled = shape.scaled(token_scale)
        frames = max(1, min(shape.frames, scaled.visual))
        per_frame = max(1, round(scaled.visual / frames))
        height = max(1, math.isqrt(per_frame))
        width = max(1, round(per_frame / height))
        text = max(1, scaled.cross_text or scaled.text)
        latents = torch.randn(latent_channels(config), frames * pt, height * ph, width * pw, generator=generator)
        text_rows = torch.randn(text, config["text_dim"], generator=generator)
        sample = {"latents": latents.to(dtype), "encoder_hidden_states": text_rows.to(dtype)}
        if condition_channels(config):
            mask = torch.zeros(4, *latents.shape[1:])
            mask[:, 0] = 1  # the first latent frame is the given image (all 4 of its video frames)
            image = torch.randn(condition_channels(config) - 4, *latents.shape[1:], generator=generator)
            sample[CONDITION_KEY] = torch.cat([mask, image]).to(dtype)
        if config.get("image_dim"):
            rows = max(1, round(IMAGE_CONTEXT_TOKENS * token_scale))
            sample[IMAGE_CONTEXT_KEY] = torch.randn(rows, config["image_dim"], generator=generator).to(dtype)
        samples.append(sample)
    return samples


class SyntheticVideoLatents(SyntheticMixLatents):
    """Each step, each rank's video latent samples drawn from a bundled data mix (``deepspeed-knap
    plan --mix``'s names, e.g. ``wan_image_video``), with random latents and text
    (:func:`synthetic_video_samples`)."""

    make_samples = staticmethod(synthetic_video_samples)
