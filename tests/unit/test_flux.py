"""Both packed FLUX families against diffusers' own models, one sample at a time.

The reference is diffusers' ``FluxTransformer2DModel`` / ``Flux2Transformer2DModel`` run on each sample
alone (batch of one), which is how diffusers must run samples of different sizes. Our models run all of
a rank's samples packed, unbalanced in one process and balanced over 4 gloo ranks.
"""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.flux_cases import (
    CONFIGS,
    SHAPES,
    TOLERANCE,
    diffusers_class,
    diffusers_output,
    grads,
    norm_relative_error,
    output_weights,
    packed_class,
    random_samples,
    reference_model,
    relative_error,
)
from tests.support.launch import ROOT

diffusers = pytest.importorskip("diffusers")

FAMILIES = ["flux", "flux2"]

# Per rank of 4: uneven, one rank empty, a long sample that balancing splits.
RANK_SHAPES = [[(1, 6, 7, 4), (1, 1, 2, 1)], [], [(2, 3, 3, 6), (1, 2, 2, 0), (1, 1, 3, 2)], [(1, 3, 2, 5)]]


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_names_and_shapes_equal_diffusers_both_ways(family):
    ref = reference_model(family, torch.float32)
    packed = packed_class(family)(**CONFIGS[family])
    ours = {k: tuple(v.shape) for k, v in packed.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert ours == theirs
    ref.load_state_dict(packed_class(family).from_diffusers(ref).state_dict(), strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("guidance", [True, False], ids=["guidance", "no-guidance"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_outputs_and_gradients_equal_diffusers_per_sample(family, dtype, guidance):
    ref = reference_model(family, dtype, guidance)
    packed = packed_class(family).from_diffusers(ref, attention_backend="sdpa")
    samples = random_samples(family, SHAPES, 1, dtype, guidance)
    weights = output_weights(samples, 2)

    outputs = packed.forward_samples(samples)
    sum((o * w.to(dtype)).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    for sample, output, weight in zip(samples, outputs, weights, strict=True):
        expected = diffusers_output(ref, sample)
        assert output.shape == expected.shape
        assert relative_error(output, expected) <= TOLERANCE[dtype]
        (expected * weight.to(dtype)).sum().backward()  # gradients accumulate over samples, like ours
    ours, theirs = grads(packed), grads(ref)
    if dtype == torch.float64:
        for name in theirs:
            assert relative_error(ours[name], theirs[name]) <= TOLERANCE[dtype], name
    else:  # fp32: summing packed tokens in another order than diffusers leaves ~1e-5 of rounding
        assert norm_relative_error(*(torch.cat([g[n].flatten() for n in theirs]) for g in (ours, theirs))) <= 1e-5
        for name in theirs:
            assert norm_relative_error(ours[name], theirs[name]) <= 2e-5, name


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_changes_nothing(family):
    ref = reference_model(family, torch.float64)
    plain = packed_class(family).from_diffusers(ref, attention_backend="sdpa")
    checkpointed = packed_class(family).from_diffusers(ref, attention_backend="sdpa", gradient_checkpointing=True)
    samples = random_samples(family, SHAPES, 3, torch.float64)
    results = []
    for model in (plain, checkpointed):
        outputs = model.forward_samples(samples)
        sum(o.square().sum() for o in outputs).backward()
        results.append((torch.cat(outputs), grads(model)))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert torch.allclose(grad, results[1][1][name], rtol=1e-12, atol=1e-14), name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rank_without_samples_runs_forward_and_backward(family):
    """A GPU with zero tokens (no samples this step, balancing off): every layer runs on empty
    tensors and every parameter gets a (zero) gradient, as ZeRO-3 needs from every rank."""
    model = packed_class(family)(**CONFIGS[family])
    inputs = model.pack([])
    out = model(inputs, None)
    assert out.shape == (0, CONFIGS[family]["in_channels"])
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert model.forward_samples([]) == []


def test_modulation_gradients_are_exact():
    from deepspeed_knap.models.layers import gate, modulate

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    shift, scale = (torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda x, a, b: modulate(x, seq, a, b), (x, shift, scale))
    assert torch.autograd.gradcheck(lambda x, a: gate(x, seq, a), (x, scale))
    assert torch.equal(modulate(x, seq, shift, scale), x * (1 + scale[seq]) + shift[seq])


def test_rope_and_timestep_features_are_bitwise_diffusers():
    from diffusers.models.embeddings import get_timestep_embedding
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    from deepspeed_knap.models.flux import latent_ids
    from deepspeed_knap.models.flux.base import text_ids
    from deepspeed_knap.models.flux.flux2 import image_ids
    from deepspeed_knap.models.flux.layers import rotary_cos_sin
    from deepspeed_knap.models.layers import timestep_features

    ids = latent_ids(3, 5, 7) * 1.5
    for ours, theirs in zip(rotary_cos_sin(ids, (16, 56, 56)), FluxPosEmbed(10000, [16, 56, 56])(ids), strict=True):
        assert torch.equal(ours, theirs)
    ids = torch.cat([text_ids(9), image_ids(5, 7), image_ids(4, 3, t=10)])
    ours, theirs = rotary_cos_sin(ids, (32, 32, 32, 32), 2000), Flux2PosEmbed(2000, [32, 32, 32, 32])(ids)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    t = torch.rand(16, dtype=torch.float64) * 1000
    assert torch.equal(timestep_features(t), get_timestep_embedding(t, 256, True, 0))


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_diffusers_and_diffusers_checkpoints_load_here(family, tmp_path):
    from deepspeed_knap.models.auto import from_pretrained

    ref = reference_model(family, torch.float32)
    samples = random_samples(family, SHAPES[:3], 4, torch.float32)
    expected = [diffusers_output(ref, s) for s in samples]

    exported = packed_class(family).from_diffusers(ref).save_pretrained(tmp_path / "ours")
    reloaded = diffusers_class(family).from_pretrained(exported)
    for sample, want in zip(samples, expected, strict=True):
        assert torch.equal(diffusers_output(reloaded, sample), want)
    sharded = packed_class(family).from_diffusers(ref).save_pretrained(tmp_path / "ours_sharded", max_shard_size=20_000)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert diffusers_class(family).from_pretrained(sharded).state_dict().keys() == ref.state_dict().keys()

    ref.save_pretrained(tmp_path / "pipeline" / "transformer")  # a pipeline directory layout
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    for path in (tmp_path / "pipeline", tmp_path / "sharded", sharded):
        model = from_pretrained(path, attention_backend="sdpa")  # the family comes from config.json
        assert type(model) is packed_class(family)
        for output, want in zip(model.forward_samples(samples), expected, strict=True):
            assert relative_error(output, want) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_samples_name_the_problem(family):
    config = CONFIGS[family]
    model = packed_class(family)(**config)
    sample = random_samples(family, SHAPES[:1], 5, torch.float32)[0]
    axes = len(config["axes_dims_rope"])
    cases = {
        "sample 0 has no ['guidance'] (this model has guidance_embeds=True": {
            k: v for k, v in sample.items() if k != "guidance"
        },
        "'hidden_states' has shape [12, 5]; expected [12, 8]": {**sample, "hidden_states": torch.zeros(12, 5)},
        f"'img_ids' has shape [11, {axes}]; expected [12, {axes}]": {**sample, "img_ids": torch.zeros(11, axes)},
        f"'txt_ids' has shape [5, 3]; expected [5, {axes}]" if axes != 3 else "'txt_ids' has shape [5, 2]": {
            **sample,
            "txt_ids": torch.zeros(5, 3 if axes != 3 else 2),
        },
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
            model.pack([bad])
        carried = model.pack([sample, bad], on_problem="carry")  # for a balanced step to raise on every rank
        assert message.replace("sample 0", "sample 1") in carried.problem and carried.num_samples == 0
        with pytest.raises(ValueError, match="sample 1"):
            model(carried)  # unbalanced: raised here
    unguided = packed_class(family)(**{**config, "guidance_embeds": False})
    with pytest.raises(ValueError, match="has a guidance value but this model has guidance_embeds=False"):
        unguided.pack([sample])
    with pytest.raises(ValueError, match=f"must sum to attention_head_dim={config['attention_head_dim']}"):
        packed_class(family)(**{**config, "axes_dims_rope": (4,) * axes})


def test_bad_checkpoints_name_the_file_and_the_key(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from deepspeed_knap.models import loading
    from deepspeed_knap.models.auto import from_pretrained
    from deepspeed_knap.models.flux import PackedFluxTransformer
    from deepspeed_knap.models.flux.flux2 import PackedFlux2Transformer
    from deepspeed_knap.models.loading import CheckpointError
    from deepspeed_knap.planner.topology import build_topology

    # A config key diffusers' class takes and this one does not is a variant; one neither takes,
    # diffusers ignores, and so does the loader (test_qwenimage: Qwen-Image's released config).
    class NewerDiffusers:
        def __init__(self, ip_adapter_layers=0, **config):
            pass

    (tmp_path / "config.json").write_text(json.dumps({**CONFIGS["flux"], "ip_adapter_layers": 3}))
    missing = "diffusers is not installed"
    for theirs, shown in ((NewerDiffusers, ""), (missing, rf" \({missing}, to tell which ones diffusers ignores\)")):
        monkeypatch.setattr("deepspeed_knap.models.loading._diffusers_class", lambda name, theirs=theirs: theirs)
        with pytest.raises(ValueError, match=r"config keys \['ip_adapter_layers'\] that this FluxTransformer2DModel "
                           f"implementation does not know{shown}"):  # fmt: skip
            PackedFluxTransformer.from_pretrained(tmp_path)
    monkeypatch.undo()

    def fails_to_import(name):  # diffusers' lazy import of a model whose dependency is broken
        raise RuntimeError(f"Failed to import diffusers.models.{name}")

    broken = types.ModuleType("diffusers")
    broken.__getattr__ = fails_to_import
    monkeypatch.setitem(sys.modules, "diffusers", broken)
    with pytest.raises(CheckpointError, match=r"\(diffusers has no FluxTransformer2DModel here \(RuntimeError: Failed"):
        PackedFluxTransformer.from_pretrained(tmp_path)  # a CheckpointError, which the ranks agree on
    monkeypatch.setitem(sys.modules, "diffusers", None)  # not installed, unlike a dependency of it missing
    assert loading._diffusers_class("FluxTransformer2DModel") == "diffusers is not installed"
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        from_pretrained(tmp_path / "missing")
    (tmp_path / "config.json").write_text("[]")  # an AttributeError on the rank that read it, before
    with pytest.raises(ValueError, match=r"config\.json holds a JSON list, not a diffusers config"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(CheckpointError, match=r"config\.json has _class_name 'SD3Transformer2DModel', which no model"):
        from_pretrained(tmp_path)

    ref = packed_class("flux2")(**CONFIGS["flux2"])
    with pytest.raises(CheckpointError, match=r"_class_name 'Flux2Transformer2DModel', not 'FluxTransformer2DModel'"):
        PackedFluxTransformer.from_pretrained(ref.save_pretrained(tmp_path / "flux2"))
    with pytest.raises(ValueError, match="topology 'g4n1' has bags of 4 GPUs but attention has only 2 heads"):
        heads2 = {**CONFIGS["flux2"], "num_attention_heads": 2, "attention_head_dim": 8}
        PackedFlux2Transformer(**heads2, topology=build_topology("g4n1"))

    sharded = ref.save_pretrained(tmp_path / "sharded", max_shard_size=20_000)
    index = json.loads((sharded / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    key = next(k for k, v in index["weight_map"].items() if v == shard)
    (sharded / shard).rename(sharded / "moved.safetensors")
    with pytest.raises(FileNotFoundError, match=f"maps '{key}' to {shard}, which is missing"):
        from_pretrained(sharded)
    (sharded / "moved.safetensors").rename(sharded / shard)

    wider = packed_class("flux2")(**{**CONFIGS["flux2"], "joint_attention_dim": 104})
    wider.save_pretrained(tmp_path / "wider")
    (tmp_path / "wider" / "config.json").write_text((sharded / "config.json").read_text())
    with pytest.raises(
        CheckpointError,
        match=r"safetensors: 'context_embedder.weight' has shape \[48, 104\], the model's is \[48, 100\]",
    ):
        from_pretrained(tmp_path / "wider")

    # A tensor the model lacks, which diffusers' class does not ignore either (FLUX.1 ignores none).
    save_file({"norm_added_q.weight": torch.zeros(3)}, str(sharded / "extra.safetensors"))
    extra = {**index, "weight_map": {**index["weight_map"], "norm_added_q.weight": "extra.safetensors"}}
    (sharded / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(extra))
    with pytest.raises(CheckpointError, match=r"extra\.safetensors holds 'norm_added_q\.weight', which the model does"):
        from_pretrained(sharded)

    index["weight_map"][key] = sorted(set(index["weight_map"].values()))[0]  # the index points at a shard without it
    (sharded / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"lacks '{key}', which the index says it holds"):
        from_pretrained(sharded)


def _balanced_worker(rank: int, world: int) -> dict:
    import deepspeed.comm as dist

    from deepspeed_knap.bench.routing import flux_route_bytes
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.groups import create_process_groups
    from deepspeed_knap.runtime.routing import record_traffic
    from tests.support.balancing import RecordingBalancer, join_gloo

    join_gloo(rank)
    results = {}
    for family in FAMILIES:
        ref = reference_model(family, torch.float64)
        samples = random_samples(family, RANK_SHAPES[rank], 10 + rank, torch.float64)
        weights = output_weights(samples, 20 + rank)
        expected = [diffusers_output(ref, s) for s in samples]
        if samples:
            sum((e * w).sum() for e, w in zip(expected, weights, strict=True)).backward()
        expected_grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}

        # (topology, solver): the three bag sizes; "auto" (a group of its own size per sequence: a priced
        # all-to-all keeps short ones whole, so group sizes mix); "none", under which the empty rank runs
        # no token; None: no balancer at all (each rank alone; the empty rank runs the model on nothing).
        for spec, solver in (
            ("g1n4", "refine"),
            ("g2n2", "refine"),
            ("g4n1", "refine"),
            ("auto", "refine"),
            ("g1n4", "none"),
            (None, None),
        ):
            topology = None if spec is None else build_topology(spec, world, max_degree=4 if spec == "auto" else None)
            balancer = None
            if topology is not None:
                cost_model = CostModel(1.0, 0.05, 0.5 if spec == "auto" else 0.0)
                balancer = RecordingBalancer(create_process_groups(topology), cost_model, solver=solver)
            model = packed_class(family).from_diffusers(ref, attention_backend="sdpa", topology=topology)
            inputs = model.pack(samples)
            with record_traffic() as sent:
                out = model(inputs, balancer)  # [Ti, C]; the empty rank still backpropagates its [0, C]
                (out * (torch.cat(weights) if weights else torch.zeros_like(out))).sum().backward()
            outputs = inputs.split(out)
            out_err = max((relative_error(o, e) for o, e in zip(outputs, expected, strict=True)), default=0.0)
            grad_err = 0.0
            for name, p in model.named_parameters():
                ours, theirs = p.grad.clone(), expected_grads[name].clone()
                dist.all_reduce(ours)
                dist.all_reduce(theirs)
                grad_err = max(grad_err, relative_error(ours, theirs))
            result = {"out_err": out_err, "grad_err": grad_err}
            if balancer is not None:
                plan = balancer.plans[0]
                routed_bytes = torch.tensor([sent["route"] + sent["reverse_route"]])
                dist.all_reduce(routed_bytes)
                text_lens = np.array([shape[3] for shapes in RANK_SHAPES for shape in shapes])
                expected_bytes = flux_route_bytes(plan, text_lens, tiny_dims(family), bytes_per_element=8).after
                result.update(held=int(plan.gpu_tokens[rank]), largest_group=int(plan.seq_group_size.max()),
                              group_sizes=sorted(set(plan.seq_group_size.tolist())),
                              routed_bytes=int(routed_bytes.item()), expected_bytes=expected_bytes)  # fmt: skip
            results[(family, spec, solver)] = result
    return results


def tiny_dims(family: str):
    """The bench's description of what routing a tiny test model moves."""
    from deepspeed_knap.bench.routing import FluxDims

    config = CONFIGS[family]
    conditioning = 2 + config.get("pooled_projection_dim", 0)  # timestep, guidance, pooled text
    axes = len(config["axes_dims_rope"])
    layers = config["num_layers"] + config["num_single_layers"]
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    return FluxDims(dim, config["num_attention_heads"], layers, config["in_channels"],
                    config["joint_attention_dim"], axes, conditioning, {})  # fmt: skip


@pytest.mark.multirank
def test_balanced_on_four_ranks_equals_diffusers_per_sample():
    """Both families over g1n4, g2n2, g4n1 and auto (a rank with no samples among them), and with that rank
    holding no token at all (solver none, and no balancer): outputs and rank-summed gradients equal
    diffusers' per sample. The bytes the route and reverse route send, forward and backward, are
    what ``deepspeed-knap bench routing`` computes (FLUX.1 routes text raw, this FLUX.2 embedded)."""
    results = run_distributed(_balanced_worker, 4, timeout=400)
    for rank, result in enumerate(results):
        for case, measured in result.items():
            assert measured["out_err"] <= 1e-10, (rank, case, measured)
            assert measured["grad_err"] <= 1e-10, (rank, case, measured)
    for family in FAMILIES:
        for spec, bag in (("g1n4", 1), ("g2n2", 2), ("g4n1", 4)):
            assert results[0][(family, spec, "refine")]["largest_group"] == bag, "the plan must split sequences"
        assert results[1][(family, "g1n4", "none")]["held"] == 0, "rank 1 must run no token under solver none"
        assert len(results[0][(family, "auto", "refine")]["group_sizes"]) > 1, "auto must mix group sizes"
        for spec in ("g1n4", "g2n2", "g4n1", "auto"):  # the bench's route formula is what the model really sends
            measured = results[0][(family, spec, "refine")]
            assert measured["routed_bytes"] == measured["expected_bytes"] > 0, (family, spec)


def test_flux2_dev_config_prices_and_fits_flux2_dev():
    """ds_configs/flux2_dev_zero3_4x8.json: its cost model is FLUX.2 [dev]'s FLOP model (the one the
    routing bench uses), its bags fit FLUX.2 [dev]'s heads, and the README's P is the model's."""
    from deepspeed_knap.bench.routing import FLUX_MODELS
    from deepspeed_knap.models.flux.flux2 import PackedFlux2Transformer
    from deepspeed_knap.models.registry import default_cost_model
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.config import get_knapformer_config, load_ds_config

    knap = get_knapformer_config(load_ds_config(str(ROOT / "ds_configs" / "flux2_dev_zero3_4x8.json")))
    ours, flops = knap.cost_model.build(), default_cost_model(FLUX_MODELS["flux2-dev"].planner)
    for coef in ("linear_coef", "quadratic_coef", "alltoall_coef"):
        assert getattr(ours, coef) == pytest.approx(getattr(flops, coef), rel=1e-9)
    with torch.device("meta"):
        model = PackedFlux2Transformer(topology=build_topology(knap.topology, 32, knap.gpus_per_node))
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(32.2e9, rel=1e-3)
