"""The cost model by attention segment (FLUX.3's token modes) and the planner fed with segments.

The per-segment terms are checked against FLOPs counted on diffusers' own ``Flux3Transformer2DModel``
(linear layers by torch's FlopCounterMode, attention from the shapes of every attention call it
makes, counted by hand), and the old pricing (one segment per sample) against the new on the
``flux3_edit`` mix: how far off it was.
"""

from __future__ import annotations

import inspect
import re
import warnings

import numpy as np
import pytest
import torch

from deepspeed_knap import build_topology, default_cost_model, plan_routing
from deepspeed_knap.cost.model import CostModel, segment_square_sums
from deepspeed_knap.models.registry import PRESETS, sample_mix, sample_segments, sample_shapes
from deepspeed_knap.planner.solve import lower_bound, plan_loads
from tests.support.flux3_cases import CONFIGS, diffusers_output, random_samples, reference_model


class _AttentionCalls(torch.overrides.TorchFunctionMode):
    """Records ``(query length, key length, heads x head dim)`` of every attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            named = dict(zip(("query", "key"), args, strict=False)) | (kwargs or {})
            query, key = named["query"], named["key"]  # [B, H, L, Dh]
            self.calls.append((query.shape[-2], key.shape[-2], query.shape[0] * query.shape[1] * query.shape[-1]))
        return func(*args, **(kwargs or {}))


def _counted_flops(shape) -> tuple[float, float, list[tuple[int, int, int]]]:
    """Forward FLOPs diffusers spends in its blocks on one sample: ``(linear, attention, calls)``.
    Linear: torch's count of the blocks' matmuls. Attention: ``Q K^T`` and ``P V``, each ``Lq * Lk *
    (H * Dh)`` multiply-adds, from the shapes of the calls it makes."""
    from torch.utils.flop_counter import FlopCounterMode

    warnings.filterwarnings("ignore", category=UserWarning)  # diffusers' fp32 q/k norm on an fp64 model
    model = reference_model("flux3", torch.float64)
    sample = random_samples("flux3", [shape], 0, torch.float64)[0]
    recorder = _AttentionCalls()
    with FlopCounterMode(display=False) as counter, recorder:
        diffusers_output(model, sample)
    counts = counter.get_flop_counts()
    block = re.compile(
        r"Flux3Transformer2DModel\.(txt_mode_blocks\.\d+|mode_blocks\.\w+\.\d+|single_transformer_blocks\.\d+)"
    )
    linear = sum(sum(ops.values()) for name, ops in counts.items() if block.fullmatch(name))
    attention = sum(2 * 2 * lq * lk * width for lq, lk, width in recorder.calls)
    return float(linear), float(attention), recorder.calls


def _tiny_cost_model() -> CostModel:
    """FLUX.3's formula at the tiny test config, at 1 FLOP/s (so seconds are FLOPs)."""
    config = CONFIGS["flux3"]
    return CostModel.from_model_dims(
        hidden=config["num_attention_heads"] * config["attention_head_dim"],
        double_blocks=0,
        single_blocks=config["num_single_layers"],
        mode_blocks=config["num_layers"],
        mlp_ratio=1.5 * config["mlp_ratio"],  # a SwiGLU MLP 3x wide: 9 d^2, what 4.5 counts
        tflops=1e-12,
    )


@pytest.mark.parametrize(
    "shape",
    [(2, 3, 5, ((3, 3), (1, 2))), (4, 4, 3, ())],
    ids=["text 5, image 6, references 11", "text 3, image 16, no reference"],
)
def test_per_segment_terms_equal_the_flops_diffusers_spends(shape):
    """Forward + backward FLOPs of the model (3x linear, 3.5x attention, the factors it documents)
    equal diffusers' counted forward FLOPs at those factors: the per-mode blocks attend over each
    mode alone (one attention call per mode and block, of that mode's length), the joint blocks
    over the whole sample. Priced as one segment, the same sample is off by exactly the cross-mode
    pairs of the per-mode blocks."""
    height, width, text, refs = shape
    segments = [text, height * width, sum(h * w for h, w in refs)]
    length = sum(segments)
    linear, attention, calls = _counted_flops(shape)
    config = CONFIGS["flux3"]
    modes = [n for n in segments if n]
    expected_calls = sorted(
        [(n, n) for n in modes] * config["num_layers"] + [(length, length)] * config["num_single_layers"]
    )
    assert sorted((lq, lk) for lq, lk, _ in calls) == expected_calls

    model = _tiny_cost_model()
    squares = segment_square_sums(np.array([segments]))
    priced = float(model.per_gpu_time(np.array([length]), 1, 1.0, squares)[0])
    assert priced == pytest.approx(3 * linear + 3.5 * attention, rel=1e-12)
    # One segment per sample: the per-mode blocks priced over every pair of the sample's tokens.
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    cross_pairs = length**2 - sum(n * n for n in segments)
    as_one = float(model.per_gpu_time(np.array([length]), 1)[0])
    assert as_one - priced == pytest.approx(3.5 * 4 * dim * config["num_layers"] * cross_pairs, rel=1e-9)
    assert (as_one > priced) == bool(cross_pairs)


