"""Latent samples for training, for every model family: directories of prepared samples, one
``.safetensors`` file each (read in a fixed order by a global position, with the start-up and per-read
checks that make every rank refuse the same bad data together), synthetic samples of a bundled data
mix (:class:`SyntheticMixLatents`), and the noise of the flow-matching objective (:func:`flow_noise`).

A family supplies what one file must hold (``check_file``: FLUX's
:func:`~deepspeed_knap.models.flux.data.check_latent_file`, Wan's
:func:`~deepspeed_knap.models.wan.data.check_video_latent_file`) and the script that writes such
files (named in the errors). The directory holds a ``manifest.json``
(:mod:`deepspeed_knap.runtime.manifest`: each file's size and sha256) written after the samples by
:func:`write_latent_manifest`.

Contents are verified where it costs no extra read of the data. With a manifest, the ranks agree at
start-up that they hold the same manifest, that the directory lists exactly its files, and each rank
compares the sizes of its share of them (a stat each); then each rank compares the sha256 of every
file it reads, when it reads it (the bytes are in memory anyway: ~1.6 GiB/s of hashing, next to a
training step on those samples), so a copy that differs is refused before it trains, whatever the
dataset's size, and only files that would train are ever hashed. Without a manifest (data written
before there was one, or by another tool) every rank computes a sampled digest of every file (its
size and 4 KiB at the start, middle and end: 12 KiB of reads per file per rank) and the ranks compare
them at start-up: that finds a copy rewritten, rescaled or truncated, not a change confined to bytes
it does not read; write a manifest for the full check.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.generation.requests import read_image
from deepspeed_knap.models.registry import sample_shapes
from deepspeed_knap.runtime.manifest import (
    MANIFEST,
    ManifestError,
    build_manifest,
    read_manifest,
    sampled_digest,
    write_manifest,
)

__all__ = [
    "LatentDirectory",
    "LatentFileError",
    "SyntheticMixLatents",
    "check_latent_directory",
    "flow_noise",
    "latent_directory_error",
    "near_square_grid",
    "non_float_tensors",
    "prepared_image",
    "reference_sizes",
    "sample_file_header",
    "targets_and_references",
    "write_latent_manifest",
]

# What is wrong with one sample file for a model config, or None (reads the header only).
FileCheck = Callable[[Path, Mapping], "str | None"]


SAMPLE_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names of the dtypes a sample may hold


def sample_file_header(file: str | Path, fix: str) -> dict[str, tuple[tuple[int, ...], str]] | str:
    """``{key: (shape, dtype)}`` of a sample file's tensors, read from its header alone (no tensor
    data), or why it cannot be read: the message names the file and ends with ``fix``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as handle:
            slices = {key: handle.get_slice(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
            return {key: (tuple(piece.get_shape()), piece.get_dtype()) for key, piece in slices.items()}
    except (SafetensorError, OSError) as error:
        return f"{file}: not a readable .safetensors file ({error}); {fix}"


def non_float_tensors(file: str | Path, headers: Mapping[str, tuple[tuple[int, ...], str]], fix: str) -> str | None:
    """Why a sample file's tensors (:func:`sample_file_header`) are not all floating point, or ``None``."""
    not_float = {key: dtype for key, (_, dtype) in headers.items() if dtype not in SAMPLE_FLOAT_DTYPES}
    if not_float:
        return f"{file}: tensors {not_float} are not floating point ({'/'.join(SAMPLE_FLOAT_DTYPES)}); {fix}"
    return None


def flow_noise(x0: Tensor, generator: torch.Generator,
               sigma_range: tuple[float, float] | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(sigma, noisy, velocity)`` of one sample's flow-matching step (FLUX's rectified flow, Wan's
    flow matching): ``sigma = sigmoid(n)``, ``n ~ N(0, 1)`` (logit-normal), a 0-dim tensor in
    ``x0``'s dtype, one value for the mix and the timestep; ``noisy = (1 - sigma) * x0 + sigma *
    noise`` and the target ``velocity = noise - x0``, both shaped as ``x0``. Draws ``n``, then the
    noise (fp32), from ``generator``. ``sigma_range`` ``(lo, hi)``: the logit-normal draw scaled into
    it (one expert of a two-expert model trains on its side of the boundary)."""
    sigma = torch.sigmoid(torch.randn((), generator=generator))
    if sigma_range is not None:
        sigma = sigma_range[0] + (sigma_range[1] - sigma_range[0]) * sigma
    sigma = sigma.to(x0.dtype)
    noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0.dtype)
    return sigma, (1 - sigma) * x0 + sigma * noise, noise - x0


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
# An edit's reference image beside its target: NAME.refN.png is reference N of NAME.png.
_REFERENCE_NAME = re.compile(r"^(?P<target>.+)\.ref(?P<number>\d+)$")


def prepared_image(path: str | Path) -> Any:
    """The image at ``path`` for a prepare script: RGB, oriented by its EXIF tag
    (:func:`~deepspeed_knap.generation.requests.read_image`, as diffusers' ``load_image``); an
    unreadable one stops the run (``SystemExit``), naming the file."""
    try:
        return read_image(path)
    except ValueError as error:
        raise SystemExit(f"{error}; replace or remove it") from None


def targets_and_references(directory: str | Path) -> list[tuple[Path, str, list[Path]]]:
    """The images of a preparation folder: every target (name order) with the caption of its
    ``.txt`` twin and its references ``NAME.ref1``, ``NAME.ref2``, ... in number order. A file is a
    reference when its name is exactly ``NAME.refN`` before the suffix; every other image is a target.

    Raises:
        ValueError: not a directory, no target image, targets without a caption, references without
            their target or two of one number, each listed at once (before anything loads).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory; give the folder of images and captions")
    images = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    matches = {p: _REFERENCE_NAME.match(p.stem) for p in images}
    targets = [p for p, match in matches.items() if match is None]
    if not targets:
        raise ValueError(f"no target images ({', '.join(IMAGE_SUFFIXES)}) in {directory}; give images with a .txt "
                         "caption each")  # fmt: skip
    problems = []
    missing = [p.with_suffix(".txt").name for p in targets if not p.with_suffix(".txt").is_file()]
    if missing:
        problems.append(f"{len(missing)} images have no caption file ({', '.join(missing[:10])}): write one .txt "
                        "per image")  # fmt: skip
    by_target: dict[str, dict[int, Path]] = {p.stem: {} for p in targets}
    orphans, doubles = [], []
    for path, match in matches.items():
        if match is None:
            continue
        numbers = by_target.get(match["target"])
        if numbers is None:
            orphans.append(path.name)
        elif int(match["number"]) in numbers:
            doubles.append(path.name)
        else:
            numbers[int(match["number"])] = path
    if orphans:
        problems.append(f"references without their target image ({', '.join(orphans[:10])}): NAME.refN.png is a "
                        "reference of NAME.png beside it; add the target or remove them")  # fmt: skip
    if doubles:
        problems.append(f"references of a number already taken ({', '.join(doubles[:10])}): one file per NAME.refN")
    if problems:
        raise ValueError(f"{directory}: " + "; ".join(problems))
    return [(p, read_caption_file(p.with_suffix(".txt")), [by_target[p.stem][n] for n in sorted(by_target[p.stem])])
            for p in targets]  # fmt: skip


def read_caption_file(path: Path) -> str:
    """The caption in ``path``, stripped: UTF-8 text, a byte-order mark dropped (it would reach the
    text encoder as a character).

    Raises:
        ValueError: naming the file, when it cannot be read or is not UTF-8.
    """
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"caption {path} cannot be read as UTF-8 text ({error}); save it as UTF-8") from None


def reference_sizes(shape: SampleShape, reference: int) -> list[int]:
    """Tokens of each reference image of a synthetic sample with ``reference`` reference tokens:
    ``shape.frames - 1`` images (at most one per token), the tokens split evenly."""
    count = min(max(shape.frames - 1, 1), reference)
    return [reference // count + (i < reference % count) for i in range(count)]


def near_square_grid(tokens: int) -> tuple[int, int]:
    """``(height, width)`` of a near-square grid of exactly ``tokens`` cells (the widest divisor of
    ``tokens`` up to its square root gives the height): a synthetic image of that many tokens."""
    height = max(d for d in range(1, math.isqrt(tokens) + 1) if tokens % d == 0)
    return height, tokens // height


class SyntheticMixLatents:
    """Each step, each rank's latent samples drawn from a bundled data mix (``deepspeed-knap plan
    --mix``'s names), with random contents: a family's subclass names its sample maker,
    ``make_samples(shapes, config, seed, token_scale, dtype)``. A function of the seed, the step and
    the rank only, so every rank draws the step's sizes alike and its own samples."""

    make_samples: ClassVar[Callable[..., list[dict[str, Tensor]]]]

    def __init__(self, mix: str, config: Mapping, token_scale: float = 1.0, seed: int = 0) -> None:
        sample_shapes(mix, 1)  # an unknown name raises here, not at the first step
        self.mix, self.config, self.token_scale, self.seed = mix, config, token_scale, seed

    def step_samples(self, step: int, rank: int, world_size: int, dtype=torch.float32) -> list[dict[str, Tensor]]:
        shapes: list[SampleShape] = sample_shapes(self.mix, world_size, seed=self.seed * 100_003 + step)[rank]
        return self.make_samples(
            shapes, self.config, (self.seed * 100_003 + step) * 4099 + rank, self.token_scale, dtype
        )


class LatentFileError(ValueError):
    """A latent sample file cannot be read, or is not the file its directory's manifest describes. The
    message names the file, what differs and the fix."""


_MANIFEST_FIX = "write the manifest again with python -m deepspeed_knap.runtime.manifest {path}"


def _integer_valued(key: str) -> bool:
    """Whether a sample's ``key`` holds whole numbers stored as floats (position ids, Qwen-Image's
    ``img_shapes`` grids), which :meth:`LatentDirectory.read` keeps as stored: bfloat16 holds whole
    numbers exactly only up to 256, so a grid side of 257 would read as 256."""
    return "ids" in key or key.endswith("shapes")


class LatentDirectory:
    """A directory of latent samples, one ``.safetensors`` file each, read in name order, or in a
    new order each epoch after :meth:`shuffle`.

    Samples are addressed by a global *position* that runs on across epochs (passes over the
    files): ``read(position, k)`` gives the files at positions ``position`` to ``position + k - 1``,
    position ``p`` being the ``p % n``-th file of epoch ``p // n`` (``n`` files). A training loop
    gives rank ``r`` of ``W`` the files at ``position + r * k`` each step and advances ``position``
    by ``W * k``; a checkpoint that records ``position`` lets a resumed run continue with the next
    unseen file.

    Start-up checks are split so that ranks can share the work and agree (see :meth:`check` and
    :func:`latent_directory_error`); the class itself never communicates.

    Args:
        path: the directory.
        samples_per_rank: ``k``, files each rank reads per step.
        repeat: allow fewer files than one step needs (``world_size * k``), repeating files within
            a step; without it that is an error, because it silently trains duplicates.
        check_file: what is wrong with one file for a model config, or ``None``, from its header
            alone (the family's format: FLUX's ``check_latent_file``, Wan's ``check_video_latent_file``).
        writer: the script that writes this family's files, named in the errors' fixes.
    """

    def __init__(self, path: str | Path, samples_per_rank: int = 1, repeat: bool = False, *, check_file: FileCheck,
                 writer: str) -> None:  # fmt: skip
        if samples_per_rank < 1:
            raise ValueError(f"samples_per_rank must be at least 1; got {samples_per_rank}")
        self.path = Path(path)
        self.check_file, self.writer = check_file, writer
        self.files = sorted(self.path.glob("*.safetensors"))
        self.samples_per_rank = samples_per_rank
        self.repeat = repeat
        self.order_seed: int | None = None  # None: name order every epoch (see shuffle)
        self.step_files = 1  # files one step reads over all ranks (see shuffle)
        self._epoch_order: tuple[int, np.ndarray] | None = None  # (epoch, its file indices), the last one read
        # Read here, judged in check: what one rank finds must become every rank's error.
        self.manifest: dict | None = None
        self.manifest_digest: str | None = None  # sha256 of its contents; "bad: ..." when unreadable
        if (self.path / MANIFEST).exists():
            try:
                self.manifest = read_manifest(self.path)
            except ManifestError as error:
                self.manifest_digest = f"bad: {error}"
            else:
                self.manifest_digest = hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()

    def __len__(self) -> int:
        return len(self.files)

    @property
    def listing(self) -> str:
        """The files as a checkpoint records them: how many, and a digest of their names."""
        return f"{len(self.files)} files, names sha256 {self._names_digest()[:16]}"

    def _names_digest(self) -> str:
        return hashlib.sha256("\n".join(file.name for file in self.files).encode()).hexdigest()

    def shuffle(self, seed: int, step_files: int = 1) -> LatentDirectory:
        """Read each epoch's files in an order of its own, a permutation drawn from ``(seed, epoch)``
        (NumPy's PCG64): the same on every rank, and the same again for a resumed run with the same
        seed, so a position still names one file. Returns this directory.

        ``step_files``: the files one step reads over all ranks (ranks x samples per rank). A step
        that spans two epochs reads the end of one and the start of the next, which a draw of its
        own could begin with the same files: each epoch's first ``step_files - 1`` files that the
        epoch before ended with (its last ``step_files - 1``) trade places with the first others
        after them, so no step reads a file twice where there are ``4 * (step_files - 1)`` files or
        more (with fewer, as far as the files allow)."""
        if seed < 0 or step_files < 1:
            raise ValueError(f"shuffle needs a seed >= 0 and step_files >= 1; got {seed} and {step_files}")
        self.order_seed, self.step_files, self._epoch_order = int(seed), int(step_files), None
        return self

    def file_at(self, position: int) -> Path:
        """The file at global ``position`` (>= 0; see the class docstring)."""
        epoch, index = divmod(position, len(self.files))
        if self.order_seed is None:
            return self.files[index]
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            self._epoch_order = (epoch, self._epoch_files(epoch))
        return self.files[self._epoch_order[1][index]]

    def _epoch_files(self, epoch: int) -> np.ndarray:
        """``[n]`` the file indices of ``epoch`` in the order :meth:`shuffle` reads them."""
        n, overlap = len(self.files), self.step_files - 1
        order = np.random.default_rng([self.order_seed, epoch]).permutation(n)
        if epoch == 0 or overlap == 0 or n <= 2 * overlap:
            return order
        # The trades keep to an epoch's first n - overlap places, so the epoch before ends as drawn.
        ended = set(np.random.default_rng([self.order_seed, epoch - 1]).permutation(n)[n - overlap :].tolist())
        spare = (j for j in range(overlap, n - overlap) if int(order[j]) not in ended)
        for i in range(overlap):
            if int(order[i]) in ended:
                j = next(spare, None)
                if j is None:
                    break
                order[i], order[j] = order[j], order[i]
        return order

    def check(self, rank: int, world_size: int, config: Mapping) -> dict:
        """This rank's share of the start-up checks: every file ``rank::world_size`` is opened and its
        header (keys, shapes, dtypes) checked against the model ``config`` without reading the
        tensors, and its size compared with the manifest's. Returns a report for
        :func:`latent_directory_error`: the file listing as this rank sees it (count and digest of the
        names), the digest of its manifest, how the listing differs from the manifest, a sampled
        digest of every file when there is no manifest, and one problem per bad file, each naming it."""
        share = self.files[rank::world_size]
        problems = [problem for file in share if (problem := self.check_file(file, config))]
        unlisted, content = [], {}
        if self.manifest is not None:
            listed = {name: entry for name, entry in self.manifest["files"].items() if name.endswith(".safetensors")}
            names = {file.name for file in self.files}
            unlisted = [sorted(set(listed) - names), sorted(names - set(listed))]  # [missing, not in it]
            for file in share:
                expected = listed.get(file.name, {}).get("size")
                try:
                    size = file.stat().st_size
                except OSError as error:
                    problems.append(f"{file}: cannot be read ({error})")
                    continue
                if expected is not None and size != expected:
                    problems.append(f"{file}: {size:,} bytes, {MANIFEST} says {expected:,} (truncated or replaced)")
        else:
            for file in self.files:  # ~30 bytes of report per file, gathered from every rank
                try:
                    content[file.name] = sampled_digest(file)
                except OSError as error:
                    content[file.name] = f"unreadable: {error}"
        return {
            "rank": rank,
            "path": str(self.path),
            "writer": self.writer,
            "count": len(self.files),
            "digest": self._names_digest(),
            "needed": world_size * self.samples_per_rank,
            "repeat": self.repeat,
            "problems": problems,
            "manifest": self.manifest_digest,
            "unlisted": unlisted,
            "content": content,
        }

    def read(self, position: int, count: int, dtype=torch.float32) -> tuple[list[str], list[dict[str, Tensor]]]:
        """The ``count`` samples from global position ``position`` on (:meth:`file_at`), floating tensors
        other than the ids in ``dtype``. With a manifest, each file's bytes are compared with it (size
        and sha256) before they are used. Returns ``(file names, samples)``.

        Raises:
            LatentFileError: a file cannot be read or differs from the manifest (this rank only: the
                caller agrees with the other ranks, as ``examples/train_dit.py`` does each step).
        """
        from safetensors.torch import load

        files = [self.file_at(position + i) for i in range(count)]
        samples = []
        for file in files:
            try:
                data = file.read_bytes()
            except OSError as error:
                raise LatentFileError(f"cannot read latent sample {file}: {error}") from error
            if self.manifest is not None:
                self._compare_with_manifest(file, data)
            try:
                sample = load(data)
            except Exception as error:  # the safetensors error alone does not say which file
                raise LatentFileError(f"cannot read latent sample {file}: {error}") from error
            samples.append({key: t.to(dtype) if t.is_floating_point() and not _integer_valued(key) else t
                            for key, t in sample.items()})  # fmt: skip
        return [str(file) for file in files], samples

    def _compare_with_manifest(self, file: Path, data: bytes) -> None:
        expected = self.manifest["files"].get(file.name)
        fix = f"copy it again from the original, or, if the change was meant, {_MANIFEST_FIX.format(path=self.path)}"
        if expected is None:
            raise LatentFileError(f"{file}: not in {MANIFEST}; {fix}")
        if len(data) != expected["size"]:
            raise LatentFileError(f"{file}: {len(data):,} bytes, {MANIFEST} says {expected['size']:,}; {fix}")
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected["sha256"]:
            raise LatentFileError(
                f"{file}: sha256 {actual[:16]}..., {MANIFEST} says {expected['sha256'][:16]}...: this copy differs "
                f"from the file {self.writer} wrote; {fix}"
            )


def write_latent_manifest(directory: str | Path) -> Path:
    """Write ``directory``'s manifest of its ``.safetensors`` samples (after they are all written: a
    directory without one is taken for unverified data)."""
    directory = Path(directory)
    names = sorted(file.name for file in directory.glob("*.safetensors"))
    return write_manifest(directory, build_manifest(directory, names))


def check_latent_directory(data: LatentDirectory, config: Mapping) -> None:
    """Every rank's share of :meth:`LatentDirectory.check`, gathered and judged alike on every rank
    (collective over the world: two all-gathers on the accelerator device).

    Raises:
        ValueError: the same on every rank, from :func:`latent_directory_error`.
    """
    import deepspeed.comm as dist

    from deepspeed_knap.runtime.groups import all_gather_bytes

    report = data.check(dist.get_rank(), dist.get_world_size(), config)
    problem = latent_directory_error([json.loads(raw) for raw in all_gather_bytes(json.dumps(report).encode())])
    if problem:
        raise ValueError(problem)


def latent_directory_error(reports: Sequence[Mapping], limit: int = 10) -> str | None:
    """One message for every rank from every rank's :meth:`LatentDirectory.check` report, or
    ``None`` when all is well: ranks that list different files, too few files for one step, and
    the bad files (the first ``limit``, with a count of the rest)."""
    first = reports[0]
    views = {}
    for report in reports:
        views.setdefault((report["count"], report["digest"]), []).append(report["rank"])
    if len(views) > 1:
        seen = "; ".join(f"ranks {ranks} see {count} files" for (count, _), ranks in views.items())
        return (f"the ranks see different files in {first['path']}: {seen}; every rank must read the same directory "
                "(a shared file system, or identical copies on every node)")  # fmt: skip
    manifests = {}
    for report in reports:
        manifests.setdefault(report.get("manifest"), []).append(report["rank"])
    if len(manifests) > 1:
        seen = ", ".join(f"{_ranks(ranks)} {_manifest_seen(digest)}" for digest, ranks in manifests.items())
        return (f"the ranks see different manifests in {first['path']}: {seen}; every rank must read the same "
                f"directory, {MANIFEST} included (copy it to every node)")  # fmt: skip
    if (first.get("manifest") or "").startswith("bad: "):
        return first["manifest"].removeprefix("bad: ")
    if first["count"] == 0:
        return f"no .safetensors files in {first['path']}; write some with {first['writer']}"
    if first["count"] < first["needed"] and not first["repeat"]:
        return (f"{first['path']} has {first['count']} latent files but one step needs {first['needed']} "
                "(ranks x samples per rank), so files would repeat within a step; add files, lower "
                "--samples-per-rank, or pass --repeat-data to allow it")  # fmt: skip
    missing, extra = first.get("unlisted") or ([], [])
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{_count(len(missing), 'listed file is', 'listed files are')} missing ({_some(missing)})")
        if extra:
            parts.append(f"{_count(len(extra), 'file is', 'files are')} not in it ({_some(extra)})")
        return (f"{first['path']} does not match its {MANIFEST}: {'; '.join(parts)}; rerun {first['writer']}, "
                f"or, if the files are right, {_MANIFEST_FIX.format(path=first['path'])}")  # fmt: skip
    if first.get("content"):
        differing = []
        for name in first["content"]:
            copies = {}
            for report in reports:
                copies.setdefault(report["content"][name], []).append(report["rank"])
            if len(copies) > 1:
                differing.append(f"{name}: " + " / ".join(_ranks(ranks) for ranks in copies.values()))
        if differing:
            more = f"; and {len(differing) - limit} more" if len(differing) > limit else ""
            return (f"the ranks' copies of {first['path']} differ: {'; '.join(differing[:limit])}{more} (a sampled "
                    f"digest of each file: its size and 4 KiB at its start, middle and end); make the copies "
                    f"identical, and write a manifest ({first['writer']} does; or "
                    f"python -m deepspeed_knap.runtime.manifest {first['path']}) to have every byte each rank "
                    "reads checked")  # fmt: skip
    problems = [problem for report in reports for problem in report["problems"]]
    if not problems:
        return None
    more = f"\n... and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"{len(problems)} bad latent files in {first['path']}:\n" + "\n".join(problems[:limit]) + more


def _manifest_seen(digest: str | None) -> str:
    if digest is None:
        return "has none"
    return "has an unreadable one" if digest.startswith("bad: ") else f"has one with sha256 {digest[:12]}..."


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _count(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _some(names: Sequence[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
