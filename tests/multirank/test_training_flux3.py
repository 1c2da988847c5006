"""Training FLUX.3 on 2 gloo ranks in process (``Trainer``, tests/support/training.py), ZeRO-3,
topology ``auto``, the ``flux3`` cost model (planned by segment): FLUX.3 latent files with and without
references (written with ``save_flux3_sample`` and a manifest).

The tiny FLUX.3 balanced (checkpointed every step, exported) trains to the losses of the same weights
loaded from a diffusers ``Flux3Transformer2DModel`` checkpoint (sharded, partitioned as read) and
trained unbalanced; the export loads in diffusers with the trained tensors; a run resumed from the
step-1 checkpoint continues with the same losses and ends with the same weights. LoRA on synthetic
``flux3_edit`` samples: the adapter loads into diffusers' model with ``load_lora_adapter`` and gives
what peft's LoRA on our model gives. The runs are shared by module-scoped fixtures. Balanced runs on
4 ranks, splitting samples with references over groups of 2 and 4, are tests/multirank/test_flux3.py's.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.training import demo_config, train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

STEPS = 3
TINY = dict(family="flux3", steps=STEPS, lr=1e-3)  # model_path None: the tiny FLUX.3


def config(balanced: bool) -> dict:
    return demo_config(balanced=balanced, topology="auto", cost_model={"model": "flux3"})


def initial_model():
    """The tiny FLUX.3's initial weights (seed 0)."""
    from deepspeed_knap.models.flux3.flux3 import PackedFlux3Transformer
    from deepspeed_knap.models.flux3.spec import TINY_FLUX3

    torch.manual_seed(0)
    return PackedFlux3Transformer(**TINY_FLUX3, attention_backend="sdpa")


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """The data, the initial weights as a diffusers checkpoint, and the balanced (checkpointed,
    exported), unbalanced (loaded from the checkpoint) and resumed runs."""
    from deepspeed_knap.models.flux3.data import save_flux3_sample, synthetic_flux3_samples
    from deepspeed_knap.models.latents import write_latent_manifest
    from deepspeed_knap.models.registry import sample_shapes

    d = tmp_path_factory.mktemp("flux3")
    initial = initial_model()
    reference = diffusers.Flux3Transformer2DModel(**initial.config)
    reference.load_state_dict(initial.state_dict())
    reference.save_pretrained(d / "initial", max_shard_size="50KB")
    shapes = [shape for seed in range(4) for shape in sample_shapes("flux3_edit", 1, seed=seed)[0]]
    samples = synthetic_flux3_samples(shapes[:12], initial.config, seed=0, token_scale=1 / 64)
    (d / "data").mkdir()
    for index, sample in enumerate(samples):
        save_flux3_sample(d / "data" / f"{index:03d}.safetensors", sample)
    write_latent_manifest(d / "data")
    data = dict(data_dir=str(d / "data"), samples_per_rank=2)
    on = train(config(True), **TINY, **data, save_dir=str(d / "ckpt"), checkpoint_every=1,
               export_dir=str(d / "export"))  # fmt: skip
    off = train(config(False), model_path=str(d / "initial"), steps=STEPS, lr=1e-3, **data)
    resumed = train(config(True), **TINY, **data, resume=str(d / "ckpt" / "step1"), export_dir=str(d / "resumed"))
    return d, samples, on, off, resumed


def test_data_mixes_samples_with_and_without_references(full_runs):
    _, samples, *_ = full_runs
    counts = [len(sample.get("image_cond_hidden_states", ())) for sample in samples]
    assert 0 in counts and max(counts) > 0, counts