def test_the_flux3_preset_has_diffusers_default_dims():
    import diffusers

    defaults = {
        k: p.default for k, p in inspect.signature(diffusers.Flux3Transformer2DModel.__init__).parameters.items()
    }
    preset = PRESETS["flux3"][1]
    assert preset["hidden"] == defaults["num_attention_heads"] * defaults["attention_head_dim"]
    assert preset["num_heads"] == defaults["num_attention_heads"]
    assert preset["mode_blocks"] == defaults["num_layers"]
    assert preset["single_blocks"] == defaults["num_single_layers"] and preset["double_blocks"] == 0
    assert preset["mlp_ratio"] == 1.5 * defaults["mlp_ratio"]  # SwiGLU: 2 * 3 + 3 = 9 d^2
    model = default_cost_model("flux3")
    assert model.segment_attention_share == defaults["num_layers"] / (
        defaults["num_layers"] + defaults["num_single_layers"]
    )
    assert default_cost_model("flux-dev").segment_attention_share == 0


def test_one_segment_per_sequence_plans_as_no_segments_bit_for_bit():
    """Rows of one segment price ``s**2`` exactly: the plans equal those made without segments, for
    a model with per-segment blocks, on fixed and elastic topologies."""
    model = default_cost_model("flux3")
    lengths = sample_mix("flux3_edit", 8, 1)
    for spec in ("auto", "g4n2"):
        topology = build_topology(spec, 8 if spec == "auto" else None)
        plain = plan_routing(lengths, topology, model)
        single = plan_routing(lengths, topology, model, seq_segments_per_rank=[[[n] for n in rank] for rank in lengths])
        assert single == plain


def test_segments_that_do_not_cover_their_sequence_are_refused_naming_it():
    model, topology = default_cost_model("flux3"), build_topology("g2n1")
    with pytest.raises(
        ValueError, match=r"rank 1: sequence 0 has attention segments \[2, 3, 4\] summing to 9, but its length is 10"
    ):
        plan_routing([[5], [10]], topology, model, seq_segments_per_rank=[[[5, 0, 0]], [[2, 3, 4]]])
    with pytest.raises(ValueError, match=r"rank 0: 2 rows of attention segments for 1 sequences"):
        plan_routing([[5], [10]], topology, model, seq_segments_per_rank=[[[5], [1]], [[10]]])
    with pytest.raises(ValueError, match=r"rank 0: sequence 0 has attention segments \[6, -1\]"):
        plan_routing([[5], [10]], topology, model, seq_segments_per_rank=[[[6, -1]], [[10]]])
    with pytest.raises(ValueError, match=r"segments for 1 ranks, but the balance group has 2"):
        lower_bound([[5], [10]], topology, model, seq_segments_per_rank=[[[5]]])


def test_flux3_edit_segments_cover_their_samples():
    for rank in sample_shapes("flux3_edit", 16, 3):
        for shape in rank:
            text, image, reference = shape.segments
            assert text % 80 == 0 and 80 <= text <= 400 and image >= 256 and sum(shape.segments) == shape.length
            assert (reference > 0) == (shape.frames > 1)
    edits = [s for rank in sample_shapes("flux3_edit", 64, 0) for s in rank if s.reference]
    assert edits and max(s.reference for s in edits if s.frames == 2) > 3 * 4096  # a whole 4-megapixel reference


# What ignoring the segments costs on flux3_edit (docs/cost_model.md quotes these figures).
MISPRICING_SEEDS = (0, 1, 2)


