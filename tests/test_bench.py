"""The planner benchmark runs end to end (small) and its tables hold what they claim."""

import pytest

from deepspeed_knap.bench import planner as bench


def test_32_gpu_table_smoke():
    rows = bench.bench_32(steps=1, workload_names=["kf_mixed_res"])
    assert len(rows) == len(bench.TOPOLOGIES_32) * 3
    for row in rows:
        assert row["ratio_to_bound"] >= 1 - 1e-9 and row["solve_ms"] > 0
    table = bench.format_32(rows)
    assert table.count("\n| kf_mixed_res |") == len(bench.TOPOLOGIES_32)


def test_scale_smoke():
    rows = bench.bench_scale(steps=1, num_gpus=64, per_rank=4)
    topologies = ["g1n64", "g8n8", "g1n32+g2n8+g4n2+g8n1"]
    assert bench.scale_topologies(64) == topologies
    assert [row["topology"] for row in rows] == [t for t in topologies for _ in range(3)]
    assert "| g8n8 | refine |" in bench.format_scale(rows)


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
    from deepspeed_knap.bench import flux

    flux.main(["--workload", "kf_mixed_res", "--ranks", "2", "--token-scale", "0.01", "--layers", "1",
               "--single-layers", "1", "--head-dim", "16", "--repeats", "1"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: [float(x) for x in line.split()[1:3]] for line in lines[2:]}
    assert set(rows) == {"diffusers", "packed"}
    # The same tokens through the same layers: activation memory within 10% of each other.
    assert rows["packed"][1] == pytest.approx(rows["diffusers"][1], rel=0.1)
