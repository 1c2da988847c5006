"""deepspeed_knap.runtime.manifest's file logic: a manifest written last and atomically, and every way
a directory can differ from it (a missing file, a size, a digest, a file it does not list) named."""

import hashlib
import json

import pytest

from deepspeed_knap.runtime.manifest import (
    MANIFEST,
    ManifestError,
    build_manifest,
    checkpoint_file_rank,
    list_files,
    read_manifest,
    sampled_digest,
    sha256_file,
    verify_files,
    write_manifest,
)


@pytest.fixture
def directory(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"a" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.pt").write_bytes(bytes(range(256)) * 300)
    write_manifest(tmp_path, build_manifest(tmp_path, metadata={"step": 3}))
    return tmp_path


def test_a_manifest_lists_every_file_with_size_and_the_sha256_that_sha256sum_prints(directory):
    manifest = read_manifest(directory)
    assert manifest["format"] == "deepspeed-knap manifest" and manifest["version"] == 1
    assert manifest["metadata"] == {"step": 3} and manifest["created"] > 0
    assert manifest["files"] == {
        "a.pt": {"size": 1000, "sha256": hashlib.sha256(b"a" * 1000).hexdigest()},
        "sub/b.pt": {"size": 76800, "sha256": hashlib.sha256(bytes(range(256)) * 300).hexdigest()},
    }
    assert sha256_file(directory / "a.pt") == manifest["files"]["a.pt"]["sha256"]
    assert verify_files(directory, manifest) == []
    # The manifest and temporary files of a write in progress are not part of what it describes.
    (directory / f".{MANIFEST}.tmp.host.0").write_text("{")
    assert sorted(list_files(directory)) == ["a.pt", "sub/b.pt"]
    assert verify_files(directory, manifest) == []


def test_a_missing_file_is_named(directory):
    (directory / "sub" / "b.pt").unlink()
    assert verify_files(directory, read_manifest(directory)) == ["sub/b.pt is missing"]


def test_a_truncated_file_is_named_with_both_sizes_before_any_hashing(directory, monkeypatch):
    data = (directory / "sub" / "b.pt").read_bytes()
    (directory / "sub" / "b.pt").write_bytes(data[:1000])
    hashed = []
    monkeypatch.setattr("deepspeed_knap.runtime.manifest.sha256_file", hashed.append)
    (problem,) = verify_files(directory, read_manifest(directory), names=["sub/b.pt"])
    assert hashed == []  # a size that differs needs no hash
    assert problem == "sub/b.pt is 1,000 bytes, the manifest says 76,800 (truncated, or written by another save)"


def test_a_file_changed_in_place_is_named_by_its_digest(directory):
    (directory / "a.pt").write_bytes(b"b" * 1000)  # same size, other contents (a tensor scaled by 2)
    (problem,) = verify_files(directory, read_manifest(directory))
    expected = hashlib.sha256(b"a" * 1000).hexdigest()[:16]
    assert problem.startswith("a.pt has sha256 ") and f"the manifest says {expected}" in problem
    # Only the names asked for are read: a caller checking its own share does not hash the rest.
    assert verify_files(directory, read_manifest(directory), names=["sub/b.pt"]) == []
    assert verify_files(directory, read_manifest(directory), digests=False) == []


def test_a_file_the_manifest_does_not_list_is_named(directory):
    (directory / "zero_pp_rank_3_mp_rank_00_optim_states.pt").write_bytes(b"stale")
    assert verify_files(directory, read_manifest(directory)) == [
        "zero_pp_rank_3_mp_rank_00_optim_states.pt is not in the manifest"
    ]


def test_a_missing_or_damaged_manifest_is_an_error_naming_the_file(directory, tmp_path_factory):
    empty = tmp_path_factory.mktemp("partial")
    with pytest.raises(ManifestError, match=f"no {MANIFEST} in {empty}"):
        read_manifest(empty)
    (directory / MANIFEST).write_text('{"files": ')
    with pytest.raises(ManifestError, match=f"{directory / MANIFEST} is not a manifest"):
        read_manifest(directory)
    (directory / MANIFEST).write_text(json.dumps({"format": "something else", "files": {}}))
    with pytest.raises(ManifestError, match="not a manifest"):
        read_manifest(directory)
    # No creation time (a hand-edited manifest): refused as a manifest error, which the ranks agree
    # on, not a KeyError where checkpoint tags are ordered by it (review).
    manifest = build_manifest(directory)
    del manifest["created"]
    (directory / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="its 'created' is None, not a time in seconds"):
        read_manifest(directory)


def test_writing_replaces_the_manifest_atomically_and_leaves_no_temporary_file(directory):
    (directory / "c.pt").write_bytes(b"c")
    write_manifest(directory, build_manifest(directory))
    assert sorted(read_manifest(directory)["files"]) == ["a.pt", "c.pt", "sub/b.pt"]
    assert sorted(p.name for p in directory.iterdir()) == ["a.pt", "c.pt", MANIFEST, "sub"]


def test_deepspeed_checkpoint_files_name_the_rank_that_writes_and_loads_them():
    assert checkpoint_file_rank("zero_pp_rank_12_mp_rank_00_optim_states.pt") == 12
    assert checkpoint_file_rank("bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt") == 3
    assert checkpoint_file_rank("zero_pp_rank_0_mp_rank_00_model_states.pt") == 0
    assert checkpoint_file_rank("mp_rank_00_model_states.pt") is None  # ZeRO-1/2: every rank loads it


def test_a_sampled_digest_sees_a_rescaled_copy_and_is_the_same_from_bytes_or_a_file(tmp_path):
    data = bytes(range(256)) * 1000
    (tmp_path / "x").write_bytes(data)
    assert sampled_digest(tmp_path / "x") == sampled_digest(data)
    assert sampled_digest(data) != sampled_digest(bytes(2 * b % 256 for b in data))
    assert sampled_digest(data) != sampled_digest(data[:-1])
    with pytest.raises(OSError):
        sampled_digest(tmp_path / "missing")


def test_the_command_line_writes_a_manifest_for_trusted_files_and_checks_one(tmp_path, capsys):
    from deepspeed_knap.runtime.manifest import main

    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 10)
    assert main([str(tmp_path)]) == 0
    assert list(read_manifest(tmp_path)["files"]) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert main(["--check", str(tmp_path)]) == 0
    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 5)
    assert main(["--check", str(tmp_path)]) == 1
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is 5 bytes, the manifest says 10" in capsys.readouterr().err


