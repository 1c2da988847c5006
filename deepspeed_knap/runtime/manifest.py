"""Manifests: the files a directory must hold, with their sizes and sha256 digests, written last so that
a directory without one is known to be incomplete; and, for DeepSpeed checkpoint tags, a manifest
written by the ranks together after a save and checked by the ranks together before a load.

A manifest is ``manifest.json`` in the directory it describes, written after every file it lists and
atomically (a temporary file renamed over it): a checkpoint tag or a prepared-data directory without
one is partial (a save or a ``prepare_*`` run that did not finish). Format (JSON)::

    {
      "format": "deepspeed-knap manifest",
      "version": 1,
      "created": 1764081234.5,       # when written (orders checkpoint tags: newest first); the
                                     # command line's: its files' newest modification time
      "metadata": {"step": 3},       # the writer's own (a checkpoint's training step)
      "files": {                     # every file, by path relative to the directory, "/"-separated
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": {"size": 2897107, "sha256": "9f86d0..."}
      }
    }

The digest is the sha256 of the whole file, as ``sha256sum`` prints it, so an operator can check a
file by hand. Measured on a 2-core x86 VM with the SHA extensions (OpenSSL through hashlib), best of
4 over 256 MiB: sha256 1.68 GiB/s from memory; sha1 1.79, blake2b 0.72-0.88, md5 0.70, and zlib's
crc32 1.8-3.9 (32 bits, not a strong digest). A 1 GiB file streamed from the page cache hashes at
1.3 GiB/s (0.6-0.7 with the machine loaded), where reading it alone runs at 2.6 GiB/s. A faster
non-cryptographic hash (xxh3) would be another dependency and still wait on the disk. What keeps
multi-GB ZeRO shards cheap is who hashes what: each file is hashed by one rank, the rank whose number
DeepSpeed put in its name (at a save, the rank that just wrote it, its bytes still in the page cache;
at a resume, the rank that loads it, which then reads it from the page cache), so every rank hashes
its own shards while the others hash theirs: a 20 GB optimizer shard per rank costs about 15 s at
1.3 GiB/s at each save, and again before a load. A size that differs is found by a stat, before any
hashing.

Command line, for a directory written before manifests existed (trusting its files as they are)::

    python -m deepspeed_knap.runtime.manifest DIR            # write DIR/manifest.json
    python -m deepspeed_knap.runtime.manifest --check DIR    # compare DIR with its manifest

Its manifest is dated by the files' newest modification time, not by when the command ran: tags
given manifests in any order keep the order they were saved in (``--resume SAVE_DIR`` takes the
newest), as long as copies kept the times (``cp -p``, ``rsync -t``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "deepspeed-knap manifest"
VERSION = 1

# The bytes a sampled digest reads at the start, middle and end of a file.
_SAMPLE_BYTES = 4096


class ManifestError(ValueError):
    """A manifest is missing, unreadable, or the directory does not match it. The message names the
    directory (or checkpoint tag), each file and what differs."""


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's contents, hex (what ``sha256sum`` prints), streamed in 1 MiB reads."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def sampled_digest(source: bytes | str | Path) -> str:
    """A cheap fingerprint of a file's contents (16 hex digits): its size and 4 KiB at its start,
    middle and end. The same from the bytes or from the file; a copy rewritten, rescaled or
    truncated changes it, a change confined to bytes it does not read does not (a manifest's sha256
    sees those). Raises ``OSError`` for a file that cannot be read."""
    if isinstance(source, bytes):
        size = len(source)

        def read(offset: int) -> bytes:
            return source[offset : offset + _SAMPLE_BYTES]
    else:
        handle = open(source, "rb")  # noqa: SIM115 (closed below, after the reads)
        size = os.fstat(handle.fileno()).st_size

        def read(offset: int) -> bytes:
            return os.pread(handle.fileno(), _SAMPLE_BYTES, offset)

    try:
        digest = hashlib.sha256(size.to_bytes(8, "little"))
        for offset in sorted({0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)}):
            digest.update(read(offset))
    finally:
        if not isinstance(source, bytes):
            handle.close()
    return digest.hexdigest()[:16]


def _is_temporary(name: str) -> bool:
    return name.startswith(f".{MANIFEST}.tmp.")


def list_files(directory: str | Path) -> dict[str, int]:
    """``{relative path: size}`` of every regular file under ``directory`` but the manifest and the
    temporary files of a manifest being written; ``{}`` for a directory that does not exist."""
    directory = Path(directory)
    files = {}
    for path in sorted(directory.rglob("*")) if directory.is_dir() else ():
        if path.is_file() and path.name != MANIFEST and not _is_temporary(path.name):
            files[path.relative_to(directory).as_posix()] = path.stat().st_size
    return files


def build_manifest(directory: str | Path, names: Iterable[str] | None = None, metadata: Mapping | None = None) -> dict:
    """The manifest of ``names`` (default: every file :func:`list_files` finds), hashing each file."""
    directory = Path(directory)
    names = sorted(list_files(directory) if names is None else names)
    files = {name: {"size": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
             for name in names}  # fmt: skip
    return manifest_of(files, metadata)


def manifest_of(files: Mapping[str, Mapping], metadata: Mapping | None = None, created: float | None = None) -> dict:
    """A manifest holding ``files`` (``{name: {"size": int, "sha256": hex}}``), in name order."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "created": time.time() if created is None else created,
        "metadata": dict(metadata or {}),
        "files": {name: dict(files[name]) for name in sorted(files)},
    }


