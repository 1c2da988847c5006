"""Loading diffusers checkpoints under ZeRO-3 on 4 gloo ranks: no rank ever holds the whole model,
every partition is exactly DeepSpeed's slice of the stored tensor, and a bad checkpoint raises the
same error on every rank, even when only one rank sees the bad file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.flux_cases import CONFIGS

pytest.importorskip("safetensors")

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}

# FLUX.2 of 190 MB in fp32, in many parameters of which none is large: a full copy is unmistakable
# next to a rank's quarter. FLUX.1 of 30 MB: the same loader, checked for exactness.
LARGE = {
    "flux2": dict(in_channels=16, num_layers=4, num_single_layers=6, attention_head_dim=64, num_attention_heads=8,
                  joint_attention_dim=64, timestep_guidance_channels=32, axes_dims_rope=(16, 16, 16, 16)),
    "flux": dict(in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=64, num_attention_heads=4,
                 joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 24, 24)),
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from deepspeed_knap.models.auto import model_class

    root = tmp_path_factory.mktemp("checkpoints")
    paths = {}
    torch.manual_seed(0)
    for family, config in LARGE.items():
        paths[family] = str(model_class(family)(**config).save_pretrained(root / family, max_shard_size=20 * 2**20))
    small = model_class("flux2")(**CONFIGS["flux2"]).save_pretrained(root / "small", max_shard_size=20_000)
    broken = shutil.copytree(small, root / "broken")
    index = json.loads((broken / "diffusion_pytorch_model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[1]
    (broken / missing).unlink()
    paths.update(small=str(small), broken=str(broken), missing=missing)
    return paths


def _loading_worker(rank: int, world: int, paths: dict) -> dict:
    import deepspeed
    from safetensors import safe_open

    from deepspeed_knap.models.auto import model_class
    from deepspeed_knap.models.loading import CheckpointError, HostMemory, load_checkpoint, weight_files
    from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

    results = {}
    for family in LARGE:
        model, report = load_checkpoint(model_class(family), paths[family], ds_config=ZERO3)
        if family == next(iter(LARGE)):  # every rank has mapped DeepSpeed's CPU all-reduce buffers: drop ours
            deepspeed.comm.barrier()
            unlink_own_shm_buffer(rank)
        files = weight_files(Path(paths[family]))
        mismatched = []
        with HostMemory.measure() as gathered, deepspeed.zero.GatheredParameters(list(model.parameters())):
            for name, param in model.named_parameters():  # DeepSpeed's own gather of what each rank filled
                with safe_open(str(files[name]), "pt") as handle:
                    if not torch.equal(param.data, handle.get_tensor(name)):
                        mismatched.append(name)
        results[family] = {"model": report.model_bytes, "kept": report.kept_bytes, "read": report.read_bytes,
                           "peak": report.host.increase, "gathered_peak": gathered.increase,
                           "since_start": report.host.since_start, "mismatched": mismatched}  # fmt: skip

    # Only rank 2 sees a shard missing (a node with an incomplete copy); a bag too big for the heads.
    cases = {
        "missing shard": (paths["broken"] if rank == 2 else paths["small"], ZERO3),
        "heads": (paths["small"], {**ZERO3, "knapformer": {"enabled": True, "topology": "g8n1"}}),
    }
    for case, (path, config) in cases.items():
        try:
            load_checkpoint(model_class("flux2"), path, ds_config=config)
            results[case] = None
        except CheckpointError as error:
            results[case] = str(error)
    return results


def test_zero3_loading_keeps_a_partition_per_rank_and_agrees_on_errors(checkpoints, monkeypatch):
    # Large allocations from mmap, so that freed memory leaves the process and peak RSS is what was live.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    results = run_distributed(_loading_worker, 4, args=(checkpoints,), timeout=300, fresh=True)
    for rank, result in enumerate(results):
        for family in LARGE:
            measured = result[family]
            print(f"rank {rank} {family}: model {measured['model'] / 2**20:.0f} MB, kept {measured['kept'] / 2**20:.0f} "
                  f"MB, peak host memory while loading +{measured['peak'] / 2**20:.0f} MB, with everything gathered "
                  f"+{measured['gathered_peak'] / 2**20:.0f} MB")  # fmt: skip
            assert not measured["mismatched"], (rank, family, measured["mismatched"][:5])
            assert measured["kept"] == pytest.approx(measured["model"] / 4, rel=0.01)
            assert measured["read"] <= measured["kept"]
            assert not measured["since_start"]
            assert measured["gathered_peak"] >= measured["model"]  # the measurement sees a full copy when there is one
        assert result["flux2"]["peak"] < 0.5 * result["flux2"]["model"], "loading never makes one"
    missing = {result["missing shard"] for result in results}
    assert len(missing) == 1, "every rank raises the same error"
    (message,) = missing
    assert "rank(s) [2]" in message and f"{checkpoints['missing']}, which is missing" in message
    heads = {result["heads"] for result in results}
    assert len(heads) == 1 and "num_attention_heads=6, but knapformer.topology 'g8n1' has bags of 8 GPUs" in heads.pop()
