"""examples/train_dit.py with FLUX.2 on 2 CPU ranks under the deepspeed launcher, ZeRO-3: the tiny
FLUX.2 balanced trains to the losses of the same weights loaded from a checkpoint (partitioned as
read) and trained unbalanced; the 16-bit export loads in diffusers' ``Flux2Transformer2DModel``, and
DeepSpeed's ``zero_to_fp32`` recovers the same weights from the saved checkpoint. Two ranks, as the
other training e2e tests run; the packed FLUX.2 balanced over 4 gloo ranks against diffusers is
tests/unit/test_flux.py's."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.support.launch import ROOT, local_launch, run

diffusers = pytest.importorskip("diffusers")

SCRIPT = ROOT / "examples" / "train_dit.py"
DEMO_CONFIG = json.loads((ROOT / "ds_configs" / "flux_cpu_demo.json").read_text())
COMMON = ("--mix", "flux2_edit", "--token-scale", "0.015625", "--steps", "3", "--lr", "1e-3")


def train(tmp_path, name: str, balanced: bool, *args: str) -> tuple[list[float], str]:
    config = {**DEMO_CONFIG, "knapformer": {**DEMO_CONFIG["knapformer"], "enabled": balanced}}
    config_path = tmp_path / f"{name}.json"
    config_path.write_text(json.dumps(config))
    result = run(local_launch(SCRIPT, "--deepspeed_config", str(config_path), *COMMON, *args, ranks=2))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+) ", result.stdout, re.MULTILINE)]
    return losses, result.stdout + result.stderr


def test_zero3_flux2_balanced_equals_unbalanced_loaded_and_exports_to_diffusers(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from deepspeed_knap.models.flux.flux2 import PackedFlux2Transformer
    from deepspeed_knap.models.flux.spec import TINY_FLUX2

    torch.manual_seed(0)  # --tiny's initial weights (--seed 0)
    initial = PackedFlux2Transformer(**TINY_FLUX2)
    checkpoint = initial.save_pretrained(tmp_path / "initial", max_shard_size=50_000)

    on, _ = train(tmp_path, "on", True, "--tiny", "--family", "flux2", "--export-dir", str(tmp_path / "export"),
                  "--save-dir", str(tmp_path / "ckpt"))  # fmt: skip
    off, log = train(tmp_path, "off", False, "--model-path", str(checkpoint))
    assert len(on) == 3
    assert on == pytest.approx(off, rel=1e-5)
    assert "ZeRO-3 partitioned" in log  # rank 0's loading report

    exported = diffusers.Flux2Transformer2DModel.from_pretrained(tmp_path / "export").state_dict()
    trained = PackedFlux2Transformer.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(tensor, exported[name]) for name, tensor in trained.items())
    moved = max((trained[name] - tensor).abs().max().item() for name, tensor in initial.state_dict().items())
    assert moved > 1e-4, "training must have changed the weights"
    masters = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))  # the README's fp32 export
    with torch.device("meta"):
        shell = PackedFlux2Transformer(**TINY_FLUX2)
    shell.save_pretrained(tmp_path / "fp32", state_dict=masters)
    from_masters = diffusers.Flux2Transformer2DModel.from_pretrained(tmp_path / "fp32").state_dict()
    assert from_masters.keys() == trained.keys()
    assert all(torch.equal(from_masters[name], tensor) for name, tensor in trained.items())
