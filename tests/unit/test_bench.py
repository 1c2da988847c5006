"""The planner benchmark runs end to end (small) and its tables hold what they claim."""

import csv
import json

import pytest
import torch

from deepspeed_knap.bench import planner as bench
from deepspeed_knap.cli import main as cli_main
from deepspeed_knap.models.registry import default_cost_model, sample_mix
from deepspeed_knap.planner import plan_loads, plan_routing
from deepspeed_knap.planner.topology import build_topology


def test_suite_topologies_cover_every_bag_size_the_mix_and_auto():
    assert bench.suite_topologies(256) == ["g1n256", "g2n128", "g4n64", "g8n32", "g1n64+g2n32+g4n16+g8n8", "auto"]
    for n in (32, 256, 1024):
        assert all(build_topology(spec).group_size == n for spec in bench.suite_topologies(n)[:-1])
    with pytest.raises(ValueError, match=r"multiple of 32 GPUs.*got 48"):
        bench.suite_topologies(48)


def test_planner_suite_cli_writes_table_csv_and_plots(tmp_path, capsys):
    out_csv, plots = tmp_path / "rows.csv", tmp_path / "plots"
    assert cli_main(["bench", "planner", "--gpus", "32", "--steps", "2", "--mixes", "kf_mixed_res",
                     "--sensitivity", "0.2", "--csv", str(out_csv), "--plot-dir", str(plots)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    # suite rows (6 topologies), the auto comparison, sensitivity rows for kf and refine (none on auto)
    assert printed.count("\n| kf_mixed_res |") == 6 + 1 + 5 * 2 + 1
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == 5 * 3 + 2  # knapformer does not run on auto
    for name in ("speedup.png", "loads.png", "loads_auto.png"):
        assert (plots / name).stat().st_size > 10_000
    for row in rows:
        assert float(row["bound_ratio_median"]) >= 1 - 1e-9 and float(row["solve_ms_p95"]) >= float(
            row["solve_ms_median"]
        )
        assert float(row["imbalance_p95"]) >= float(row["imbalance_median"]) >= 1 - 1e-9
        assert (row["loss_plus_median"] == "") == (row["solver"] == "none")
        # the online refit's update is timed on auto's plans only
        assert (row["refit_ms_median"] != "") == (row["topology"] == "auto" and row["solver"] == "refine")
        assert row["refit_ms_median"] == "" or float(row["refit_ms_median"]) > 0
    by_key = {(r["topology"], r["solver"]): r for r in rows}
    for spec in bench.suite_topologies(32)[:-1]:
        assert float(by_key[(spec, "none")]["speedup_median"]) == 1.0
        # refine is never slower than knapformer on any step, so not in the median either
        assert float(by_key[(spec, "refine")]["speedup_median"]) >= float(
            by_key[(spec, "knapformer")]["speedup_median"]
        )


def test_sensitivity_loss_prices_the_misled_plan_under_the_true_model():
    model = default_cost_model()
    spec = "g4n8"
    rows = bench.run_case(32, "kf_image_video", spec, 1, ["none", "refine"], model, sensitivity=0.2)
    refine = next(r for r in rows if r["solver"] == "refine")
    lengths, topology = sample_mix("kf_image_video", 32, 0), build_topology(spec, gpus_per_node=8)
    truth = plan_routing(lengths, topology, model, "refine").max_load
    for label, factor in (("minus", 0.8), ("plus", 1.2)):
        wrong = bench.dataclasses.replace(model, quadratic_coef=model.quadratic_coef * factor)
        misled = plan_loads(plan_routing(lengths, topology, wrong, "refine"), model).max()
        assert refine[f"loss_{label}_median"] == pytest.approx(misled / truth - 1, abs=1e-12)
    assert refine["loss_minus_median"] > 0 and refine["loss_plus_median"] > 0  # a 20% error does cost here


def test_planner_suite_rejects_bad_options():
    with pytest.raises(ValueError, match="'none' solver as the speedup baseline"):
        bench.run_suite([32], ["kf_lowres"], 1, ["refine"])
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\).*got 20"):
        bench.run_suite([32], ["kf_lowres"], 1, sensitivity=20)


def test_routing_traffic_smoke():
    from deepspeed_knap.bench import routing

    rows = routing.bench_traffic(["kf_image_video"], "g8n4", "knapformer", "flux-dev", steps=1)
    (row,) = rows
    # Bags of 8 always used by knapformer: q, k, v and output each send 7/8 of the activations per layer.
    assert row["ulysses_ratio"] == 57 * 4 * 7 / 8
    assert 0 < row["route_ratio"] <= 2
    assert "kf_image_video" in routing.format_traffic(rows)


def test_flux_bench_smoke(capsys):
    pytest.importorskip("diffusers")
    assert cli_main(["bench", "flux", "--mix", "kf_mixed_res", "--ranks", "2", "--token-scale", "0.01", "--layers", "1",
               "--single-layers", "1", "--head-dim", "16", "--repeats", "1"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()  # other output (DeepSpeed's accelerator notice) may come first
    rows = {line.split()[0]: [float(x) for x in line.split()[1:3]] for line in lines
            if line.split()[:1] in (["diffusers"], ["packed"])}  # fmt: skip
    assert set(rows) == {"diffusers", "packed"}
    # The same tokens through the same layers: activation memory within 10% of each other.
    assert rows["packed"][1] == pytest.approx(rows["diffusers"][1], rel=0.1)


def test_auto_comparison_is_computed_step_by_step_from_the_plans():
    model = default_cost_model()
    rows = []
    for spec in bench.suite_topologies(32):
        rows += bench.run_case(32, "kf_image_video", spec, 2, ["none", "knapformer", "refine"], model)
    (row,) = bench.auto_comparison(rows, 32)
    ratios = []
    for seed in range(2):
        lengths = sample_mix("kf_image_video", 32, seed)
        auto = plan_routing(lengths, build_topology("auto", 32, gpus_per_node=8), model)
        knapformer = plan_routing(lengths, build_topology("g8n4"), model, "knapformer")
        best = min(plan_routing(lengths, build_topology(s, gpus_per_node=8), model).max_load
                   for s in bench.suite_topologies(32)[:-1])  # fmt: skip
        ratios.append((auto.max_load / auto.lower_bound, knapformer.max_load / auto.max_load, auto.max_load / best))
    medians = [sum(pair) / 2 for pair in zip(*ratios, strict=True)]
    assert row["vs_bound"] == pytest.approx(medians[0]) and row["vs_bound"] >= 1 - 1e-9
    assert row["speedup_vs_knapformer_g8"] == pytest.approx(medians[1])
    assert row["vs_best_fixed"] == pytest.approx(medians[2])


def test_ahead_bench_reports_identical_plans_and_plots(tmp_path, capsys):
    from deepspeed_knap.cli import main

    plot = tmp_path / "ahead.png"
    assert main(["bench", "ahead", "--gpus", "16", "--steps", "2", "--mixes", "kf_image_video",
                 "--plot", str(plot)]) == 0  # fmt: skip
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 16 | kf_image_video"))
    assert row.split("|")[8].strip() == "yes"  # the worker's plans are the in-process ones, bit for bit
    assert plot.stat().st_size > 0


def test_ahead_bench_workers_share_each_solve_unless_told_not_to(capsys, plan_folder):
    """Three workers sent each job: one solves it and the others read its plan; with --no-share each
    solves, using about three times the CPU. The plans are the in-process ones either way."""
    from deepspeed_knap.cli import main

    cells = {}
    for share in ("--share", "--no-share"):
        assert main(["bench", "ahead", "--gpus", "128", "--steps", "2", "--mixes", "kf_mixed_res", "--workers", "3",
                     share]) == 0  # fmt: skip
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 128 | kf_mixed_res"))
        cells[share] = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells["--share"][6] == "1" and cells["--no-share"][6] == "3"
    assert cells["--share"][7] == cells["--no-share"][7] == "yes"
    cpu = {share: float(row[5].split()[0]) for share, row in cells.items()}
    assert cpu["--no-share"] > 1.5 * cpu["--share"], cpu  # 3 solves against 1 (and the reads)


@pytest.mark.parametrize("family", ["flux", "flux2", "flux3", "wan"])
def test_bench_generate_builds_each_family_and_its_default_requests_are_imbalanced(family):
    """The default request file's lines alternate large and small (Wan: CFG clips, then one-frame
    images without guidance; FLUX.3 guides every request by default); the family's tiny model at the
    bench's width takes them, and rank 0 of 2 (even lines) holds most of the tokens."""
    import torch

    from deepspeed_knap.bench.generate import imbalanced_requests
    from deepspeed_knap.generation.requests import parse_request
    from deepspeed_knap.models.generators import tiny_generator
    from deepspeed_knap.models.registry import spec

    config = spec(family).load("generator").tiny_config(heads=8, head_dim=32)
    generator = tiny_generator(family, torch.float32, torch.device("cpu"), config=config)
    assert generator.model.config["num_attention_heads"] * generator.model.config["attention_head_dim"] == 256
    lines = imbalanced_requests(4, 64, 32, (2, 4), frames=9 if family == "wan" else None)
    seq_lens = [
        generator.request_seq_lens(parse_request(i, i + 1, json.dumps(line), default_steps=28))
        for i, line in enumerate(lines)
    ]
    if family == "wan":  # 3 latent frames x 4 x 4 tokens, twice; 2 x 2 once
        assert seq_lens == [(48, 48), (4,), (48, 48), (4,)]
    elif family == "flux3":  # as FLUX's, twice: the guider's unconditional branch (text "", also cut at 16)
        assert seq_lens == [(272, 272), (80, 80), (272, 272), (80, 80)]
    else:  # 16 text tokens + 16 x 16 or 8 x 8 image tokens
        assert seq_lens == [(272,), (80,), (272,), (80,)]
    assert [line["steps"] for line in lines] == [2, 2, 4, 4]


@pytest.mark.parametrize("count", range(2, 8))
def test_bench_train_orders_balance_places_and_predecessors(count):
    """bench train's mode orders (a step can run slower after some modes than after others): over the
    design, each mode equally often in each place; within the orders, right after each other mode
    equally often; across the step boundaries, right after itself once (the mirror) and after the mode
    listed before it once."""
    from collections import Counter
    from itertools import pairwise

    from deepspeed_knap.bench.train import carryover_balanced_orders

    orders = carryover_balanced_orders(count)
    assert all(sorted(order) == list(range(count)) for order in orders)
    assert len(orders) == 2 * count
    for place in range(count):
        assert Counter(order[place] for order in orders) == Counter({m: len(orders) // count for m in range(count)})
    within = Counter(pair for order in orders for pair in pairwise(order))
    assert set(within) == {(a, b) for a in range(count) for b in range(count) if a != b}
    assert len(set(within.values())) <= 1
    across = Counter((before[-1], after[0]) for before, after in pairwise(orders + orders[:1]))
    per_design = len(orders) // (2 * count)
    assert {m: across[m, m] for m in range(count)} == dict.fromkeys(range(count), per_design)  # the mirrors
    extra = Counter(b for (a, b), n in across.items() for _ in range(n) if a != b)
    assert extra == Counter(dict.fromkeys(range(count), per_design))
    if count % 2 == 0:  # one extra predecessor each: the mode listed before it
        assert all(across[(m - 1) % count, m] == per_design for m in range(count))


def test_counting_saved_activations_frees_them():
    """Counting the bytes autograd saves must not keep them: an identity pack hook leaked every saved
    output (``exp`` saves its result) through a cycle no garbage collection frees."""
    import weakref

    from deepspeed_knap.bench.flux import saved_activation_bytes

    outputs = []

    class Exp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            y = (x * self.weight).exp()  # exp saves y itself for backward
            outputs.append(weakref.ref(y))
            return y.sum()

    model = Exp()
    saved = saved_activation_bytes(lambda: model(torch.ones(1000, 4)), model)
    assert saved == 2 * 1000 * 4 * 4  # x (for the weight's gradient) and y, float32
    assert outputs[0]() is None


def test_bench_generate_reports_no_plan_time_for_a_mode_that_never_plans_as_strict_json(tmp_path):
    """The unbalanced and pipeline modes neither plan nor route: their plan and route times are
    null in --json (NaN was, which strict JSON readers such as jq refuse) and n/a in the table. A
    --requests file that cannot be read is refused before the ranks start."""
    import json

    from deepspeed_knap.bench.generate import _median_ms, format_report
    from deepspeed_knap.cli import main

    assert _median_ms([]) is None and _median_ms([0.001, 0.003]) == pytest.approx(2.0)

    mode = {"images": 4, "wall_s": 2.0, "images_per_s": 2.0, "rank_wall_s": [2.0, 1.9], "rank_busy_s": [1.5, 1.0],
            "rank_cpu_s": [1.6, 1.1], "rank_images": [2, 2], "steps": 8, "solves": 0, "plan_ms": None,
            "route_ms": None}  # fmt: skip
    report = {"options": {"ranks": 2, "dtype": "float32", "family": "flux", "heads": 4, "head_dim": 32, "repeats": 1},
              "modes": {"unbalanced": mode}}  # fmt: skip
    assert json.loads(json.dumps(report, allow_nan=False)) == report
    assert "n/a" in format_report(report).splitlines()[-1]
    assert main(["bench", "generate", "--requests", str(tmp_path / "missing.jsonl")]) == 2
