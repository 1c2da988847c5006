"""``deepspeed-knap bench step``: the emulated ranks do what real Ulysses members do, and the report
holds what it claims."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from deepspeed_knap.bench import step as bench_step
from deepspeed_knap.cost.model import CostModel
from deepspeed_knap.models.flux.calibrate import FluxBlockTimer
from deepspeed_knap.planner import plan_loads, plan_routing
from deepspeed_knap.planner.topology import build_topology
from deepspeed_knap.runtime import emulation
from deepspeed_knap.runtime.layout import gpu_layout
from tests.support.distributed import run_distributed

HEADS, HEAD_DIM = 6, 4  # 6 heads over a bag of 4: members run 2, 2, 1, 1
# Per rank; the 2- and 3-token sequences leave empty chunks in a bag of 4.
SEQ_LENS = [[37, 2], [], [64, 3, 9], [11, 19]]
TEXT_LENS = np.array([5, 0, 10, 1, 2, 3, 4])
FREE_ALLTOALL = CostModel(1.0, 0.05)  # the planner really uses the bags


class Recorder:
    """Wraps a local attention kernel and records what it is called on."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __call__(self, q, k, v, seqs):
        self.calls.append((tuple(q.shape), seqs.seq_lens))
        return self.kernel(q, k, v, seqs)

    def resolve(self, device, dtype):
        return self.kernel.resolve(device, dtype)


def _kernel_calls_worker(rank: int, world: int) -> dict:
    import deepspeed.comm as dist

    from deepspeed_knap.runtime.attention import KnapDistributedAttention
    from deepspeed_knap.runtime.groups import create_process_groups

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    calls = {}
    for spec in ("g4n1", "g1n2+g2n1"):
        topology = build_topology(spec, world)
        plan = plan_routing(SEQ_LENS, topology, FREE_ALLTOALL, "refine")
        routed = emulation.emulated_rank_batch(plan, rank, TEXT_LENS, HEADS * HEAD_DIM, torch.device("cpu"),
                                                torch.float64)  # fmt: skip
        real, emulated = KnapDistributedAttention(HEADS), emulation.EmulatedUlyssesAttention(HEADS)
        real.varlen_attn, emulated.varlen_attn = Recorder(real.varlen_attn), Recorder(emulated.varlen_attn)
        qkv = [torch.randn(routed.batch.num_tokens, HEADS, HEAD_DIM, dtype=torch.float64) for _ in range(3)]
        real_routed = dataclasses.replace(routed, groups=create_process_groups(topology))
        shapes = [tuple(real(*qkv, real_routed).shape), tuple(emulated(*qkv, routed).shape)]
        calls[spec] = {"real": real.varlen_attn.calls, "emulated": emulated.varlen_attn.calls, "shapes": shapes,
                       "max_group": int(plan.seq_group_size.max())}  # fmt: skip
    return calls


@pytest.mark.multirank
def test_emulated_members_call_the_kernel_on_what_real_ulysses_members_get():
    results = run_distributed(_kernel_calls_worker, 4, timeout=180)
    for rank, calls in enumerate(results):
        for spec, got in calls.items():
            assert got["max_group"] == {"g4n1": 4, "g1n2+g2n1": 2}[spec], "the plan must use the bags"
            assert got["real"] == got["emulated"], (rank, spec)
            assert got["shapes"][0] == got["shapes"][1]
    # Every member of the bag of 4 runs its head share (2, 2, 1, 1) of the bag's whole sequences, the
    # last ones although they hold only empty chunks of the shortest.
    first_calls = [calls["g4n1"]["real"][0] for calls in results]
    assert [shape[1] for shape, _ in first_calls] == [2, 2, 1, 1]
    assert len({(shape[0], seq_lens) for shape, seq_lens in first_calls}) == 1


def test_emulated_attention_is_exact_where_no_bag_is_used():
    from deepspeed_knap.runtime.attention import KnapDistributedAttention

    plan = plan_routing(SEQ_LENS, build_topology("g4n1"), FREE_ALLTOALL, "none")
    routed = emulation.emulated_rank_batch(plan, 2, TEXT_LENS, HEADS * HEAD_DIM, torch.device("cpu"), torch.float64)
    qkv = [torch.randn(routed.batch.num_tokens, HEADS, HEAD_DIM, dtype=torch.float64) for _ in range(3)]
    expected = KnapDistributedAttention(HEADS)(*qkv, routed)
    torch.testing.assert_close(emulation.EmulatedUlyssesAttention(HEADS)(*qkv, routed), expected, rtol=0, atol=0)


def test_emulated_rank_holds_the_plans_tokens_text_first():
    plan = plan_routing(SEQ_LENS, build_topology("g4n1"), FREE_ALLTOALL, "refine")
    total_text = 0
    for gpu in range(4):
        routed = emulation.emulated_rank_batch(plan, gpu, TEXT_LENS, 8, torch.device("cpu"), torch.float32)
        assert routed.batch.num_tokens == plan.gpu_tokens[gpu]
        total_text += int(routed.batch.token_data["is_text"].sum())
    assert total_text == TEXT_LENS.sum()


