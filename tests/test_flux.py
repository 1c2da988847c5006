"""PackedFluxTransformer against diffusers' own FluxTransformer2DModel, one sample at a time.

The reference is diffusers' code run on each sample alone (batch of one), which is how diffusers
must run samples of different sizes. Our model runs all of a rank's samples packed, unbalanced in one
process and balanced over 4 gloo ranks.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_distributed

diffusers = pytest.importorskip("diffusers")

# Tiny FLUX: 6 heads so that bags of 4 split them unevenly (2, 2, 1, 1).
CONFIG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=8,
              num_attention_heads=6, joint_attention_dim=12, pooled_projection_dim=6, guidance_embeds=True,
              axes_dims_rope=(2, 2, 4))  # fmt: skip

# (frames, height, width, text tokens): images of several sizes, a video, a sample without text.
SHAPES = [(1, 3, 4, 5), (1, 2, 2, 0), (3, 2, 3, 7), (1, 5, 5, 3), (1, 1, 1, 2)]

# Per rank of 4: uneven, one rank empty, a long sample that balancing splits.
RANK_SHAPES = [[(1, 6, 7, 4), (1, 1, 2, 1)], [], [(2, 3, 3, 6), (1, 2, 2, 0), (1, 1, 3, 2)], [(1, 3, 2, 5)]]


def reference_model(dtype: torch.dtype, guidance: bool = True, seed: int = 0):
    """diffusers' model with weights large enough that every path matters (its init zeroes none here)."""
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(**{**CONFIG, "guidance_embeds": guidance}).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def random_samples(shapes, seed: int, dtype: torch.dtype, guidance: bool = True) -> list[dict]:
    from deepspeed_knap.models.flux import latent_ids

    g = torch.Generator().manual_seed(seed)
    samples = []
    for frames, height, width, text in shapes:
        sample = {
            "hidden_states": torch.randn(frames * height * width, CONFIG["in_channels"], generator=g, dtype=dtype),
            "encoder_hidden_states": torch.randn(text, CONFIG["joint_attention_dim"], generator=g, dtype=dtype),
            "pooled_projections": torch.randn(CONFIG["pooled_projection_dim"], generator=g, dtype=dtype),
            "timestep": torch.rand((), generator=g, dtype=dtype),
            "img_ids": latent_ids(frames, height, width),
            "txt_ids": torch.zeros(text, 3),
        }
        if guidance:
            sample["guidance"] = 1 + 3 * torch.rand((), generator=g, dtype=dtype)
        samples.append(sample)
    return samples


def diffusers_output(model, sample: dict) -> torch.Tensor:
    guidance = sample.get("guidance")
    return model(
        hidden_states=sample["hidden_states"][None],
        encoder_hidden_states=sample["encoder_hidden_states"][None],
        pooled_projections=sample["pooled_projections"][None],
        timestep=sample["timestep"].reshape(1),
        guidance=None if guidance is None else guidance.reshape(1),
        img_ids=sample["img_ids"],
        txt_ids=sample["txt_ids"],
    ).sample[0]


