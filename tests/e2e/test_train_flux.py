"""examples/train_dit.py launched: the README's main job under the deepspeed runner (4 CPU ranks), the
example's error path (one line per rank, exit 1, no traceback), and a LoRA run with validation on one
CUDA GPU over NCCL.

What the training does (balancing, resume, checkpoints, LoRA, exports, validation, prepared data, for
every family) is tested in process, without a launch per run: tests/multirank/test_training_flux.py,
test_training_wan.py, test_training_flux3.py (tests/support/training.py). The example is a command
line over the same ``Trainer``.
"""

import json
import re

import pytest

from tests.support.launch import ROOT, deepspeed_launch, local_launch, run

pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("transformers")

SCRIPT = ROOT / "examples" / "train_dit.py"
DEMO_CONFIG = json.loads((ROOT / "ds_configs" / "flux_cpu_demo.json").read_text())
COMMON = ("--tiny", "--token-scale", "0.015625", "--steps", "3", "--lr", "1e-3")
LORA = ("--lora-rank", "4", "--lora-alpha", "8")
STEP_LINE = re.compile(
    r"^step (\d+) loss (\S+) time \S+ tokens/s \S+(?: modeled imbalance (\S+) -> (\S+)( \(planned ahead\))?)?$", re.M
)


def check(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_a_damaged_checkpoint_is_one_line_on_every_rank_and_exit_1(tmp_path):
    """--resume of a tag whose save did not finish (a shard, no manifest): each rank's log (the
    launcher's, one per rank) holds the whole error as one line naming the rank, the tag and the fix,
    and no traceback; the job exits non-zero before any step. (Every kind of damage, and that all
    ranks raise the same error, is tests/multirank/test_training_flux.py's.)"""
    from deepspeed_knap.runtime.manifest import MANIFEST

    tag = tmp_path / "ckpt" / "step1"
    tag.mkdir(parents=True)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"\0" * 64)
    (tmp_path / "config.json").write_text(json.dumps(DEMO_CONFIG))
    result = run(local_launch(SCRIPT, "--deepspeed_config", str(tmp_path / "config.json"), *COMMON, "--resume",
                              str(tag), ranks=2, rank_logs=tmp_path / "logs"))  # fmt: skip
    assert result.returncode != 0
    for rank in (0, 1):
        (log,) = (tmp_path / "logs").glob(f"*_rank{rank}.log")
        output = log.read_text()
        assert not STEP_LINE.search(output), output[-3000:]
        start = f"train_dit: error (rank {rank}): --resume {tag}: checkpoint {tag} is partial: no {MANIFEST}"
        lines = [line for line in output.splitlines() if line.startswith(start)]
        assert len(lines) == 1, output[-3000:]
        assert lines[0].endswith(f"python -m deepspeed_knap.runtime.manifest {tag}"), lines[0]
        assert "Traceback" not in output and "Connection closed" not in output, output[-3000:]


def test_readme_main_job_trains_and_prints_loss_and_modeled_imbalance():
    from tests.e2e.test_readme import COMMANDS

    launch = COMMANDS[0].split(" && ")[-1].split()
    assert launch[:3] == [".venv/bin/deepspeed", "--num_gpus", "4"]
    result = run(deepspeed_launch(ROOT / launch[3], *launch[4:]))
    check(result)
    steps = STEP_LINE.findall(result.stdout)
    assert len(steps) == 5
    assert all(float(after) < float(before) for _, _, before, after, _ in steps)
    assert "is deprecated" not in result.stderr  # ZeRO-3's torch deprecation warnings are filtered
    assert result.leftover_shm == []  # every rank unlinked its /dev/shm all-reduce buffer


@pytest.mark.gpu
def test_tiny_lora_run_with_validation_on_one_cuda_gpu_over_nccl(tmp_path):
    """World size 1 on CUDA: NCCL refuses a CPU tensor in any collective of the loop, the balancer,
    ZeRO-3, the LoRA export and the validation gather."""
    config = {
        **DEMO_CONFIG,
        "knapformer": {**DEMO_CONFIG["knapformer"], "topology": "g1n1", "attention_backend": "auto"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    # DeepSpeed's per-node launcher, not the runner: the GPU machines install deepspeed with
    # `pip --target`, which puts no `deepspeed` command beside the interpreter.
    command = local_launch(SCRIPT, "--deepspeed_config", str(tmp_path / "config.json"), *COMMON, *LORA,
                           "--validation-every", "3", "--validation-prompts", str(tmp_path / "prompts.txt"),
                           "--validation-dir", str(tmp_path / "images"), "--export-dir", str(tmp_path / "lora"),
                           ranks=1)  # fmt: skip
    result = run(command)
    check(result)
    assert len(STEP_LINE.findall(result.stdout)) == 3 and (tmp_path / "images" / "step000003_prompt00.png").is_file()
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