def write_manifest(directory: str | Path, manifest: Mapping, suffix: str = "") -> Path:
    """Write ``directory/manifest.json`` atomically: a temporary file (named with ``suffix``, so that
    several writers of one directory do not share one), flushed to disk, then renamed over it."""
    path = Path(directory) / MANIFEST
    temporary = path.with_name(f".{MANIFEST}.tmp.{suffix or os.getpid()}")
    write_atomically(temporary, path, json.dumps(manifest, indent=1) + "\n")
    return path


def write_atomically(temporary: Path, path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, never a part: written to ``temporary``, synced,
    then renamed over ``path``."""
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def read_manifest(directory: str | Path) -> dict:
    """``directory``'s manifest.

    Raises:
        ManifestError: there is none (the directory is partial), or it is not a manifest.
    """
    path = Path(directory) / MANIFEST
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"no {MANIFEST} in {directory}") from None
    except OSError as error:
        raise ManifestError(f"cannot read {path}: {error}") from None
    return _parse_manifest(text, directory)


def _parse_manifest(text: bytes, directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(text)
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError(f"its format is {manifest.get('format')!r}, not {FORMAT!r}")
        for name, entry in manifest["files"].items():
            if not (isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
                raise ValueError(f"its entry for {name!r} is {entry!r}, not a size and a sha256")
        created = manifest.get("created")  # orders checkpoint tags: a number, or the manifest is not one
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            raise ValueError(f"its 'created' is {created!r}, not a time in seconds")
    except (ValueError, AttributeError) as error:
        raise ManifestError(
            f"{path} is not a manifest ({error}); write it again with python -m deepspeed_knap.runtime.manifest "
            f"{directory}, if you trust the files as they are"
        ) from None
    return manifest


def verify_files(
    directory: str | Path, manifest: Mapping, names: Iterable[str] | None = None, digests: bool = True
) -> list[str]:
    """What differs between ``directory`` and its ``manifest``: one line per file, naming it (relative
    to ``directory``). ``names``: only these files (no hunt for files the manifest does not list);
    default every listed file, and every file not listed. Sizes are compared first: a file of the wrong
    size is not hashed. ``digests=False`` compares sizes only."""
    directory = Path(directory)
    listed = manifest["files"]
    problems = []
    if names is None:
        present = list_files(directory)
        problems += [f"{name} is not in the manifest" for name in present if name not in listed]
        names = listed
    for name in sorted(names):
        expected = listed.get(name)
        if expected is None:
            problems.append(f"{name} is not in the manifest")
            continue
        problems += _file_problems(directory, name, expected, digests)
    return sorted(problems)


def _file_problems(directory: Path, name: str, expected: Mapping, digests: bool) -> list[str]:
    path = directory / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [f"{name} is missing"]
    except OSError as error:
        return [f"{name} cannot be read ({error})"]
    if size != expected["size"]:
        return [
            f"{name} is {size:,} bytes, the manifest says {expected['size']:,} (truncated, or written by another save)"
        ]
    if digests:
        try:
            actual = sha256_file(path)
        except OSError as error:
            return [f"{name} cannot be read ({error})"]
        if actual != expected["sha256"]:
            return [
                f"{name} has sha256 {actual[:16]}..., the manifest says {expected['sha256'][:16]}... "
                "(its contents changed after it was written)"
            ]
    return []


_RANK_IN_NAME = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")


def checkpoint_file_rank(name: str) -> int | None:
    """The rank that writes and loads a DeepSpeed checkpoint file, from its name (``zero_pp_rank_R``:
    DeepSpeed's data-parallel rank, the global rank in a data-parallel job such as ours), or ``None``
    for a file every rank loads (ZeRO-1/2's ``mp_rank_00_model_states.pt``)."""
    match = _RANK_IN_NAME.search(Path(name).name)
    return int(match.group(1)) if match else None


# ---- DeepSpeed checkpoint tags: manifests written and checked by the ranks together ----


def prepare_checkpoint_save(save_dir: str | Path, tag: str) -> None:
    """Remove ``tag``'s manifest, then the files of an older save of the tag, before a save writes
    over it: a save that does not finish leaves the tag partial instead of described by the manifest
    of the files it replaced, and the new manifest lists the new save's files alone (a save of 4
    ranks' ZeRO-3 shards left rank 2's and 3's beside a later save of 2 ranks, and a ZeRO-2 save's
    model file beside a ZeRO-3 save's; ZeRO's offloaded tensors, folders DeepSpeed refuses to copy
    over). Every rank calls it before ``engine.save_checkpoint`` (each node's copy goes; on a shared
    file system the ranks race each other's removals: what another rank removed first is skipped;
    the trainer's agreement after it, and DeepSpeed's barrier at the start of the save, keep every
    rank from writing before every rank has removed them)."""
    tag_dir = Path(save_dir) / tag
    (tag_dir / MANIFEST).unlink(missing_ok=True)
    for folder, subfolders, files in os.walk(tag_dir, topdown=False):  # (os.walk skips what vanishes)
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))
        for name in subfolders:
            with contextlib.suppress(OSError):  # removed by another rank, or not empty
                os.rmdir(os.path.join(folder, name))


def write_checkpoint_manifest(save_dir: str | Path, tag: str, metadata: Mapping | None = None) -> dict:
    """Write the manifest of checkpoint ``save_dir/tag`` once ``engine.save_checkpoint`` has returned on
    every rank, then the ``latest`` file naming the tag (collective over the world).

    Each file is hashed by one rank: the rank in its name (:func:`checkpoint_file_rank`, the rank that
    just wrote it) when that rank sees it, else the ranks that see it in turn. Every rank gets the whole
    manifest; the lowest rank of each host writes it (and ``latest``), so that a node-local save
    directory gets its copy too (on a shared file system the copies are one file, replaced atomically).

    Returns:
        the manifest (the same on every rank).

    Raises:
        ManifestError: on every rank, when a rank cannot read a file or write the manifest.
    """
    import deepspeed.comm as dist

    rank = dist.get_rank()
    tag_dir = Path(save_dir) / tag
    host = socket.gethostname()
    try:
        seen, problem = _files_seen(tag_dir), None
    except OSError as error:  # reported by every rank, not raised here alone
        seen, problem = {}, f"cannot list {tag_dir}: {error}"
    raise_together_manifest(problem, f"writing the manifest of checkpoint {tag_dir}")
    views = _gather_json({"host": host, "time": time.time(), "files": seen})
    names = sorted({name for view in views for name in view["files"]})
    mine = {}
    for index, name in enumerate(names):
        seers = [r for r, view in enumerate(views) if name in view["files"]]
        owner = checkpoint_file_rank(name)
        if (owner if owner in seers else seers[index % len(seers)]) == rank:
            try:
                mine[name] = {"size": seen[name][0], "sha256": sha256_file(tag_dir / name)}
            except OSError as error:
                problem = f"cannot read {tag_dir / name}: {error}"
    raise_together_manifest(problem, f"writing the manifest of checkpoint {tag_dir}")
    files = {name: entry for part in _gather_json(mine) for name, entry in part.items()}
    manifest = manifest_of(files, metadata, created=views[0]["time"])
    if rank == min(r for r, view in enumerate(views) if view["host"] == host):
        try:
            write_manifest(tag_dir, manifest, suffix=f"{host}.{rank}")
            write_atomically(Path(save_dir) / f".latest.tmp.{host}.{rank}", Path(save_dir) / "latest", tag)
        except OSError as error:
            problem = f"cannot write {tag_dir / MANIFEST} or {Path(save_dir) / 'latest'}: {error}"
    # Also a barrier: no rank goes on (or exits) before every copy of the manifest is in place.
    raise_together_manifest(problem, f"writing the manifest of checkpoint {tag_dir}")
    return manifest


@dataclass(frozen=True)
class CheckpointChoice:
    """What :func:`find_checkpoint` chose: ``engine.load_checkpoint(load_dir, tag)`` loads it.

    Attributes:
        load_dir: the save directory.
        tag: the checkpoint tag, a directory in ``load_dir``.
        given: the caller named the tag (else it is the newest complete one).
        skipped: ``(tag, why)`` of every tag not taken that was partial, or newer and damaged.
        manifest: the tag's manifest (its ``metadata`` holds what the save recorded).
    """

    load_dir: str
    tag: str
    given: bool
    skipped: list[tuple[str, str]] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)