@pytest.mark.parametrize("gpus, spec", [(32, "auto"), (32, "g8n4")])
def test_pricing_editing_samples_as_one_segment_misprices_the_step(gpus, spec, capsys):
    """On ``flux3_edit`` with the ``flux3`` model: the plan solved by segment has the modeled step
    that its loads, repriced by segment, say; priced as one segment per sample, the same mix's
    modeled step is overstated (every edit costs more), and the plan solved that way is no faster,
    priced by segment, than the plan solved by segment. Prints the figures."""
    model = default_cost_model("flux3")
    topology = build_topology(spec, gpus if spec == "auto" else None)
    overstated, slower = [], []
    for seed in MISPRICING_SEEDS:
        lengths, segments = sample_mix("flux3_edit", gpus, seed), sample_segments("flux3_edit", gpus, seed)
        by_segment = plan_routing(lengths, topology, model, seq_segments_per_rank=segments)
        as_one = plan_routing(lengths, topology, model)
        assert plan_loads(by_segment, model, segments).tolist() == by_segment.gpu_loads.tolist()
        true_step_of_old = float(plan_loads(as_one, model, segments).max())
        assert as_one.max_load > true_step_of_old  # the old pricing overstates its own plan's step
        assert by_segment.max_load <= true_step_of_old * (1 + 1e-12)
        overstated.append(as_one.max_load / true_step_of_old - 1)
        slower.append(true_step_of_old / by_segment.max_load - 1)
    with capsys.disabled():
        print(f"\nflux3_edit {spec} on {gpus} GPUs: one-segment pricing overstates the modeled step by "
              f"{', '.join(f'{v:.1%}' for v in overstated)}; its plans run {', '.join(f'{v:.2%}' for v in slower)} "
              "slower (priced by segment)")  # fmt: skip


def test_the_issue_example_sample():
    """4,096 image, 512 text and 4,096 reference tokens: per-mode blocks ``b (4096^2 + 512^2 +
    4096^2)``, joint blocks ``b 8704^2``."""
    model = default_cost_model("flux3")
    share = model.segment_attention_share
    squares = segment_square_sums(np.array([[512, 4096, 4096]]))
    assert squares[0] == 4096**2 + 512**2 + 4096**2
    expected = model.linear_coef * 8704 + model.quadratic_coef * ((1 - share) * 8704**2 + share * squares[0])
    assert float(model.per_gpu_time(np.array([8704]), 1, 1.0, squares)[0]) == pytest.approx(expected, rel=1e-12)


def test_flux3_zero3_config_prices_flux3_and_its_memory_arithmetic_holds():
    """ds_configs/flux3_zero3_4x8.json: its cost model is the flux3 preset, priced by segment; its
    groups fit FLUX.3's heads; P and the cap's activation rows are the docs' (docs/models.md, FLUX.3
    on 4 x 8 H100); and the largest flux3_edit rank and sample fit the cap."""
    from pathlib import Path

    from deepspeed_knap.models.flux3 import PackedFlux3Transformer
    from deepspeed_knap.runtime.config import get_knapformer_config, load_ds_config

    root = Path(__file__).parents[2]
    knap = get_knapformer_config(load_ds_config(str(root / "ds_configs" / "flux3_zero3_4x8.json")))
    assert knap.cost_model.build() == default_cost_model("flux3")
    topology = build_topology(knap.topology, 32, knap.gpus_per_node, max_degree=knap.max_degree)
    with torch.device("meta"):
        model = PackedFlux3Transformer(topology=topology)
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters == pytest.approx(5.54e9, rel=1e-3)
    assert 2 * parameters / 32 / 1e9 == pytest.approx(0.35, abs=0.005)  # each bf16 partition, GB
    assert 12 * parameters / 32 / 1e9 == pytest.approx(2.08, abs=0.005)  # fp32 master, m, v
    cap, width = knap.max_tokens_per_gpu, model.inner_dim
    assert 33 * cap * width * 2 / 1e9 == pytest.approx(13.3, abs=0.05)  # checkpointed block inputs
    shapes = [s for seed in range(8) for s in sample_shapes("flux3_edit", 32, seed)]
    assert max(sum(s.length for s in rank) for rank in shapes) <= cap


def test_plan_command_prices_a_mix_by_segment_with_the_flux3_model(capsys):
    """``deepspeed-knap plan --mix flux3_edit --model flux3``: the refine plan's modeled step is the
    planner's on the mix's segments (not on its lengths alone, which differs)."""
    import json

    from deepspeed_knap.cli import main

    assert main(["plan", "--mix", "flux3_edit", "--model", "flux3", "--gpus", "16", "--topology", "auto",
                 "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    model, topology = default_cost_model("flux3"), build_topology("auto", 16)
    lengths, segments = sample_mix("flux3_edit", 16, 0), sample_segments("flux3_edit", 16, 0)
    by_segment = plan_routing(lengths, topology, model, seq_segments_per_rank=segments)
    assert report["solvers"]["refine"]["max_load_s"] == pytest.approx(by_segment.max_load, rel=1e-12)
    assert plan_routing(lengths, topology, model).max_load != pytest.approx(by_segment.max_load, rel=1e-3)
    assert "priced by segment" in report["lengths"]
