"""deepspeed-knap bench train end to end on 2 gloo ranks (small), and calibrate --degrees on the CPU."""

import json

import pytest

from deepspeed_knap.bench import train as bench_train
from deepspeed_knap.cli import main
from deepspeed_knap.runtime.balancer import balancer_overhead_s


def test_bench_train_times_real_ranks_and_reports_every_phase(tmp_path, capsys):
    out = tmp_path / "train.json"
    argv = ["bench", "train", "--ranks", "2", "--mix", "long_video", "--token-scale", "0.01", "--steps", "3",
            "--modes", "off,auto", "--slow-rank", "1:2", "--online", "--json", str(out), "--plot", str(tmp_path / "t.png")]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "medians over steps" in printed and "seconds by phase" in printed
    report = json.loads(out.read_text())
    # Every mode recorded every step (on both ranks, below); the report lists them mode by mode.
    assert [(r["mode"], r["step"]) for r in report["steps"]] == [(m, s) for m in ("off", "auto") for s in range(3)]
    # The modes ran interleaved, in the design's orders: off 0, auto 0, then its mirror, auto 1, off 1. So
    # the wall time between off's closes of steps 0 and 1 (its balancer's "step") holds both of auto's
    # steps, while auto's holds none of off's (run one mode after the other, neither would).
    row = {(r["mode"], r["step"]): r for r in report["steps"]}
    auto_steps_s = row["auto", 0]["step_s"] + row["auto", 1]["step_s"]
    assert all(p["step"] > auto_steps_s for p in row["off", 1]["phases"])
    assert all(p["step"] < auto_steps_s for p in row["auto", 1]["phases"])
    for row in report["steps"]:
        assert len(row["phases"]) == 2 and all(p["compute"] > 0 for p in row["phases"])
        assert len(row["share_error"]) == 2
        assert row["step_s"] > 0 and row["compute_imbalance"] >= 1.0
        assert all(set(bench_train.PHASES) <= set(p) for p in row["phases"]) and 0 < row["overhead"] < 1
        # The budget leaves out waits: each collective's least over ranks, the largest refit and solve.
        assert row["overhead"] == pytest.approx(balancer_overhead_s(row["phases"]) / row["step_s"])
        assert row["overhead"] * row["step_s"] <= min(
            sum(p[part] for part in ("gather", "refit", "solve", "agree", "route", "reverse_route"))
            for p in row["phases"]
        ) + max(p["solve"] + p["refit"] for p in row["phases"])
    off = [r for r in report["steps"] if r["mode"] == "off"]
    assert all(sum(p["ulysses"] for p in r["phases"]) == 0 for r in off)  # nothing moves, no bags
    # Step 1's prefetch (of step 2's lengths) recorded step 0's times (priced; online, not learned
    # from): host time of the balancer's, counted (the last step prefetches nothing, so records nothing).
    assert all(p["refit"] > 0 for r in report["steps"] if r["step"] == 1 for p in r["phases"])
    # Prefetch (the default): step 1's plan was solved during step 0 and agreed on in step 1.
    assert all(p["agree"] > 0 for r in report["steps"] if r["step"] == 1 for p in r["phases"])
    # Step 0 gathers its own lengths and step 1's (the prefetch) and solves its plan in the step.
    assert all(p["solve"] > 0 and p["gather"] > 0 for r in report["steps"] if r["step"] == 0 for p in r["phases"])
    assert "overhead" in printed and "prefetch" in printed
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_slow_down_sleeps_factor_minus_one_times_each_blocks_forward_and_backward(monkeypatch):
    import torch

    slept = []
    monkeypatch.setattr(bench_train.time, "sleep", slept.append)
    clock = iter([1.0, 1.5, 10.0, 12.0])  # forward 0.5 s, backward 2 s
    monkeypatch.setattr(bench_train.time, "perf_counter", lambda: next(clock))
    block = torch.nn.Linear(2, 2)
    bench_train._SlowDown([block], 3.0)
    block(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert slept == [pytest.approx(1.0), pytest.approx(4.0)]


def test_summary_speedup_is_per_step():
    steps = [{"mode": "off", "step": s, "step_s": t, "compute_imbalance": 1.5, "model_error": [None, None],
              "overhead": 0.01} for s, t in enumerate([9.0, 4.0, 8.0])]  # fmt: skip
    steps += [{"mode": "auto", "step": s, "step_s": t, "compute_imbalance": 1.1, "model_error": [0.1, -0.3],
               "overhead": o} for s, t, o in zip(range(3), [9.0, 2.0, 2.0], [0.5, 0.02, 0.04], strict=True)]  # fmt: skip
    summary = bench_train.summarize({"steps": steps})
    assert summary["auto"]["speedup"] == pytest.approx(3.0)  # median of 4/2 and 8/2, step 0 skipped
    assert summary["auto"]["model_error"] == pytest.approx(0.2)
    assert summary["auto"]["share_error"] != summary["auto"]["share_error"]  # nan: no share errors recorded
    assert summary["auto"]["overhead"] == pytest.approx(0.03)  # median of steps 1 and 2


def test_share_errors_leave_out_what_every_rank_shares():
    """The model's split of the step's compute against the measured split: a step 20% slower on every
    rank has no share error; a rank that took 1.5x its share has it, and its partner the rest."""
    assert bench_train.share_errors([1.0, 3.0], [1.2, 3.6]) == pytest.approx([0.0, 0.0])
    assert bench_train.share_errors([1.0, 1.0], [1.5, 0.5]) == pytest.approx([1 / 1.5 - 1, 1 / 0.5 - 1])
    assert bench_train.share_errors([1.0], [2.0]) is None  # one rank: every split is right
    assert bench_train.share_errors([None, 1.0], [1.0, 1.0]) is None


def test_bad_slow_rank_is_refused():
    with pytest.raises(SystemExit):
        main(["bench", "train", "--slow-rank", "1"])
    assert main(["bench", "train", "--ranks", "2", "--slow-rank", "5:2"]) == 2


def test_calibrate_fits_the_efficiency_of_bag_members(tmp_path, capsys):
    out = tmp_path / "cal.json"
    argv = ["calibrate", "--out", str(out), "--seq-lens", "256,512,1024,2048", "--heads", "4", "--head-dim", "8",
            "--double-blocks", "1", "--single-blocks", "1", "--repeats", "3", "--degrees", "2,4"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    efficiency = dict((g, e) for g, e in data["degree_efficiency"])
    assert set(efficiency) == {2, 4} and all(0 < e <= 2 for e in efficiency.values())
    assert "bag of 4: a member does" in capsys.readouterr().out
    from deepspeed_knap.runtime.config import get_knapformer_config

    model = get_knapformer_config({"knapformer": {"cost_model": {"calibration_file": str(out)}}}).cost_model.build()
    assert dict(model.degree_efficiency) == efficiency
    assert main([*argv[:-1], "8"]) == 2  # more GPUs than heads


def test_a_fixed_solver_may_run_on_topologies_of_its_own_in_one_run(capsys):
    """``knapformer@g1n2`` beside ``knapformer`` (on ``--topology``): each mode its own block."""
    configs = {mode: bench_train.ds_config(mode, "g2n1", 2, {"model": "flux-tiny"}, online=True)["knapformer"]
               for mode in ("knapformer@g1n2", "knapformer", "refine@g1n2", "auto")}  # fmt: skip
    assert [(c["topology"], c["solver"], "online" in c["cost_model"]) for c in configs.values()] == [
        ("g1n2", "knapformer", False), ("g2n1", "knapformer", False), ("g1n2", "refine", True), ("auto", "refine", True)
    ]  # fmt: skip
    for modes, message in [("off,auto@g1n2", "only knapformer and refine"), ("off,knapformer@g3n1", "g3n1"),
                           ("auto,knapformer", "including off"), ("off,auto,auto", "each once")]:  # fmt: skip
        assert main(["bench", "train", "--ranks", "2", "--modes", modes]) == 2
        assert message in capsys.readouterr().err


def test_bench_train_runs_both_experts_of_wan_22_a14b_and_refuses_experts_elsewhere(tmp_path, capsys):
    """``--expert both`` trains two tiny experts as examples/train_dit.py builds them (each sample's
    noise level picks its own), balanced; a family of one transformer refuses ``--expert`` before any
    rank starts."""
    assert main(["bench", "train", "--family", "flux", "--expert", "both"]) == 2
    assert "--expert both: FLUX.1 has one transformer" in capsys.readouterr().err
    out = tmp_path / "experts.json"
    argv = ["bench", "train", "--ranks", "2", "--family", "wan", "--expert", "both", "--token-scale", "0.02",
            "--steps", "2", "--modes", "off,auto", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "tiny wan (--expert both)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert {(r["mode"], r["step"]) for r in report["steps"]} == {(m, s) for m in ("off", "auto") for s in range(2)}
    assert all(p["compute"] > 0 for r in report["steps"] for p in r["phases"])