_LOAD_FIX = (
    "restore the files, or load another tag (give the save directory instead of a tag to take the newest complete one)"
)


def find_checkpoint(path: str | Path) -> CheckpointChoice:
    """The checkpoint to load from ``path``, checked against its manifest by every rank, agreed by all
    (collective over the world; every rank passes its own view of the same path).

    ``path`` is a checkpoint tag (a directory of checkpoint files) or a save directory holding tags; for
    a save directory the newest complete tag (by its manifest's ``created``) that passes the checks is
    taken, and the tags skipped are returned with the reason. The checks: every rank stats every file of
    the manifest it can see (a node-local save directory holds only that node's files): each file must
    be seen by the ranks that load it (the rank in its name, else every rank), with the manifest's size,
    and no file the manifest does not list is there; then each copy of a file (one per host and inode)
    is hashed by one rank that sees it, preferring the rank that loads it (which then reads it again
    from the page cache), and compared with the manifest's sha256.

    Raises:
        ManifestError: the same on every rank: the tag given (or every tag) is partial or damaged,
            naming the tag and each file, what differs and on which ranks; or the ranks see ``path``
            differently, or it is no checkpoint.
    """
    import deepspeed.comm as dist

    world = dist.get_world_size()
    path = Path(path)
    try:
        kind, directories = _checkpoint_kind(path)
        local = {name: _tag_view(directory) for name, directory in directories.items()}
    except OSError as error:  # reported by every rank below, not raised here alone
        kind, local = f"error: {error}", {}
    views = _gather_json({"host": socket.gethostname(), "kind": kind, "tags": local})
    unreadable = [f"rank {rank}: {view['kind']}" for rank, view in enumerate(views) if view["kind"].startswith("error")]
    if unreadable:
        raise ManifestError(f"cannot read checkpoint {path}: {'; '.join(unreadable)}")
    kinds = {}
    for rank, view in enumerate(views):
        kinds.setdefault(view["kind"], []).append(rank)
    if len(kinds) > 1:
        seen = "; ".join(f"{_ranks(ranks, world)} see {_KINDS[k]}" for k, ranks in kinds.items())
        raise ManifestError(
            f"the ranks see {path} differently: {seen}; every rank must see the same checkpoint (a shared file "
            "system, or the same save directory on every node)"
        )
    if kind == "none":
        raise ManifestError(
            f"{path} is neither a checkpoint tag (a directory of DeepSpeed checkpoint files with a {MANIFEST}) "
            "nor a save directory holding such tags; give the --save-dir of a run, or one tag in it"
        )
    load_dir = path.parent if kind == "tag" else path
    tags = sorted({name for view in views for name in view["tags"]})
    usable, skipped = [], []
    for tag in tags:
        reason = _manifest_agreement([view["tags"].get(tag) for view in views], world)
        if reason is None:
            usable.append(tag)
        elif kind == "tag":
            partial = reason.startswith("partial")
            raise ManifestError(
                f"checkpoint {load_dir / tag} is {reason}"
                + (
                    f", which a save writes after all its files; load another tag (give the save directory to take "
                    f"the newest complete one), or, for a checkpoint saved before manifests and trusted as it is, "
                    f"write one with python -m deepspeed_knap.runtime.manifest {load_dir / tag}"
                    if partial
                    else f"; {_LOAD_FIX}"
                )
            )
        else:
            skipped.append((tag, reason))
    usable.sort(key=lambda tag: (views[0]["tags"][tag]["created"], tag), reverse=True)
    for tag in usable:
        problems = _stat_problems(tag, views, local[tag]) if tag in local else ["no manifest here"]
        if not problems:
            problems = _digest_problems(load_dir / tag, views, tag)
        if not problems:
            return CheckpointChoice(str(load_dir), tag, kind == "tag", skipped, local[tag]["parsed"])
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        if kind == "tag":
            raise ManifestError(f"cannot load checkpoint {load_dir / tag}: {shown}; {_LOAD_FIX}")
        skipped.append((tag, shown))
    if not tags:
        raise ManifestError(f"no checkpoint tags in {path}; give the --save-dir of a run that saved one")
    reasons = "; ".join(f"{tag}: {why}" for tag, why in skipped)
    raise ManifestError(f"no complete checkpoint in {path}: {reasons}; {_LOAD_FIX}")


