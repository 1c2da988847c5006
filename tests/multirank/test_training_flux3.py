"""Training FLUX.3 on 2 gloo ranks in process (``Trainer``, tests/support/training.py), ZeRO-3,
topology ``auto``, the ``flux3`` cost model (planned by segment): FLUX.3 latent files with and without
references (written with ``save_flux3_sample`` and a manifest), and images prepared by
examples/prepare_flux3_latents.py.

The tiny FLUX.3 balanced (checkpointed every step, exported) trains to the losses of the same weights
loaded from a diffusers ``Flux3Transformer2DModel`` checkpoint (sharded, partitioned as read) and
trained unbalanced; the export loads in diffusers with the trained tensors; a run resumed from the
step-1 checkpoint continues with the same losses and ends with the same weights. LoRA on synthetic
``flux3_edit`` samples: the adapter loads into diffusers' model with ``load_lora_adapter`` and gives
what peft's LoRA on our model gives. A tiny FLUX.3 modular pipeline folder this test saves, images
with captions and an edit with a reference prepared by the script (the samples are what generation
conditions on), trained with LoRA from the folder, rendering validation images (text to image and
the edit) through the modular pipeline with the adapter it loads. The runs are shared by
module-scoped fixtures. Balanced runs on 4 ranks, splitting samples with references over groups of 2
and 4, are tests/multirank/test_flux3.py's.
"""

from __future__ import annotations

import json
import runpy
import sys

import numpy as np
import pytest
import torch

from tests.support.training import ROOT, demo_config, train

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


# Prepared from images (tiny FLUX.3: a 2x VAE and 2x2 patches, 4x4 px a token) at --resolution 64,
# (height, width) px: targets of their own sizes (12x16, 16x8 and 16x16 tokens), and an edit whose
# target is 64x64 px (taken as it is) with one 48x80 px reference (kept whole on its 64x80 canvas).
IMAGES = {"a_cat.png": (48, 64), "b_dog.png": (64, 32), "c_bird.png": (40, 40), "d_edit.png": (64, 64),
          "d_edit.ref1.png": (48, 80)}  # fmt: skip