def test_tags_given_manifests_on_the_command_line_keep_the_order_they_were_saved_in(tmp_path):
    """The command line dated a manifest by when it ran: tags given manifests in the shell's order
    (step100, step1000, step200) made --resume SAVE_DIR take the last one given, step200, as the
    newest, rolling the run back 800 steps."""
    import os

    from deepspeed_knap.runtime.manifest import main

    for saved_at, tag in enumerate(("step100", "step200", "step1000")):
        (tmp_path / tag).mkdir()
        shard = tmp_path / tag / "mp_rank_00_model_states.pt"
        shard.write_bytes(b"x" * 10)
        os.utime(shard, (1_700_000_000 + saved_at, 1_700_000_000 + saved_at))
    for tag in sorted(("step100", "step200", "step1000")):  # the shell's order
        assert main([str(tmp_path / tag)]) == 0
    created = {tag: read_manifest(tmp_path / tag)["created"] for tag in ("step100", "step200", "step1000")}
    assert created == {"step100": 1_700_000_000, "step200": 1_700_000_001, "step1000": 1_700_000_002}


def test_a_save_over_a_tag_removes_the_older_saves_files_first(tmp_path):
    """A tag saved by 4 ranks' ZeRO-3, then again by 2: ranks 2's and 3's shards stayed, and the
    new manifest listed them (DeepSpeed's own tools then counted 4 shards for 2 ranks)."""
    from deepspeed_knap.runtime.manifest import prepare_checkpoint_save

    tag = tmp_path / "step10"
    (tag / "offloaded_tensors" / "rank0").mkdir(parents=True)  # ZeRO's offload: DeepSpeed will not copy over it
    for name in ("zero_pp_rank_3_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt",
                 "offloaded_tensors/rank0/state.pt", MANIFEST):  # fmt: skip
        (tag / name).write_bytes(b"old")
    prepare_checkpoint_save(tmp_path, "step10")
    assert list(tag.iterdir()) == [] and tag.is_dir()
    prepare_checkpoint_save(tmp_path, "step11")  # a new tag: nothing there yet