def test_zero3_balanced_equals_unbalanced_loaded_from_diffusers(full_runs):
    """Every step's plan but the first was solved a step ahead with that step's segments: lengths or
    segments that did not match what the step packed would have it solved in the step instead."""
    _, _, on, off, _ = full_runs
    assert sorted(on.losses) == list(range(STEPS))
    assert list(on.losses.values()) == pytest.approx(list(off.losses.values()), rel=1e-5)
    assert "ZeRO-3 partitioned" in off.stdout  # rank 0's loading report
    assert any(after < before for before, after in on.imbalances()), on.imbalances()
    assert on.planned_ahead() == [False] + [True] * (STEPS - 1), on.stdout[-2000:]


def test_export_loads_in_diffusers_with_the_trained_tensors(full_runs):
    from deepspeed_knap.models.flux3 import PackedFlux3Transformer

    d, *_ = full_runs
    exported = diffusers.Flux3Transformer2DModel.from_pretrained(d / "export").state_dict()
    trained = PackedFlux3Transformer.from_pretrained(d / "export").state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(tensor, exported[name]) for name, tensor in trained.items())
    initial = initial_model().state_dict()
    moved = max((trained[name] - tensor).abs().max().item() for name, tensor in initial.items())
    assert moved > 1e-4, "training must have changed the weights"


def test_resumed_run_continues_with_the_uninterrupted_losses_and_weights(full_runs):
    d, _, on, _, resumed = full_runs
    assert f"--resume: loading checkpoint step1 from {d / 'ckpt'}" in resumed.stdout
    assert resumed.losses == {step: on.losses[step] for step in range(1, STEPS)}
    uninterrupted = diffusers.Flux3Transformer2DModel.from_pretrained(d / "export").state_dict()
    continued = diffusers.Flux3Transformer2DModel.from_pretrained(d / "resumed").state_dict()
    assert all(torch.equal(continued[name], tensor) for name, tensor in uninterrupted.items())


def test_lora_adapter_loads_into_diffusers_flux3_as_peft_lora_on_our_model(tmp_path):
    """Balanced, synthetic flux3_edit samples: the exported adapter loads with diffusers'
    ``Flux3Transformer2DModel.load_lora_adapter`` (every layer of it), which then computes what our
    packed model computes with peft's LoRA holding the same weights, and not the base."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from deepspeed_knap.models.flux3.data import rectified_flow, synthetic_flux3_samples
    from deepspeed_knap.models.lora import ADAPTER_FILE, add_lora
    from deepspeed_knap.models.registry import sample_shapes
    from tests.support.flux3_cases import diffusers_output, relative_error

    run = train(config(True), **TINY, token_scale=1 / 64, lora_rank=4, lora_alpha=8, export_dir=str(tmp_path / "lora"))
    assert sorted(run.losses) == list(range(STEPS))
    adapter = load_file(tmp_path / "lora" / ADAPTER_FILE)
    ours = initial_model()
    layers = sum(name.endswith(target) for name, _ in ours.named_modules() for target in ours.spec.lora_targets)
    assert len(adapter) == 2 * layers  # A and B of every targeted layer
    model = diffusers.Flux3Transformer2DModel(**ours.config)
    model.load_state_dict(ours.state_dict())
    add_lora(ours, rank=4, alpha=8)
    assert not set_peft_model_state_dict(
        ours, {k.removeprefix("transformer."): t for k, t in adapter.items()}
    ).unexpected_keys
    latents = synthetic_flux3_samples(sample_shapes("flux3_edit", 1, seed=5)[0][:3], ours.config, 0, 1 / 64)
    samples, _ = rectified_flow(latents, torch.Generator().manual_seed(0))
    assert any("image_cond_hidden_states" in sample for sample in samples)
    with torch.no_grad():
        before = [diffusers_output(model, sample) for sample in samples]
        model.load_lora_adapter(tmp_path / "lora", prefix="transformer", weight_name=ADAPTER_FILE)
        after = [diffusers_output(model, sample) for sample in samples]
        expected = ours.forward_samples(samples)
    assert max(relative_error(a, e) for a, e in zip(after, expected, strict=True)) < 1e-5
    assert min(relative_error(a, b) for a, b in zip(after, before, strict=True)) > 1e-4