_KINDS = {"tag": "a checkpoint tag", "save": "a save directory", "none": "no checkpoint"}


def _checkpoint_kind(path: Path) -> tuple[str, dict[str, Path]]:
    """``("tag" | "save" | "none", {tag: directory})`` of what this rank sees at ``path``."""
    if not path.is_dir():
        return "none", {}
    entries = list(path.iterdir())
    if (path / MANIFEST).exists() or any(p.suffix == ".pt" and p.is_file() for p in entries):
        return "tag", {path.name: path}
    tags = {p.name: p for p in sorted(entries) if p.is_dir()}
    return ("save", tags) if tags or (path / "latest").is_file() else ("none", {})


def _files_seen(directory: Path) -> dict[str, list[int]]:
    """``{name: [size, device, inode]}`` of every file under ``directory`` (device and inode tell two
    ranks' copies apart: the same file on one host, or one copy per node)."""
    seen = {}
    for name in list_files(directory):
        try:
            stat = (directory / name).stat()
        except OSError:
            continue
        seen[name] = [stat.st_size, stat.st_dev, stat.st_ino]
    return seen


def _tag_view(directory: Path) -> dict:
    """What this rank sees of one tag: its manifest's digest (``None``: none; ``"bad: ..."``: not a
    manifest), and, with one, every listed file's ``[size, device, inode]`` (``None``: missing here), the
    files it does not list, and the manifest itself."""
    try:
        text = (directory / MANIFEST).read_bytes()
    except FileNotFoundError:
        return {"manifest": None}
    except OSError as error:
        return {"manifest": f"bad: cannot read {directory / MANIFEST}: {error}"}
    try:
        manifest = _parse_manifest(text, directory)
    except ManifestError as error:
        return {"manifest": f"bad: {error}"}
    seen = _files_seen(directory)
    return {
        "manifest": hashlib.sha256(text).hexdigest(),
        "created": manifest["created"],
        "files": {name: seen.get(name) for name in manifest["files"]},
        "extra": sorted(set(seen) - set(manifest["files"])),
        "parsed": manifest,
    }


