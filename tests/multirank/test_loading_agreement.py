"""A checkpoint folder under one path that differs between nodes (another copy on one of them) is
one error on every rank before anything loads: the ranks agree on the family its config names, and on
the config itself, which builds the partitioned parameters. Before, each rank went on with what it
read: another family's loading code, or other shapes under ZeRO-3, and the job hung."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.distributed import run_distributed

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _load_worker(rank: int, world: int, root: str) -> dict[str, str]:
    from deepspeed_knap.models.auto import from_pretrained
    from deepspeed_knap.models.loading import CheckpointError

    os.chdir(Path(root) / f"rank{rank}")  # a node of its own: the same relative paths, other copies
    outcomes = {}
    for name in ("family", "config", "same", f"own{rank}"):  # own{rank}: the same copy under a path of its own
        try:
            model = from_pretrained(name, ds_config=ZERO3)
            outcomes[name] = f"loaded {type(model).__name__}"
        except CheckpointError as error:
            outcomes[name] = str(error)
    return outcomes


def test_ranks_that_read_another_family_or_config_under_one_path_raise_together(tmp_path):
    import torch

    from deepspeed_knap.models.flux.flux1 import PackedFluxTransformer
    from deepspeed_knap.models.flux.flux2 import PackedFlux2Transformer
    from deepspeed_knap.models.flux.spec import TINY_FLUX, TINY_FLUX2

    torch.manual_seed(0)
    flux, flux2 = PackedFluxTransformer(**TINY_FLUX), PackedFlux2Transformer(**TINY_FLUX2)
    deeper = PackedFluxTransformer(**{**TINY_FLUX, "num_layers": TINY_FLUX["num_layers"] + 1})
    for rank, (family, config) in enumerate(((flux, flux), (flux2, deeper))):
        folder = tmp_path / f"rank{rank}"
        family.save_pretrained(folder / "family")
        config.save_pretrained(folder / "config")
        flux.save_pretrained(folder / "same")
        flux.save_pretrained(folder / f"own{rank}")
    first, second = run_distributed(_load_worker, 2, args=(str(tmp_path),), timeout=120)
    assert first.pop("own0") == second.pop("own1") == "loaded PackedFluxTransformer"
    assert first == second
    assert first["same"] == "loaded PackedFluxTransformer"
    assert first["family"].startswith(
        "reading the checkpoint's model family: ranks see different settings, so they would act differently and the "
        "job would hang: the checkpoint's model family (ranks [1] differ from rank 0): rank 0 sees 'flux', rank 1 "
        "sees 'flux2'"
    ), first["family"]
    assert first["config"].startswith(
        "loading a PackedFluxTransformer checkpoint: ranks see different settings, so they would act differently "
        "and the job would hang: the checkpoint's transformer config (ranks [1] differ from rank 0)"
    ), first["config"]
    assert '"num_layers": 3' in first["config"], first["config"]
