"""examples/train_flux.py on 4 CPU ranks under the deepspeed launcher: ZeRO-3 with balancing on gives
the losses of balancing off, the exported weights load into diffusers, and the latent files that
examples/prepare_flux_latents.py writes train."""

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.test_launch import ROOT, deepspeed_launch, run

diffusers = pytest.importorskip("diffusers")

SCRIPT = ROOT / "examples" / "train_flux.py"
DEMO_CONFIG = json.loads((ROOT / "ds_configs" / "flux_cpu_demo.json").read_text())


def train(tmp_path, name: str, knapformer_enabled: bool, *args: str) -> list[float]:
    config = {**DEMO_CONFIG, "knapformer": {**DEMO_CONFIG["knapformer"], "enabled": knapformer_enabled}}
    config_path = tmp_path / f"{name}.json"
    config_path.write_text(json.dumps(config))
    result = run(deepspeed_launch(SCRIPT, "--deepspeed_config", str(config_path), "--tiny", *args))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = re.findall(r"^step \d+ loss (\S+) .*$", result.stdout, re.MULTILINE)
    if knapformer_enabled:
        assert all(" imbalance " in line for line in re.findall(r"^step .*$", result.stdout, re.MULTILINE))
    return [float(x) for x in lines]


def test_zero3_balanced_training_matches_unbalanced_and_exports_to_diffusers(tmp_path):
    common = ("--token-scale", "0.015625", "--steps", "3", "--lr", "1e-3", "--gradient-checkpointing")
    off = train(tmp_path, "off", False, *common)
    on = train(tmp_path, "on", True, *common, "--export-dir", str(tmp_path / "export"))
    assert len(on) == 3
    assert on == pytest.approx(off, rel=1e-5)

    from deepspeed_knap.models.flux import PackedFluxTransformer

    exported = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path / "export")
    ours = PackedFluxTransformer.from_pretrained(tmp_path / "export", attention_backend="sdpa")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    torch.manual_seed(0)  # the script's initial weights: training must have changed them
    initial = PackedFluxTransformer(**{key: value for key, value in config.items() if not key.startswith("_")})
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), initial.parameters(), strict=True))
    assert moved > 1e-4
    theirs = exported.state_dict()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in ours.state_dict().items())


def test_training_reads_the_latent_files_prepare_writes(tmp_path):
    prepare = [sys.executable, str(ROOT / "examples" / "prepare_flux_latents.py"), "--out", str(tmp_path / "data"),
               "--synthetic", "kf_mixed_res", "--count", "6", "--token-scale", "0.015625", "--in-channels", "16",
               "--joint-attention-dim", "32", "--pooled-projection-dim", "16"]  # fmt: skip
    written = subprocess.run(prepare, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert written.returncode == 0, written.stderr[-3000:]
    assert len(list((tmp_path / "data").glob("*.safetensors"))) == 6
    losses = train(tmp_path, "files", True, "--data-dir", str(tmp_path / "data"), "--samples-per-rank", "2",
                   "--steps", "2")  # fmt: skip
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


def test_readme_main_job_trains_and_prints_loss_and_imbalance():
    from tests.test_readme import COMMANDS

    launch = COMMANDS[0].split(" && ")[-1].split()
    assert launch[:3] == [".venv/bin/deepspeed", "--num_gpus", "4"]
    result = run(deepspeed_launch(ROOT / launch[3], *launch[4:]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"^step \d+ loss \S+ time \S+ tokens/s \S+ imbalance (\S+) -> (\S+)$", result.stdout, re.M)
    assert len(steps) == 5
    assert all(float(after) < float(before) for before, after in steps)