def test_route_seconds_from_the_layouts_send_and_receive_counts():
    plan = plan_routing(SEQ_LENS, build_topology("g1n2+g2n1"), FREE_ALLTOALL, "refine")
    busiest = 0
    for gpu in range(4):
        layout = gpu_layout(plan, gpu)
        away = np.arange(4) != gpu
        busiest = max(busiest, layout.send_counts[away].sum(), layout.recv_counts[away].sum())
    assert busiest > 0
    assert bench_step.route_seconds(plan, 16, 2, 1.0) == pytest.approx(4 * busiest * 16 * 2 / 1e9)


def test_bench_step_runs_end_to_end_and_reports_against_the_given_model(tmp_path, capsys):
    calibration = tmp_path / "cal.json"
    efficiency = [[2, 0.5]]  # as calibrate --degrees writes it: a bag of 2 does half its ideal share
    calibration.write_text(json.dumps({"linear_coef": 1e-4, "quadratic_coef": 1e-7, "overhead_s": 0.5,
                                       "degree_efficiency": efficiency}))  # fmt: skip
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--topology", "g2n2", "--mix", "kf_image_video", "--token-scale", "0.01",
            "--heads", "2", "--head-dim", "8", "--double-blocks", "2", "--single-blocks", "3", "--steps", "1",
            "--repeats", "1", "--calibration", str(calibration), "--json", str(out), "--plot", str(tmp_path / "s.png")]  # fmt: skip
    from deepspeed_knap.cli import main

    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "measured speedup" in printed and "modeled from bandwidth, not measured" in printed
    per_rank = printed.split("per rank, step 0:")[1].strip().splitlines()
    assert [line.split()[0] for line in per_rank[1:5]] == ["0", "1", "2", "3"] and "written to" in per_rank[5]
    report = json.loads(out.read_text())
    (row,) = report["steps"]
    seq_lens, _ = bench_step.scaled_lengths("kf_image_video", 4, 0, 0.01)
    assert row["tokens"] == sum(map(sum, seq_lens))
    # Without balancing a busy rank's modeled seconds are the overhead + a*s + b*s^2 over its sequences.
    own = [(0.5 if rank else 0.0) + sum(1e-4 * s + 1e-7 * s * s for s in rank) for rank in seq_lens]
    np.testing.assert_allclose(row["none"]["modeled_s"], own, rtol=1e-12)
    # Balanced, the file's bag efficiency prices the bags of 2, in the plan and the modeled seconds.
    alltoall_coef = CostModel.from_model_dims(16, 2, 3, alltoall_gbps=150.0, bytes_per_element=4).alltoall_coef
    modeled = {}
    for efficiency in (((2, 0.5),), None):
        model = CostModel(1e-4, 1e-7, degree_efficiency=efficiency)
        plan = plan_routing(seq_lens, build_topology("g2n2"), dataclasses.replace(model, alltoall_coef=alltoall_coef))
        modeled[efficiency] = plan_loads(plan, model) + 0.5 * (plan.gpu_tokens > 0)
    np.testing.assert_allclose(row["refine"]["modeled_s"], modeled[((2, 0.5),)], rtol=1e-12)
    assert not np.allclose(modeled[((2, 0.5),)], modeled[None])  # what the file's efficiency changes
    for name in ("none", "refine"):
        measured, tokens = np.array(row[name]["measured_s"]), np.array(row[name]["tokens"])
        assert tokens.sum() == row["tokens"] and np.all((measured > 0) == (tokens > 0))
        assert row[name]["measured_step_s"] == measured.max()
    assert row["none"]["ulysses_comm_s"] == 0 and row["none"]["route_comm_s"] == 0
    assert (tmp_path / "s.png").stat().st_size > 10_000


def test_bench_step_errors_name_the_fix():
    timer = FluxBlockTimer(2, 8, 1, 1, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="bags of 4 GPUs but the blocks have 2 heads; give --heads"):
        bench_step.bench_step("g4n1", "kf_lowres", 1, timer, 0.01)
    with pytest.raises(ValueError, match="--solver none would compare"):
        bench_step.bench_step("g2n2", "kf_lowres", 1, timer, 0.01, solver="none")
    bad = {"linear_coef": 1e-4, "quadratic_coef": 1e-7, "degree_efficiency": [[8.7, 0.9]]}
    with pytest.raises(ValueError, match=r"--calibration: degree_efficiency = \[\[8\.7, 0\.9\]\]; expected"):
        bench_step.bench_step("g2n2", "kf_lowres", 1, timer, 0.01, calibration=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine")
def test_bench_step_on_gpu_with_a_varlen_kernel(tmp_path):
    from deepspeed_knap.cli import main

    out = tmp_path / "step.json"
    # Full-size lengths and 8 heads of 128: at 0.25x and 4 x 64 an H100 ran every length in the same
    # 0.22 s (kernel launches), and the calibration refused times that do not grow with the length.
    argv = ["bench", "step", "--topology", "g2n2", "--token-scale", "1", "--heads", "8", "--head-dim", "128",
            "--steps", "1", "--repeats", "2", "--dtype", "bfloat16", "--device", "cuda", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["steps"]
    assert row["refine"]["measured_imbalance"] < row["none"]["measured_imbalance"]