CAPTIONS = {"a_cat": "a red cat", "b_dog": "the blue dog", "c_bird": "a green bird", "d_edit": "the same in blue"}
PROMPTS = ["a red cat", "d_edit.ref1.png\tthe same in blue"]  # text to image, and the edit


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny FLUX.3 generator whose parts the folder holds, the folder, the images prepared by the
    script (the tokenizer standing in for Qwen3-VL's processor, which needs torchvision), and a LoRA
    run from the folder on them: 2 steps, balanced, a validation image per prompt after the last."""
    from PIL import Image

    from deepspeed_knap.models.generators import tiny_generator
    from tests.support.flux3_cases import save_flux3_folder, tokenizer_as_processor

    d = tmp_path_factory.mktemp("flux3_prepared")
    generator = tiny_generator("flux3", torch.float32, "cpu", seed=0)
    save_flux3_folder(d / "pipeline", generator)
    inputs = d / "inputs"
    inputs.mkdir()
    for index, (name, (height, width)) in enumerate(IMAGES.items()):
        pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(inputs / name)
    for name, caption in CAPTIONS.items():
        (inputs / f"{name}.txt").write_text(caption)
    script = ROOT / "examples" / "prepare_flux3_latents.py"
    with pytest.MonkeyPatch.context() as monkeypatch:  # in this process: no second interpreter's imports
        tokenizer_as_processor(monkeypatch)
        monkeypatch.setattr(sys, "argv", [str(script), "--pretrained", str(d / "pipeline"), "--inputs", str(inputs),
                                          "--out", str(d / "data"), "--resolution", "64", "--device", "cpu"])  # fmt: skip
        runpy.run_path(str(script), run_name="__main__")
    (inputs / "prompts.txt").write_text("".join(line + "\n" for line in PROMPTS))
    run = train(config(True), model_path=str(d / "pipeline"), data_dir=str(d / "data"), samples_per_rank=2, steps=2,
                lr=1e-2, lora_rank=4, lora_alpha=8, export_dir=str(d / "lora"), validation_every=2,
                validation_prompts=str(inputs / "prompts.txt"), validation_dir=str(d / "images"),
                validation_inference_steps=2, validation_resolution=32, setup=tokenizer_as_processor)  # fmt: skip
    return d, generator, run


def test_prepared_samples_are_what_generation_conditions_on(prepared):
    """The edit's caption, reference and ids are what ``Flux3Generator.start`` packs for that edit
    (guidance 1: one branch); its target's latents are what it packs for the target image as a
    reference (64x64 px is its own canvas: nothing resized or padded either way), normalised as the
    pipeline's decode undoes."""
    from safetensors.torch import load_file

    from deepspeed_knap.generation.requests import parse_request
    from deepspeed_knap.models.flux3.data import flux3_image_ids
    from deepspeed_knap.runtime.manifest import MANIFEST

    d, generator, _ = prepared
    files = sorted((d / "data").glob("*.safetensors"))
    assert len(files) == len(CAPTIONS) and (d / "data" / MANIFEST).is_file()
    samples = [load_file(file) for file in files]
    assert [len(s["latents"]) for s in samples] == [12 * 16, 16 * 8, 16 * 16, 16 * 16]
    assert [len(s.get("image_cond_hidden_states", ())) for s in samples] == [0, 0, 0, 16 * 20]
    edit = samples[3]
    assert torch.equal(edit["img_ids"], flux3_image_ids(16, 16))

    def packed(**fields):
        request = parse_request(
            0, 1, json.dumps({"guidance": 1.0, "height": 64, "width": 64, **fields}), d / "inputs", default_steps=28
        )
        (branch,) = generator.start(request).branches
        return branch

    branch = packed(prompt=CAPTIONS["d_edit"], image="d_edit.ref1.png")
    for key in ("encoder_hidden_states", "txt_ids", "image_cond_hidden_states", "image_cond_ids", "img_ids"):
        assert torch.equal(edit[key], branch[key]), key
    assert torch.equal(edit["latents"], packed(prompt="x", image="d_edit.png")["image_cond_hidden_states"])


def test_lora_from_a_modular_folder_on_prepared_images_renders_validation_through_the_pipeline(prepared):
    """Balanced LoRA from the folder (ZeRO-3 partitioned) on the prepared samples; after the last step
    rank 0 renders each prompt (text to image, and the edit of its reference) through the modular
    pipeline: the text one is what the folder's pipeline draws with the exported adapter loaded by
    ``load_lora_weights`` (seed 0, guidance 3.5, 2 steps, 32x32 px), not what it draws without."""
    from PIL import Image

    from deepspeed_knap.models.flux3.generate import load_flux3_pipeline
    from tests.support.flux3_cases import tokenizer_as_processor

    d, _, run = prepared
    assert sorted(run.losses) == [0, 1] and all(np.isfinite(list(run.losses.values())))
    assert any(after < before for before, after in run.imbalances()), run.imbalances()
    assert "ZeRO-3 partitioned" in run.stdout  # rank 0's loading report of the folder's transformer
    images = [d / "images" / f"step000002_prompt{index:02d}.png" for index in range(len(PROMPTS))]
    assert [Image.open(image).size for image in images] == [(32, 32)] * len(PROMPTS)
    assert f"validation image {images[1]} after step 1: 'the same in blue'" in run.stdout
    with pytest.MonkeyPatch.context() as monkeypatch:
        tokenizer_as_processor(monkeypatch)
        pipe = load_flux3_pipeline(d / "pipeline", torch.float32, "cpu")
    pipe.update_components(transformer=diffusers.Flux3Transformer2DModel.from_pretrained(d / "pipeline",
                                                                                         subfolder="transformer"))  # fmt: skip

    def drawn() -> np.ndarray:
        return np.asarray(pipe(prompt=PROMPTS[0], height=32, width=32, num_inference_steps=2, output="images",
                               generator=torch.Generator().manual_seed(0))[0])  # fmt: skip

    base = drawn()
    pipe.load_lora_weights(d / "lora")
    written = np.asarray(Image.open(images[0]))
    # The same floats computed on other threads may round to another PNG level here and there; the
    # adapter (2 steps at lr 1e-2) moves many pixels of the tiny pipeline's image by a level or so.
    assert np.mean(written != drawn()) < 0.01
    assert np.mean(written != base) > 0.05