def _manifest_agreement(views: Sequence[Mapping | None], world: int) -> str | None:
    """Why a tag cannot be loaded before looking at its files (no manifest, or not the same one on
    every rank), or ``None``."""
    digests = [None if view is None else view["manifest"] for view in views]
    missing = [rank for rank, digest in enumerate(digests) if digest is None]
    if len(missing) == world:
        return f"partial: no {MANIFEST} (its save did not finish)"
    if missing:
        return f"partial: no {MANIFEST} on {_ranks(missing, world)}"
    bad = next((digest for digest in digests if digest.startswith("bad: ")), None)
    if bad:
        return bad.removeprefix("bad: ")
    if len(set(digests)) > 1:
        groups = {}
        for rank, digest in enumerate(digests):
            groups.setdefault(digest, []).append(rank)
        return f"its {MANIFEST} differs between ranks: " + " / ".join(_ranks(r, world) for r in groups.values())
    return None


def _stat_problems(tag: str, views: Sequence[Mapping], mine: Mapping) -> list[str]:
    """Files missing where they are loaded, of another size, or not listed, from every rank's stat."""
    world = len(views)
    problems = []
    for name, entry in mine["parsed"]["files"].items():
        stats = [view["tags"][tag]["files"][name] for view in views]
        owner = checkpoint_file_rank(name)
        loaders = [owner] if owner is not None and owner < world else list(range(world))
        lacking = [rank for rank in loaders if stats[rank] is None]
        if lacking and owner is not None and owner < world:
            problems.append(f"{name} is missing on rank {owner}, which loads it")
        elif lacking:
            problems.append(f"{name} is missing on {_ranks(lacking, world)}; every rank loads it")
        sizes = {}
        for rank, stat in enumerate(stats):
            if stat is not None and stat[0] != entry["size"]:
                sizes.setdefault(stat[0], []).append(rank)
        for size, ranks in sizes.items():
            problems.append(
                f"{name} is {size:,} bytes on {_ranks(ranks, world)}, the manifest says {entry['size']:,} "
                "(truncated, or written by another save)"
            )
    extra = {}
    for rank, view in enumerate(views):
        for name in view["tags"][tag]["extra"]:
            extra.setdefault(name, []).append(rank)
    problems += [f"{name} is on {_ranks(ranks, world)} but not in the manifest" for name, ranks in extra.items()]
    return problems


