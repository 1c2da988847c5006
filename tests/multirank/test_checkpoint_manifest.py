"""Checkpoint manifests on 2 gloo ranks: written together after a save (each rank hashing its own
shard), checked together before a load. A deleted, truncated or changed file and a partial tag are one
error on every rank naming the file and the tag; without a tag the newest complete one is chosen and
the others are said to be skipped, and why; node-local copies are checked where they are."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.support.distributed import run_distributed

OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"  # no rank in its name: every rank loads it


def _save(save_dir: Path, tag: str, rank: int, step: int, manifest: bool = True) -> None:
    """What DeepSpeed's save leaves: each rank its own shard, rank 0 the shared file; then the manifest."""
    import deepspeed.comm as dist

    from deepspeed_knap.runtime.manifest import write_checkpoint_manifest

    (save_dir / tag).mkdir(parents=True, exist_ok=True)
    (save_dir / tag / OPTIM.format(rank)).write_bytes(bytes([rank, step]) * (5000 + 1000 * rank))
    if rank == 0:
        (save_dir / tag / MODEL).write_bytes(bytes([step]) * 3000)
    dist.barrier()
    if manifest:
        write_checkpoint_manifest(save_dir, tag, {"step": step})


def _outcome(path: Path) -> str:
    """``find_checkpoint``'s choice as one line, or its error."""
    from deepspeed_knap.runtime.manifest import ManifestError, find_checkpoint

    try:
        choice = find_checkpoint(path)
    except ManifestError as error:
        return f"error: {error}"
    return f"{choice.load_dir} {choice.tag} given={choice.given} skipped={choice.skipped}"


def _worker(rank: int, world: int, root: str) -> dict:
    import deepspeed.comm as dist

    from deepspeed_knap.runtime.manifest import read_manifest, sha256_file

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    save = Path(root) / "shared"
    for step in (1, 2):
        _save(save, f"step{step}", rank, step)
    _save(save, "step3", rank, 3, manifest=False)  # a save killed before its manifest
    out = {"latest": (save / "latest").read_text(), "manifest": read_manifest(save / "step2")}
    out["own_digest"] = sha256_file(save / "step2" / OPTIM.format(rank))
    out["newest"] = _outcome(save)
    out["given"] = _outcome(save / "step1")
    out["partial"] = _outcome(save / "step3")
    dist.barrier()

    # Damage step2 as a node would: rank 1's shard deleted, then truncated, then changed in place.
    shard = save / "step2" / OPTIM.format(1)
    good = shard.read_bytes()
    dist.barrier()
    if rank == 1:
        shard.unlink()
    dist.barrier()
    out["deleted"] = _outcome(save / "step2")
    out["fallback"] = _outcome(save)
    dist.barrier()
    if rank == 1:
        shard.write_bytes(good[:100])
    dist.barrier()
    out["truncated"] = _outcome(save / "step2")
    dist.barrier()
    if rank == 1:
        shard.write_bytes(bytes(2 * b % 256 for b in good))
    dist.barrier()
    out["changed"] = _outcome(save / "step2")
    dist.barrier()
    if rank == 1:
        shard.write_bytes(good)
    dist.barrier()

    # Node-local storage: each rank's "node" holds its own shard and a copy of the shared file.
    node = Path(root) / f"node{rank}"
    shutil.copytree(save / "step1", node / "step1")
    (node / "step1" / OPTIM.format(1 - rank)).unlink()
    dist.barrier()
    out["node_local"] = _outcome(node / "step1")
    dist.barrier()
    if rank == 1:  # this node's copy of the shared file differs (same size)
        (node / "step1" / MODEL).write_bytes(bytes([9]) * 3000)
    dist.barrier()
    out["node_copy_differs"] = _outcome(node / "step1")
    dist.barrier()
    if rank == 1:
        (node / "step1" / OPTIM.format(1)).unlink()
    dist.barrier()
    out["node_lacks_own_shard"] = _outcome(node / "step1")
    return out


def test_checkpoint_manifests_are_written_and_checked_together(tmp_path):
    results = run_distributed(_worker, world_size=2, args=(str(tmp_path),), timeout=120)
    save = tmp_path / "shared"
    for key in ("newest", "given", "partial", "deleted", "fallback", "truncated", "changed"):
        assert results[0][key] == results[1][key], key  # one outcome, word for word, on every rank
    first = results[0]

    assert first["latest"] == "step2"  # written after the manifest: never names a partial tag
    files = first["manifest"]["files"]
    assert sorted(files) == [MODEL, OPTIM.format(0), OPTIM.format(1)]
    assert files[OPTIM.format(1)] == {"size": 12000, "sha256": results[1]["own_digest"]}
    assert first["manifest"]["metadata"] == {"step": 2}

    assert first["newest"] == (
        f"{save} step2 given=False skipped=[('step3', 'partial: no manifest.json (its save did not finish)')]"
    )
    assert first["given"] == f"{save} step1 given=True skipped=[]"
    assert first["partial"].startswith(f"error: checkpoint {save / 'step3'} is partial: no manifest.json")

    shard = OPTIM.format(1)
    assert first["deleted"] == (
        f"error: cannot load checkpoint {save / 'step2'}: {shard} is missing on rank 1, which loads it; "
        "restore the files, or load another tag (give the save directory instead of a tag to take the newest "
        "complete one)"
    )
    assert first["fallback"] == (
        f"{save} step1 given=False skipped=[('step3', 'partial: no manifest.json (its save did not finish)'), "
        f"('step2', '{shard} is missing on rank 1, which loads it')]"
    )
    assert f"{shard} is 100 bytes on every rank, the manifest says 12,000" in first["truncated"]
    assert f"{shard} has sha256 " in first["changed"] and "on rank 1" in first["changed"]

    for rank in (0, 1):
        node = tmp_path / f"node{rank}"
        assert results[rank]["node_local"] == f"{node} step1 given=True skipped=[]"
        expected = f"error: cannot load checkpoint {node / 'step1'}: {MODEL} has sha256 "
        assert results[rank]["node_copy_differs"].startswith(expected), results[rank]["node_copy_differs"]
        assert "on rank 1" in results[rank]["node_copy_differs"]
        assert f"{shard} is missing on rank 1, which loads it" in results[rank]["node_lacks_own_shard"]
    assert not any(name.startswith(".manifest") for name in os.listdir(save / "step2"))
