"""deepspeed-knap doctor: reports what runs, catches a kernel that computes wrong, writes its files."""

import json

import deepspeed
import pytest
import torch

from deepspeed_knap.cli import main
from deepspeed_knap.commands.doctor import kernel_check, run_doctor
from deepspeed_knap.cost.calibrate import startup_model
from deepspeed_knap.models.registry import spec
from deepspeed_knap.runtime import attention

SMALL = dict(heads=2, head_dim=16, double_blocks=2, single_blocks=3, seq_lens=(32, 64, 96, 128), repeats=3)


def test_on_cpu_it_reports_versions_kernels_speed_and_a_calibration(tmp_path, capsys):
    # Lengths long enough that attention's work (0.03 -> 0.36 s here) dwarfs the ~20 ms fixed cost and
    # the noise of a busy 2-core CI machine; at 32-128 tokens CI once timed them all at 0.02 s, no slope.
    assert main(["doctor", "--out", str(tmp_path), "--heads", "2", "--head-dim", "16", "--double-blocks", "2",
                 "--single-blocks", "3", "--seq-lens", "256,512,1024,2048", "--compare-lens", "48,96",
                 "--repeats", "3", "--family", "wan"]) == 0  # fmt: skip
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert report["versions"]["packages"]["deepspeed"] == deepspeed.__version__
    assert report["kernels"]["auto"] == "sdpa" and report["kernels"]["unusable"]["sdpa"] is None
    assert "CUDA" in report["kernels"]["unusable"]["torch_varlen"]
    assert report["kernel_check"]["sdpa"]["ok"] and report["kernel_check"]["sdpa"]["errors"]["grad_q"] < 1e-5
    assert set(report["speed_s"]) == {"48", "96"} and report["fastest"] == {"48": "sdpa", "96": "sdpa"}
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    assert calibration["backend"] == "sdpa" and calibration["seq_lens"] == [256, 512, 1024, 2048]
    assert calibration["linear_coef"] == report["calibration"]["linear_coef"]
    # The start-up calibration of a Wan model as training would fit it from these times: off here
    # with "auto" (no GPU), the tiny config at the calibration's lengths.
    startup = report["startup_calibration"]
    assert (startup["family"], startup["config"], startup["auto_runs_it"]) == ("wan", "tiny", False)
    assert startup["seq_lens"] == [256, 512, 1024, 2048] and len(startup["seconds"]) == 4
    expected = startup_model(spec("wan").config_cost_model(spec("wan").tiny_config), startup["seq_lens"],
                             [startup["seconds"]]).model  # fmt: skip
    assert (expected.linear_coef, expected.quadratic_coef) == (startup["linear_coef"], startup["quadratic_coef"])
    text = capsys.readouterr().out
    assert text.startswith((tmp_path / "doctor.txt").read_text()) and "all kernel checks passed" in text
    assert "start-up calibration of a wan model (tiny config)" in text


def test_a_kernel_that_computes_wrong_fails_the_check(tmp_path, monkeypatch):
    """An sdpa that forgets the softmax scale (an easy slip) is caught against float64."""
    right = attention._KERNELS["sdpa"]
    monkeypatch.setitem(attention._KERNELS, "sdpa", lambda q, k, v, seqs, scale, kv: right(q, k, v, seqs, 1.0, kv))
    check = kernel_check("sdpa", 2, 16, torch.device("cpu"), torch.float32)
    assert not check["ok"] and check["errors"]["output"] > 1e-2
    report = run_doctor(tmp_path, compare_lens=(48,), **SMALL)
    assert not report["ok"] and any("'sdpa' is off by" in note for note in report["findings"])
    assert "A KERNEL CHECK FAILED" in (tmp_path / "doctor.txt").read_text()


def test_a_calibration_lost_in_noise_is_a_finding_not_a_crash(tmp_path, monkeypatch):
    """Short lengths on a busy CPU can time slower than long ones; the kernel checks still stand."""
    import deepspeed_knap.commands.doctor as doctor

    def noisy(step, seq_lens, repeats):
        raise ValueError("the times [0.03, 0.01] do not grow with the length; is the step doing any work?")

    monkeypatch.setattr(doctor, "calibrate", noisy)
    monkeypatch.setattr(doctor, "time_lengths", lambda *args, **kwargs: torch.tensor([0.03, 0.01, 0.02, 0.01]))
    (tmp_path / "calibration.json").write_text("{}")  # an earlier run's
    report = run_doctor(tmp_path, compare_lens=(48,), **SMALL)
    assert report["ok"] and "do not grow" in report["calibration"]["error"]
    assert any(note.startswith("calibration failed") for note in report["findings"])
    assert not (tmp_path / "calibration.json").exists() and "FAILED: the times" in (tmp_path / "doctor.txt").read_text()
    assert "do not grow" in report["startup_calibration"]["error"]
    assert any(note.startswith("the start-up calibration of a flux model failed") and "leaves it off" in note
               for note in report["findings"])  # fmt: skip


@pytest.mark.gpu
def test_on_cuda_every_installed_kernel_passes_and_the_fastest_is_named(tmp_path):
    report = run_doctor(tmp_path, "cuda", torch.bfloat16, compare_lens=(256, 2048), **SMALL)
    assert report["kernels"]["unusable"]["torch_varlen"] is None and report["kernels"]["unusable"]["sdpa"] is None
    assert report["ok"], report["kernel_check"]
    assert set(report["speed_s"][2048]) == {k for k, why in report["kernels"]["unusable"].items() if why is None}
    assert report["versions"]["devices"] and report["versions"]["nccl"]
    startup = report["startup_calibration"]  # FLUX.1 [dev]'s full config, as training would time it
    assert (startup["config"], startup["auto_runs_it"], startup.get("error")) == ("full", True, None)
    assert startup["seq_lens"] == [1024, 2048, 4096, 8192] and startup["repeats"] == 2
