"""Generation requests: one JSON object per line of a request file, checked before any work.

    {"id": "cat", "prompt": "a cat on a mat", "height": 1024, "width": 768, "steps": 28, "guidance": 3.5, "seed": 7}
    {"embeddings": "emb/dog.safetensors", "height": 512, "width": 512, "steps": 4}
    {"id": "surf", "prompt": "a surfer at dusk", "negative_prompt": "blurry", "height": 480, "width": 832, "frames": 81}

A request names its text by ``prompt`` (the rank that owns it runs the family's text encoders) or by
``embeddings``, a safetensors file of precomputed text embeddings (FLUX.1: ``prompt_embeds [Tt, Dj]``
and ``pooled_prompt_embeds [Dp]``; with classifier-free guidance also ``negative_prompt_embeds``
and FLUX.1's ``negative_pooled_prompt_embeds``). ``height`` and ``width`` (pixels) are required,
except with ``image`` where the family's pipeline sizes the output by its image (FLUX.3, Qwen-Image
edits; the other families refuse the request without them); ``steps`` (the family's pipeline's
default: FLUX.1 28, the others 50), ``guidance`` (the family's
pipeline's default: FLUX.1 3.5, FLUX.2 4.0, FLUX.3 3.5, Wan 5.0, Qwen-Image 4.0), ``seed`` (0),
``max_sequence_length`` (the family's pipeline's default: 512, FLUX.3 8192; the text tokens a prompt
is padded or truncated to, as diffusers' pipelines do) and ``id`` (default ``line{N}``) are
optional. Video families take ``frames`` (Wan: 81, its pipeline's default; an image is 1).
Classifier-free guidance, where the family uses it, takes ``negative_prompt`` (Wan: its ``guidance`` above 1 turns it on, with ``""``
unless given; FLUX.1: ``true_cfg_scale`` above 1 with a ``negative_prompt``, as ``FluxPipeline``'s
``true_cfg_scale``); the unconditional branch is then a sequence of its own for the planner.
Image-conditioned pipelines take ``image``: a path, or a list of paths (relative paths are the
request file's directory's): Wan's image-to-video the first frame, FLUX.2, FLUX.3 and Qwen-Image's
edit pipelines their reference images.
Wan 2.2 A14B's two experts take ``guidance_2``, the low-noise expert's guidance scale (the
pipeline's ``guidance_scale_2``; default ``guidance``). A family refuses the keys it does not take. Unknown keys are refused, so a typo (``"step": 4``) is not
silently a default.

An ``id`` names the output file ``{id}.png`` (a video's ``{id}.gif``): no ``/`` and no control
characters in it, and at most 255 bytes (UTF-8) with the ``.png``. ``seed`` is ``0`` to ``2**64 - 1`` (what ``manual_seed`` takes);
``steps`` at most :data:`MAX_STEPS`; the other whole numbers are at most ``2**31 - 1`` (what a request's
size may be is its family's and the token ceiling's to say).

The request file, an embeddings file and an image are read only if they are regular files, of at
most :data:`MAX_REQUEST_FILE_BYTES`, :data:`MAX_EMBEDDINGS_BYTES` and :data:`MAX_IMAGE_BYTES`
(:func:`read_regular_file`): a FIFO
would block every rank in ``open`` with no writer, and ``/dev/zero`` would never end.

Pure Python, no torch: what a family checks of a request (its sizes, its embeddings file) is in
the family's module, and the agreement between ranks in
:func:`~deepspeed_knap.generation.runner.take_requests`.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# guidance and max_sequence_length: the family's (generator's) defaults, its pipeline's.
DEFAULTS = {"seed": 0}
# Denoising steps a request may take: 30 to 300 times the usual 28 to 50, which both families'
# schedulers (FLUX's flow-match Euler, Wan's UniPC) take. More is a typo: a scheduler sets every
# step's timestep up front, and 10**9 of them held gigabytes and ran on for hours.
MAX_STEPS = 10_000
# The largest value of each whole-number field: a seed is what torch.Generator.manual_seed takes;
# steps MAX_STEPS; the others are bounded so that what is derived from them (tokens) stays a plain
# number everywhere (a family bounds the size, the intake the tokens).
LARGEST = {"seed": 2**64 - 1, "height": 2**31 - 1, "width": 2**31 - 1, "steps": MAX_STEPS,
           "max_sequence_length": 2**31 - 1, "frames": 2**31 - 1}  # fmt: skip
# The largest request file read: a million requests of 256 bytes (every rank holds its lines).
MAX_REQUEST_FILE_BYTES = 2**28
# The largest embeddings file read (at the intake, whole, to check its values; again at the start):
# FLUX.2's widest text, 15,360 x 4 bytes, is 31 MB at 512 tokens; 1 GiB holds 17,000 tokens of it.
MAX_EMBEDDINGS_BYTES = 2**30
# The largest image file read (an 8k x 8k PNG of noise is about 200 MB), and the most images a request
# names (FLUX.2's pipeline takes any number of references; each is ~4k tokens of every step).
MAX_IMAGE_BYTES = 2**28
MAX_IMAGES = 16
MAX_FILE_NAME_BYTES = 255  # of "{id}.png", what common file systems take
_KEYS = ("id", "prompt", "embeddings", "height", "width", "steps", "guidance", "seed", "max_sequence_length",
         "frames", "negative_prompt", "true_cfg_scale", "image", "guidance_2")  # fmt: skip


class RequestError(ValueError):
    """A request line that cannot be generated; the message names the line."""


class RequestFileError(ValueError):
    """A request file that some rank cannot read, or that differs between ranks."""


@dataclass(frozen=True)
class Request:
    """One image to generate.

    Attributes:
        index: position among the file's requests (its non-blank lines), from 0; the rank
            ``index % world_size`` owns it (encodes it, holds its latents; its decode is placed:
            :mod:`~deepspeed_knap.generation.decodes`).
        line: the line number in the file, from 1.
        id: the output's name (``{id}.png``).
        prompt: the text, or ``None`` when ``embeddings`` is given.
        embeddings: path of a safetensors file of precomputed text embeddings (relative paths are
            the request file's directory's), or ``None``.
        height, width: pixels, or ``None`` (with ``image`` only): the family's pipeline's size of
            its image (FLUX.3: the first reference's; Qwen-Image edits: about 1 megapixel at the
            last reference's aspect ratio).
        steps: denoising steps.
        guidance: the guidance scale (embedded, for guidance-distilled models such as FLUX.1 and
            FLUX.2 [dev]), or ``None``: the family's pipeline's default (``guidance_scale``).
        seed: of the initial noise (``torch.Generator().manual_seed(seed)``, as given to diffusers).
        max_sequence_length: text tokens a prompt is padded (or truncated) to, or ``None``: the
            family's pipeline's default (ignored with ``embeddings``).
        frames: video frames, or ``None``: the family's default (an image family takes none).
        negative_prompt: the unconditional branch's text, or ``None``: the family's default.
        true_cfg_scale: FLUX.1's true classifier-free guidance scale, or ``None`` (off).
        image: paths of the request's images (Wan's first frame; FLUX.2's, FLUX.3's and Qwen-Image
            edits' references, in order; relative paths are the request file's directory's), or ``None``.
        guidance_2: the low-noise expert's guidance scale of a two-expert pipeline, or ``None``:
            ``guidance``'s.
    """

    index: int
    line: int
    id: str
    prompt: str | None
    embeddings: str | None
    height: int | None
    width: int | None
    steps: int
    guidance: float | None
    seed: int
    max_sequence_length: int | None
    frames: int | None = None
    negative_prompt: str | None = None
    true_cfg_scale: float | None = None
    image: tuple[str, ...] | None = None
    guidance_2: float | None = None


def _finite_number(value: Any) -> bool:
    """Whether ``value`` is a JSON number a float holds finitely (no bool; an int past a float's
    range is not: ``math.isfinite`` raises ``OverflowError`` on it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def request_lines(path: str | Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of a request file.

    Raises:
        RequestFileError: the file cannot be read (the message names it).
    """
    try:
        text = read_regular_file(path, MAX_REQUEST_FILE_BYTES).decode("utf-8-sig")  # (editors may write a BOM)
    except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
        raise RequestFileError(f"cannot read the request file {path}: {error}") from None
    return [(number, line) for number, line in enumerate(text_lines(text), start=1) if line.strip()]


def text_lines(text: str) -> list[str]:
    """The lines of a file's ``text``, ended by ``"\n"`` (or ``"\r\n"``) only: a JSON string or a
    prompt may hold U+2028, U+0085 and the other breaks ``str.splitlines()`` also splits at."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of ``path`` when it is a regular file (or a link to one) of at most ``limit`` bytes.

    What the path names is checked before it is opened, and again on the open file (the path may
    have been swapped in between): a FIFO would block ``open`` until a writer comes, and a device
    such as ``/dev/zero`` would never end.

    Raises:
        OSError: the path cannot be opened or read.
        ValueError: not a regular file, or larger than ``limit`` (the message says which).
    """
    _check_regular(os.stat(path), limit)
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in: no wait
    try:
        _check_regular(os.fstat(descriptor), limit)
        chunks, size = [], 0
        while chunk := os.read(descriptor, min(2**24, limit + 1 - size)):  # a file grown since: still bounded
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ValueError(f"it grew past {limit:,} bytes while read")
    finally:
        os.close(descriptor)
    return b"".join(chunks)


def read_image(path: str | Path) -> Any:
    """The image at ``path`` as an RGB ``PIL.Image``, oriented by its EXIF tag (as diffusers'
    ``load_image``), read only if it is a regular file of at most :data:`MAX_IMAGE_BYTES` (a FIFO
    would block, a device never end). A 16-bit grayscale image (PIL's mode ``I;16``, or ``I`` with
    values above 255) is scaled to 8 bits; PIL's (and ``load_image``'s) conversion clips it, so
    mid-grey became white.

    Raises:
        ValueError: naming the file: missing, unreadable, not a regular file, too large, or not an
            image PIL reads (PIL raises its own types, a decompression bomb's too).
    """
    import io

    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(read_regular_file(path, MAX_IMAGE_BYTES))))
        if image.mode.startswith("I;16") or image.mode == "I":
            import numpy as np

            levels = np.asarray(image).astype(np.int64)
            if image.mode.startswith("I;16") or levels.max(initial=0) > 255:  # ("I" of 8-bit values stays)
                levels = (np.clip(levels, 0, 65535) + 128) // 257  # 65535 -> 255, rounded
            image = Image.fromarray(np.clip(levels, 0, 255).astype(np.uint8), "L")
        return image.convert("RGB")
    except UnidentifiedImageError:  # (its message names the in-memory copy, not the file)
        raise ValueError(f"cannot read image {path}: not an image PIL reads") from None
    except Exception as error:
        raise ValueError(f"cannot read image {path}: {error}") from None


_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}  # fmt: skip


def _check_regular(status: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = _KINDS.get(stat.S_IFMT(status.st_mode), "not a file")
        raise ValueError(f"it is {kind}, not a regular file; give a file")
    if status.st_size > limit:
        raise ValueError(f"it holds {status.st_size:,} bytes, over the {limit:,} read at most")


def parse_request(index: int, line: int, text: str, directory: str | Path = ".", *, default_steps: int) -> Request:
    """The request of one line; a relative ``embeddings`` or ``image`` path is taken from
    ``directory`` (the request file's); ``default_steps`` where it gives no ``steps`` (the family's
    pipeline's, which differ: :attr:`~deepspeed_knap.generation.generator.Generator.default_steps`).

    Raises:
        RequestError: malformed JSON, an unknown key, a missing or ill-typed value; the message
            starts with ``line {line}``.
    """
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError(f"line {line}: not JSON ({error.msg} at column {error.colno})") from None
    except ValueError as error:  # e.g. a number of more digits than Python converts (4300)
        raise RequestError(f"line {line}: not JSON that can be read ({error})") from None
    except RecursionError:
        raise RequestError(f"line {line}: not JSON that can be read (nested too deeply)") from None
    if not isinstance(fields, dict):
        raise RequestError(f"line {line}: a request is a JSON object, e.g. {{\"prompt\": ..., \"height\": ...}}; "
                           f"got {type(fields).__name__}")  # fmt: skip
    unknown = sorted(set(fields) - set(_KEYS))
    if unknown:
        raise RequestError(f"line {line}: unknown key(s) {unknown}; a request takes {', '.join(_KEYS)}")
    if ("prompt" in fields) == ("embeddings" in fields):
        raise RequestError(f"line {line}: give exactly one of 'prompt' (text) and 'embeddings' (a safetensors file "
                           "of precomputed text embeddings)")  # fmt: skip
    raw = fields.get("image")
    paths = [raw] if isinstance(raw, str) else raw
    if "image" in fields and not (
        isinstance(paths, list) and 0 < len(paths) <= MAX_IMAGES
        and all(isinstance(path, str) and path and _encodable(path) for path in paths)
    ):  # fmt: skip
        shown = repr(raw) if len(repr(raw)) <= 80 else repr(raw)[:80] + "..."
        raise RequestError(f"line {line}: 'image' must be a path (a non-empty string) or a list of 1 to {MAX_IMAGES} "
                           f"of them; got {shown}")  # fmt: skip
    for key in ("prompt", "embeddings", "id"):
        if key in fields and not (isinstance(fields[key], str) and fields[key]):
            raise RequestError(f"line {line}: {key!r} must be a non-empty string; got {fields[key]!r}")
        if key in fields and not _encodable(fields[key]):  # a lone surrogate ("\\ud800") is valid JSON
            raise RequestError(f"line {line}: {key!r} must be valid Unicode; got {fields[key]!r}")
    request_id = fields.get("id", f"line{line}")
    _check_id(line, request_id)
    values = {**DEFAULTS, "steps": default_steps, **fields}
    if "negative_prompt" in fields and not isinstance(fields["negative_prompt"], str):
        raise RequestError(f"line {line}: 'negative_prompt' must be a string; got {fields['negative_prompt']!r}")
    if "negative_prompt" in fields and "embeddings" in fields:
        raise RequestError(f"line {line}: with 'embeddings' the unconditional branch's text is the file's "
                           "negative_prompt_embeds (or, where the family encodes it without them, \"\"): drop "
                           "'negative_prompt'")  # fmt: skip
    if "negative_prompt" in fields and not _encodable(fields["negative_prompt"]):
        raise RequestError(f"line {line}: 'negative_prompt' must be valid Unicode; got {fields['negative_prompt']!r}")
    for key in ("height", "width", "steps", "seed", "max_sequence_length", "frames"):
        if key not in values and (key in ("frames", "max_sequence_length") or "image" in fields):
            continue  # the family's default (an image's size: its pipeline's)
        if key not in values:
            raise RequestError(f'line {line}: {key!r} is required (pixels); e.g. "{key}": 1024')
        value = values[key]
        lowest = 0 if key == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= LARGEST[key]:
            shown = repr(value) if not isinstance(value, int) or value.bit_length() <= 128 else "a larger number"
            raise RequestError(f"line {line}: {key!r} must be a whole number from {lowest} to {LARGEST[key]}; "
                               f"got {shown}")  # fmt: skip
    for key in ("guidance", "true_cfg_scale", "guidance_2"):
        scale = values.get(key)
        if scale is not None and not _finite_number(scale):
            shown = repr(scale) if not isinstance(scale, int) or scale.bit_length() <= 128 else "a larger number"
            raise RequestError(f"line {line}: {key!r} must be a finite number; got {shown}")
    guidance, true_cfg_scale = values.get("guidance"), values.get("true_cfg_scale")
    guidance_2 = values.get("guidance_2")
    return Request(index=index, line=line, id=request_id, prompt=fields.get("prompt"),
                   embeddings=str(Path(directory, fields["embeddings"])) if "embeddings" in fields else None, height=values.get("height"), width=values.get("width"),
                   steps=values["steps"], guidance=None if guidance is None else float(guidance), seed=values["seed"],
                   max_sequence_length=values.get("max_sequence_length"), frames=values.get("frames"),
                   negative_prompt=fields.get("negative_prompt"),
                   true_cfg_scale=None if true_cfg_scale is None else float(true_cfg_scale),
                   image=None if raw is None else tuple(str(Path(directory, path)) for path in paths),
                   guidance_2=None if guidance_2 is None else float(guidance_2))  # fmt: skip


def _check_id(line: int, request_id: str) -> None:
    """Refuse an id that cannot name the output file ``{id}.png`` in the output directory."""
    name = f"{request_id}.png"
    problem = None
    if "/" in request_id or request_id in (".", ".."):
        problem = "no '/' in it"
    elif any(ord(character) < 32 or ord(character) == 127 for character in request_id):
        problem = "no control characters (such as \\u0000) in it"
    else:
        size = len(name.encode())
        if size > MAX_FILE_NAME_BYTES:
            problem = f"at most {MAX_FILE_NAME_BYTES} bytes (UTF-8) with the '.png'; it has {size}"
    if problem is not None:
        shown = request_id if len(request_id) <= 40 else request_id[:40] + "..."
        raise RequestError(f"line {line}: id {shown!r} names the output file {{id}}.png: {problem}")


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