def output_weights(samples, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s["hidden_states"].shape, generator=g, dtype=torch.float64) for s in samples]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def test_state_dict_names_and_shapes_equal_diffusers_both_ways():
    from deepspeed_knap.models.flux import PackedFluxTransformer

    ref = reference_model(torch.float32)
    packed = PackedFluxTransformer(**CONFIG)
    ours = {k: tuple(v.shape) for k, v in packed.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert ours == theirs
    ref.load_state_dict(PackedFluxTransformer.from_diffusers(ref).state_dict(), strict=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("guidance", [True, False], ids=["guidance", "no-guidance"])
def test_packed_outputs_and_gradients_equal_diffusers_per_sample(dtype, guidance):
    from deepspeed_knap.models.flux import PackedFluxTransformer

    ref = reference_model(dtype, guidance)
    packed = PackedFluxTransformer.from_diffusers(ref, attention_backend="sdpa")
    samples = random_samples(SHAPES, 1, dtype, guidance)
    weights = output_weights(samples, 2)

    outputs = packed.forward_samples(samples)
    sum((o * w.to(dtype)).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    for sample, output, weight in zip(samples, outputs, weights, strict=True):
        expected = diffusers_output(ref, sample)
        assert output.shape == expected.shape
        assert relative_error(output, expected) <= TOLERANCE[dtype]
        (expected * weight.to(dtype)).sum().backward()  # gradients accumulate over samples, like ours
    ours, theirs = grads(packed), grads(ref)
    for name in theirs:
        assert relative_error(ours[name], theirs[name]) <= TOLERANCE[dtype], name


def test_gradient_checkpointing_changes_nothing():
    from deepspeed_knap.models.flux import PackedFluxTransformer

    ref = reference_model(torch.float64)
    plain = PackedFluxTransformer.from_diffusers(ref, attention_backend="sdpa")
    checkpointed = PackedFluxTransformer.from_diffusers(ref, attention_backend="sdpa", gradient_checkpointing=True)
    samples = random_samples(SHAPES, 3, torch.float64)
    results = []
    for model in (plain, checkpointed):
        outputs = model.forward_samples(samples)
        sum(o.square().sum() for o in outputs).backward()
        results.append((torch.cat(outputs), grads(model)))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert torch.allclose(grad, results[1][1][name], rtol=1e-12, atol=1e-14), name


def test_modulation_gradients_are_exact():
    from deepspeed_knap.models.flux_layers import gate, modulate

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

    from deepspeed_knap.models.flux import latent_ids
    from deepspeed_knap.models.flux_layers import rotary_cos_sin, timestep_features

    ids = latent_ids(3, 5, 7) * 1.5
    for ours, theirs in zip(rotary_cos_sin(ids, (16, 56, 56)), FluxPosEmbed(10000, [16, 56, 56])(ids), strict=True):
        assert torch.equal(ours, theirs)
    t = torch.rand(16, dtype=torch.float64) * 1000
    assert torch.equal(timestep_features(t), get_timestep_embedding(t, 256, True, 0))


def test_export_loads_in_diffusers_and_diffusers_checkpoints_load_here(tmp_path):
    from deepspeed_knap.models.flux import PackedFluxTransformer

    ref = reference_model(torch.float32)
    samples = random_samples(SHAPES[:2], 4, torch.float32)
    expected = [diffusers_output(ref, s) for s in samples]

    exported = PackedFluxTransformer.from_diffusers(ref).save_pretrained(tmp_path / "ours")
    reloaded = diffusers.FluxTransformer2DModel.from_pretrained(exported)
    for sample, want in zip(samples, expected, strict=True):
        assert torch.equal(diffusers_output(reloaded, sample), want)

    ref.save_pretrained(tmp_path / "pipeline" / "transformer")  # a pipeline directory layout
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    for path in (tmp_path / "pipeline", tmp_path / "sharded"):
        model = PackedFluxTransformer.from_pretrained(path, attention_backend="sdpa")
        for output, want in zip(model.forward_samples(samples), expected, strict=True):
            assert relative_error(output, want) <= 1e-5


def test_bad_inputs_name_the_problem(tmp_path):
    from deepspeed_knap.models.flux import PackedFluxTransformer

    model = PackedFluxTransformer(**CONFIG)
    sample = random_samples(SHAPES[:1], 5, torch.float32)[0]
    cases = {
        "sample 0 has no ['guidance'] (this model has guidance_embeds=True": {
            k: v for k, v in sample.items() if k != "guidance"
        },
        "'hidden_states' has shape [12, 5]; expected [12, 8]": {**sample, "hidden_states": torch.zeros(12, 5)},
        "'img_ids' has shape [11, 3]; expected [12, 3]": {**sample, "img_ids": torch.zeros(11, 3)},
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
            model.pack([bad])
    unguided = PackedFluxTransformer(**{**CONFIG, "guidance_embeds": False})
    with pytest.raises(ValueError, match="has a guidance value but this model has guidance_embeds=False"):
        unguided.pack([sample])
    with pytest.raises(ValueError, match="must sum to attention_head_dim=8"):
        PackedFluxTransformer(**{**CONFIG, "axes_dims_rope": (2, 2, 2)})
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "ip_adapter_layers": 3}))
    with pytest.raises(ValueError, match=r"config keys \['ip_adapter_layers'\]"):
        PackedFluxTransformer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        PackedFluxTransformer.from_pretrained(tmp_path / "missing")


def _balanced_worker(rank: int, world: int) -> dict:
    import deepspeed.comm as dist

    from deepspeed_knap.balancer import KnapBalancer
    from deepspeed_knap.models.flux import PackedFluxTransformer
    from deepspeed_knap.topology import build_topology, create_process_groups

    class RecordingBalancer(KnapBalancer):
        def plan(self, batch):
            self.plans = [*getattr(self, "plans", []), super().plan(batch)]
            return self.plans[-1]

    from deepspeed_knap.workload import WorkloadModel

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    ref = reference_model(torch.float64)
    samples = random_samples(RANK_SHAPES[rank], 10 + rank, torch.float64)
    weights = output_weights(samples, 20 + rank)
    expected = [diffusers_output(ref, s) for s in samples]
    if samples:
        sum((e * w).sum() for e, w in zip(expected, weights, strict=True)).backward()
    expected_grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in ref.named_parameters()}

    results = {}
    for spec in ("g1n4", "g2n2", "g4n1"):
        topology = build_topology(spec, world)
        balancer = RecordingBalancer(create_process_groups(topology), WorkloadModel(1.0, 0.05, 0.0), solver="refine")
        model = PackedFluxTransformer.from_diffusers(ref, attention_backend="sdpa", topology=topology)
        inputs = model.pack(samples)
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
        results[spec] = {
            "out_err": out_err,
            "grad_err": grad_err,
            "largest_group": int(balancer.plans[0].seq_group_size.max()),
        }
    return results


def test_balanced_on_four_ranks_equals_diffusers_per_sample():
    results = run_distributed(_balanced_worker, 4, timeout=300)
    for rank, result in enumerate(results):
        for spec, measured in result.items():
            assert measured["out_err"] <= 1e-10, (rank, spec, measured)
            assert measured["grad_err"] <= 1e-10, (rank, spec, measured)
    for spec, bag in (("g1n4", 1), ("g2n2", 2), ("g4n1", 4)):
        assert results[0][spec]["largest_group"] == bag, "the plan must really split sequences over the bags"