def _digest_problems(tag_dir: Path, views: Sequence[Mapping], tag: str) -> list[str]:
    """Each copy of each file hashed by one rank and compared with the manifest (collective)."""
    import deepspeed.comm as dist

    rank, world = dist.get_rank(), len(views)
    expected = views[rank]["tags"][tag]["parsed"]["files"]
    mine = {}
    for index, name in enumerate(sorted(expected)):
        copies = {}
        for r, view in enumerate(views):
            stat = view["tags"][tag]["files"][name]
            if stat is not None:
                copies.setdefault((view["host"], stat[1], stat[2]), []).append(r)
        owner = checkpoint_file_rank(name)
        for seers in copies.values():
            if (owner if owner in seers else seers[index % len(seers)]) == rank:
                try:
                    mine[name] = sha256_file(tag_dir / name)
                except OSError as error:
                    mine[name] = f"unreadable: {error}"
    found = {}
    for r, digests in enumerate(_gather_json(mine)):
        for name, digest in digests.items():
            if digest != expected[name]["sha256"]:
                found.setdefault((name, digest), []).append(r)
    problems = []
    for (name, digest), ranks in sorted(found.items()):
        if digest.startswith("unreadable: "):
            problems.append(f"{name} cannot be read on {_ranks(ranks, world)} ({digest.removeprefix('unreadable: ')})")
        else:
            problems.append(
                f"{name} has sha256 {digest[:16]}... on {_ranks(ranks, world)}, the manifest says "
                f"{expected[name]['sha256'][:16]}... (its contents changed after the save)"
            )
    return problems


def _ranks(ranks: Sequence[int], world: int) -> str:
    """``"rank 1"``, ``"ranks 0 and 2"``, ``"ranks 0, 1 and 3"``, ``"every rank"``."""
    ranks = sorted(ranks)
    if len(ranks) == world > 1:
        return "every rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _gather_json(value) -> list:
    """Every rank's JSON-able ``value``, by rank (two all-gathers on the accelerator device)."""
    from deepspeed_knap.runtime.groups import all_gather_bytes

    return [json.loads(raw) for raw in all_gather_bytes(json.dumps(value).encode())]


def raise_together_manifest(problem: str | None, what: str) -> None:
    """:func:`~deepspeed_knap.runtime.groups.raise_together` with :class:`ManifestError`."""
    from deepspeed_knap.runtime.groups import raise_together

    raise_together(problem, what, ManifestError)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_knap.runtime.manifest",
        description="Write DIR/manifest.json for the files DIR holds now (trusting them), or --check DIR against it.",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--check", action="store_true", help="compare DIR with its manifest instead of writing one")
    args = parser.parse_args(argv)
    directory = Path(args.directory)
    if not directory.is_dir():
        parser.error(f"{directory} is not a directory")
    if args.check:
        try:
            problems = verify_files(directory, read_manifest(directory))
        except ManifestError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        for problem in problems:
            print(f"{directory}: {problem}", file=sys.stderr)
        print(f"{directory}: {'does not match' if problems else 'matches'} its {MANIFEST}")
        return 1 if problems else 0
    manifest = build_manifest(directory)
    times = [(directory / name).stat().st_mtime for name in manifest["files"]]
    manifest["created"] = max(times, default=manifest["created"])  # when saved, not when this ran
    path = write_manifest(directory, manifest)
    print(f"wrote {path} ({len(read_manifest(directory)['files'])} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
