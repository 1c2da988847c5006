"""Training FLUX.1 and FLUX.2 on 2 gloo ranks in process (``Trainer``, tests/support/training.py),
topology ``auto`` (groups of 1 and 2 GPUs).

Full fine-tuning: ZeRO-3 with balancing on gives the losses of balancing off, the exported weights
load into diffusers, and a run resumed from its save directory takes the newest complete checkpoint
(saying why it skipped a partial and a damaged newer one), continues with the uninterrupted run's
losses and ends with its weights; a tag with a shard deleted or truncated, or without its manifest,
is one error on every rank naming the file and the tag, and so is a shard replaced by a pickle that
would run code (which never runs) or another model's checkpoint. LoRA: ZeRO-3 balanced (under the host-tensor
check) equals ZeRO-2 unbalanced, the exported adapter loads into diffusers' FluxPipeline with
load_lora_weights and gives what peft's LoRA on our model gives, and validation images are written.
Real-image data: examples/prepare_flux_latents.py encodes a folder of mixed-size captioned images with
tiny local encoders and writes their manifest, the files train, and a file holding a NaN and a file
changed after the manifest are named by every rank. FLUX.2: balanced from ``tiny`` equals unbalanced
from the same weights loaded from a checkpoint, and its exports (16-bit, and DeepSpeed's
``zero_to_fp32``) load in diffusers. The runs are shared by module-scoped fixtures; the damaged
checkpoints are copies of one of their tags. The example's command line over the trainer (its
launch, its one-line errors) is tests/e2e/test_train_flux.py's.
"""

import functools
import json
import shutil

import pytest
import torch

from tests.support.training import demo_config, run_example, train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("transformers")

COMMON = dict(token_scale=1 / 64, steps=3, lr=1e-3)  # the tiny FLUX.1 (family "flux", model_path None)
LORA = dict(lora_rank=4, lora_alpha=8)
SHARD = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"  # rank r's ZeRO-3 optimizer shard


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """Full fine-tuning, balancing off, and on with a checkpoint after every step, an export and a
    validation render."""
    d = tmp_path_factory.mktemp("full")
    (d / "prompts.txt").write_text("a red cat\n")
    off = train(demo_config(balanced=False), **COMMON, gradient_checkpointing=True)
    on = train(demo_config(), **COMMON, gradient_checkpointing=True, save_dir=str(d / "ckpt"), checkpoint_every=1,
               export_dir=str(d / "export"), validation_every=3, validation_prompts=str(d / "prompts.txt"),
               validation_dir=str(d / "new" / "images"))  # fmt: skip
    return d, off, on


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """LoRA: ZeRO-3 balanced (under the host-tensor check, writing validation images) and ZeRO-2
    unbalanced, both exporting the adapter."""
    d = tmp_path_factory.mktemp("lora")
    (d / "prompts.txt").write_text("a red cat\n\na blue dog on grass\n")
    on = train(demo_config(), **COMMON, **LORA, export_dir=str(d / "on"), validation_every=3,
               validation_prompts=str(d / "prompts.txt"), validation_dir=str(d / "images"), host_tensors=True)  # fmt: skip
    off = train(demo_config(balanced=False, stage=2), **COMMON, **LORA, export_dir=str(d / "off"),
                save_dir=str(d / "ckpt"))  # fmt: skip
    return d, on, off


def test_zero3_balanced_training_matches_unbalanced_and_exports_to_diffusers(full_runs):
    d, off, on = full_runs
    assert sorted(on.losses) == [0, 1, 2]
    # Every step's plan but the first was solved during the step before (balancer.prefetch).
    assert on.planned_ahead() == [False, True, True], on.stdout[-2000:]
    assert list(on.losses.values()) == pytest.approx(list(off.losses.values()), rel=1e-5)
    # Full fine-tuning renders too, into a directory the trainer makes (LoRA's adapter save made it before).
    assert [p.name for p in (d / "new" / "images").iterdir()] == ["step000003_prompt00.png"]

    from deepspeed_knap.models.flux import PackedFluxTransformer

    exported = diffusers.FluxTransformer2DModel.from_pretrained(d / "export")
    ours = PackedFluxTransformer.from_pretrained(d / "export", attention_backend="sdpa")
    config = json.loads((d / "export" / "config.json").read_text())
    torch.manual_seed(0)  # the trainer's initial weights: training must have changed them
    initial = PackedFluxTransformer(**{key: value for key, value in config.items() if not key.startswith("_")})
    moved = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), initial.parameters(), strict=True))
    assert moved > 1e-4
    theirs = exported.state_dict()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in ours.state_dict().items())


def test_resumed_run_continues_with_the_uninterrupted_losses_and_weights(full_runs):
    """The balanced ZeRO-3 run saved a checkpoint after every step, each with its manifest; resumed
    from the save directory where the newer two are a partial save (no manifest) and a damaged one (a
    shard deleted), the run takes step1 (as if killed after step 0), says why it skipped the others,
    prints the same later losses and ends with the same weights."""
    from deepspeed_knap.runtime.manifest import MANIFEST, read_manifest

    d, _, on = full_runs
    assert sorted(p.name for p in (d / "ckpt").glob("step*")) == ["step1", "step2", "step3"]
    assert (d / "ckpt" / "latest").read_text() == "step3"
    manifest = read_manifest(d / "ckpt" / "step3")
    assert manifest["metadata"] == {
        "step": 3,
        "data_position": 6,
        "lora_alpha": None,
        "expert": None,
        "data_order": None,
        "data_files": None,
    }
    assert sorted(manifest["files"]) == [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
                                         for r in (0, 1) for kind in ("model", "optim")]  # fmt: skip
    for tag in ("step1", "step2", "step3"):
        shutil.copytree(d / "ckpt" / tag, d / "mixed" / tag)
    (d / "mixed" / "latest").write_text("step3")
    (d / "mixed" / "step2" / MANIFEST).unlink()
    (d / "mixed" / "step3" / SHARD.format(1)).unlink()
    resumed = train(demo_config(), **COMMON, gradient_checkpointing=True, resume=str(d / "mixed"),
                    export_dir=str(d / "resumed"))  # fmt: skip
    assert (
        f"--resume: skipped checkpoint step2: partial: no {MANIFEST} (its save did not finish)\n"
        f"--resume: skipped checkpoint step3: {SHARD.format(1)} is missing on rank 1, which loads it\n"
        f"--resume: loading checkpoint step1 from {d / 'mixed'}, the newest complete one\n"
    ) in resumed.stdout
    assert resumed.losses == {step: on.losses[step] for step in (1, 2)}
    assert resumed.planned_ahead() == [False, True], resumed.stdout[-2000:]

    from safetensors.torch import load_file

    uninterrupted, continued = (
        load_file(d / name / "diffusion_pytorch_model.safetensors") for name in ("export", "resumed")
    )
    assert uninterrupted.keys() == continued.keys()
    assert all(torch.equal(continued[name], tensor) for name, tensor in uninterrupted.items())


@pytest.mark.parametrize("damage", ["shards deleted and truncated", "partial tag"])
def test_a_damaged_or_partial_checkpoint_is_one_error_on_every_rank_naming_the_file(full_runs, damage):
    """A copy of the balanced run's step1, damaged, given to resume: every rank raises the same error
    naming the tag and each file, before DeepSpeed reads anything. One run shows a deleted and a
    truncated shard, each named (tests/multirank/test_checkpoint_manifest.py checks each damage
    alone)."""
    from deepspeed_knap.runtime.manifest import MANIFEST

    d, *_ = full_runs
    tag = shutil.copytree(d / "ckpt" / "step1", d / damage.replace(" ", "_") / "step1")
    if damage == "partial tag":
        (tag / MANIFEST).unlink()
        expected = f"checkpoint {tag} is partial: no {MANIFEST} (its save did not finish), which a save writes"
    else:
        (tag / SHARD.format(1)).unlink()
        size = (tag / SHARD.format(0)).stat().st_size
        with open(tag / SHARD.format(0), "r+b") as handle:
            handle.truncate(size // 2)
        expected = (f"cannot load checkpoint {tag}: {SHARD.format(0)} is {size // 2:,} bytes on every rank, the "
                    f"manifest says {size:,} (truncated, or written by another save); {SHARD.format(1)} is missing "
                    "on rank 1, which loads it; restore the files, or load another tag")  # fmt: skip
    damaged = train(demo_config(balanced=False), **COMMON, resume=str(tag), fails=True)
    assert damaged.errors[0].startswith(f"--resume {tag}: {expected}"), damaged.errors[0]
    assert damaged.losses == {} and damaged.step_lines() == []


class _Payload:
    """Unpickling it creates the file ``marker``: a stand-in for any code a crafted pickle runs."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize("case", ["crafted shard", "lora", "wan", "no step"])
def test_a_crafted_shard_or_another_models_checkpoint_is_one_error_on_every_rank(full_runs, case):
    """A copy of the balanced run's step1 given to resume: with rank 1's optimizer shard replaced by a
    pickle that would run code, and the manifest written again to match (a manifest proves files
    unchanged, not who wrote them), the pickle never runs and every rank names the file; resumed with
    LoRA adapters, or as a Wan model, every rank says the checkpoint is another model's, before
    DeepSpeed reads it. A checkpoint whose rank 1 file holds no step (not this trainer's; under
    ZeRO-3 each rank reads its own) is one error on every rank (it was a KeyError on rank 1 alone)."""
    from deepspeed_knap.runtime.manifest import build_manifest, write_manifest

    d, *_ = full_runs
    name = case.replace(" ", "_")
    tag = shutil.copytree(d / "ckpt" / "step1", d / name / "step1")
    marker, extra = d / name / "payload-ran", {}
    if case == "crafted shard":
        torch.save({"optimizer_state_dict": _Payload(str(marker))}, tag / SHARD.format(1))
        write_manifest(tag, build_manifest(tag, metadata={"step": 1, "data_position": 2}))
        expected = (f"checking checkpoint {tag} before loading it failed:\nrank(s) [1]: {tag / SHARD.format(1)} was "
                    "not loaded: it holds the global io.open, which no DeepSpeed checkpoint holds (loading it would "
                    "run code from the checkpoint folder); restore the file the save wrote, or load another tag")  # fmt: skip
    elif case == "lora":
        extra = LORA
        expected = (f"checking checkpoint {tag} before loading it failed:\nrank(s) [0, 1]: checkpoint {tag} was "
                    "saved without LoRA adapters and this PackedFluxTransformer (family 'flux') has them (e.g. "
                    "'single_transformer_blocks.0.attn.to_k.lora_A.default.weight'): resume without LoRA, as the run "
                    "that saved it (train_dit.py: no --lora-rank)")  # fmt: skip
    elif case == "no step":
        model_states = tag / "zero_pp_rank_1_mp_rank_00_model_states.pt"
        state = torch.load(model_states, weights_only=True)
        del state["step"]
        torch.save(state, model_states)
        write_manifest(tag, build_manifest(tag, metadata={"step": 1, "data_position": 2}))
        expected = (f"rank(s) [1]: --resume {tag}: checkpoint step1 holds no training position (step None, "
                    "data_position 2): it was not saved by this trainer")  # fmt: skip
    else:
        extra = dict(family="wan")
        expected = (f"checking checkpoint {tag} before loading it failed:\nrank(s) [0, 1]: checkpoint {tag} was "
                    "saved from another model: ")  # fmt: skip
    resumed = train(demo_config(balanced=False), **{**COMMON, **extra}, resume=str(tag), fails=True)
    if case == "no step":
        assert expected in resumed.errors[0], resumed.errors[0]
    else:
        assert resumed.errors[0].startswith(f"--resume {tag}: {expected}"), resumed.errors[0]
    assert resumed.losses == {} and not marker.exists()


def test_lora_balanced_on_zero3_equals_unbalanced_on_zero2_and_writes_validation_images(lora_runs):
    d, on, off = lora_runs
    assert sorted(on.losses) == [0, 1, 2]
    assert on.planned_ahead() == [False, True, True], on.stdout[-2000:]
    assert list(on.losses.values()) == pytest.approx(list(off.losses.values()), rel=1e-5)

    from safetensors.torch import load_file

    from deepspeed_knap.models.lora import ADAPTER_FILE
    from tests.support.flux_cases import relative_error

    balanced, unbalanced = load_file(d / "on" / ADAPTER_FILE), load_file(d / "off" / ADAPTER_FILE)
    assert (
        balanced.keys() == unbalanced.keys() and len(balanced) == (2 * 12 + 2 * 3) * 2
    )  # A, B of 12 layers per double block, 3 per single
    # Adam divides each gradient by its own running scale, so fp32 rounding in the small gradients
    # of the adapters (summed in another order when balanced) shows at ~1e-3 of the weights here.
    assert max(relative_error(balanced[k], unbalanced[k]) for k in balanced) < 3e-3

    from PIL import Image

    images = sorted((d / "images").glob("*.png"))
    assert [p.name for p in images] == ["step000003_prompt00.png", "step000003_prompt01.png"]
    assert all(Image.open(p).size == (32, 32) for p in images)
    assert f"validation image {images[1]} after step 2: 'a blue dog on grass'" in on.stdout


def test_resuming_lora_adapters_with_another_alpha_is_one_error_on_every_rank(lora_runs):
    """The adapters' scale is alpha / rank, and the weights do not hold it: resumed with another
    --lora-alpha, the run trained on at another scale, silently."""
    d, _, _ = lora_runs
    resumed = train(demo_config(balanced=False, stage=2), **{**COMMON, **LORA, "lora_alpha": 16},
                    resume=str(d / "ckpt"), fails=True)  # fmt: skip
    assert "was trained with LoRA alpha 8.0 and this run has 16.0" in resumed.errors[0], resumed.errors[0]
    assert "resume with --lora-alpha 8.0" in resumed.errors[0] and resumed.losses == {}


def test_exported_adapter_loads_into_diffusers_pipeline_as_peft_lora_on_our_model(lora_runs):
    """diffusers' FluxPipeline.load_lora_weights reads the adapter; its transformer then computes
    what our packed model computes with peft's LoRA holding the same weights, and not the base."""
    d, _, _ = lora_runs
    from diffusers import FluxPipeline
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from deepspeed_knap.data.mixes import SampleShape
    from deepspeed_knap.models.flux import PackedFluxTransformer
    from deepspeed_knap.models.flux.data import rectified_flow, synthetic_samples
    from deepspeed_knap.models.flux.finetune import tiny_pipeline_components
    from deepspeed_knap.models.flux.spec import TINY_FLUX
    from deepspeed_knap.models.lora import ADAPTER_FILE, add_lora
    from tests.support.flux_cases import diffusers_output, relative_error

    torch.manual_seed(0)  # the trainer's base weights, which LoRA training leaves frozen
    base = PackedFluxTransformer(**TINY_FLUX, attention_backend="sdpa")
    pipe = FluxPipeline(
        **tiny_pipeline_components(TINY_FLUX),
        transformer=PackedFluxTransformer.diffusers_model(TINY_FLUX, base.state_dict()),
    )
    latents = synthetic_samples([SampleShape(text=5, visual=12, frames=1)], TINY_FLUX, seed=3)
    (sample,), _ = rectified_flow(latents, torch.Generator().manual_seed(0), guidance=2.0)
    with torch.no_grad():
        before = diffusers_output(pipe.transformer, sample)
        pipe.load_lora_weights(d / "on")
        after = diffusers_output(pipe.transformer, sample)

        ours = PackedFluxTransformer(**TINY_FLUX, attention_backend="sdpa")
        ours.load_state_dict(base.state_dict())
        add_lora(ours, rank=4, alpha=8)
        adapter = {name.removeprefix("transformer."): t for name, t in load_file(d / "on" / ADAPTER_FILE).items()}
        assert not set_peft_model_state_dict(ours, adapter).unexpected_keys
        expected = ours.forward_samples([sample])[0]
    assert relative_error(after, expected) < 1e-5
    assert relative_error(after, before) > 1e-4


def test_image_folder_encodes_trains_and_a_nan_file_is_named_on_every_rank(tmp_path):
    from diffusers import FluxPipeline
    from PIL import Image
    from safetensors.torch import load_file

    from deepspeed_knap.models.flux.data import save_latent_sample
    from deepspeed_knap.models.flux.finetune import tiny_pipeline_components
    from deepspeed_knap.models.flux.spec import TINY_FLUX
    from deepspeed_knap.models.latents import write_latent_manifest
    from deepspeed_knap.runtime.manifest import read_manifest, verify_files

    FluxPipeline(**tiny_pipeline_components(TINY_FLUX), transformer=None).save_pretrained(tmp_path / "pipeline")
    sizes = {"wide": (40, 24), "tall": (24, 36), "square": (32, 32), "panorama": (64, 16)}  # width, height
    generator = torch.Generator().manual_seed(0)
    for name, (width, height) in sizes.items():
        pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text(f"a {name} photo\n")
    run_example("prepare_flux_latents.py", "--images", str(tmp_path), "--pipeline", str(tmp_path / "pipeline"),
                "--out", str(tmp_path / "data"), "--resolution", "32", "--max-sequence-length", "8")  # fmt: skip
    # Longer side to 32 px, each side a multiple of 4 px (the VAE's 2x, then 2x2 patches): every
    # image keeps its aspect ratio, one latent token per 4x4 px.
    expected = {"panorama": (32, 8), "square": (32, 32), "tall": (20, 32), "wide": (32, 20)}
    files = sorted((tmp_path / "data").glob("*.safetensors"))
    assert sorted(read_manifest(tmp_path / "data")["files"]) == [file.name for file in files]
    assert verify_files(tmp_path / "data", read_manifest(tmp_path / "data")) == []
    for file, (width, height) in zip(files, (expected[name] for name in sorted(sizes)), strict=True):
        sample = load_file(file)
        assert sample["latents"].shape == (width // 4 * (height // 4), 16)
        assert sample["img_ids"][:, 1].max() == height // 4 - 1 and sample["img_ids"][:, 2].max() == width // 4 - 1
        assert sample["encoder_hidden_states"].shape == (8, 32) and sample["pooled_projections"].shape == (16,)

    run_example("prepare_flux_latents.py", "--synthetic", "kf_mixed_res", "--count", "1", "--token-scale", "0.015625",
                "--in-channels", "16", "--joint-attention-dim", "32", "--pooled-projection-dim", "16",
                "--out", str(tmp_path / "synthetic"))  # fmt: skip
    poisoned = load_file(tmp_path / "synthetic" / "00000000.safetensors")
    poisoned["latents"][0, 0] = float("nan")
    # Two ranks read files 0 and 1 at step 0, then 2 and 3, then 4 and 5 (in name order): the poisoned
    # file is rank 0's at step 1, and the file changed after the manifest is rank 1's at step 2, read
    # during step 1.
    data = tmp_path / "data"
    save_latent_sample(data / "00000002.safetensors", poisoned)
    for source, copy in ((0, 4), (1, 5)):
        shutil.copy(data / f"0000000{source}.safetensors", data / f"0000000{copy}.safetensors")
    write_latent_manifest(data)  # as prepared: a NaN made by the encoder, not a changed copy
    changed = load_file(data / "00000005.safetensors")
    save_latent_sample(data / "00000005.safetensors", {key: 2 * t for key, t in changed.items()})

    run = train(demo_config(), data_dir=str(data), shuffle_data=False, steps=3, fails=True)
    steps = run.step_lines()
    assert [int(step) for step, *_ in steps] == [0] and float(steps[0][1]) > 0, run.stdout[-2000:]
    # One error, the same on both ranks, naming each rank's finding: the NaN, and the changed file
    # (refused before it trains, on the all-reduce of the step before).
    error = run.errors[0]
    assert error.startswith("train_dit failed:"), error
    assert f"rank(s) [0]: non-finite loss at step 1 in ['{data / '00000002.safetensors'}']" in error
    assert f"rank(s) [1]: step 2's data: {data / '00000005.safetensors'}: sha256 " in error


def test_zero3_flux2_balanced_equals_unbalanced_loaded_and_exports_to_diffusers(tmp_path):
    """The tiny FLUX.2 balanced trains to the losses of the same weights loaded from a checkpoint
    (partitioned as read) and trained unbalanced; the 16-bit export loads in diffusers'
    ``Flux2Transformer2DModel``, and DeepSpeed's ``zero_to_fp32`` recovers the same weights from the
    saved checkpoint. The packed FLUX.2 balanced over 4 gloo ranks against diffusers is
    tests/unit/test_flux.py's."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from deepspeed_knap.models.flux.flux2 import PackedFlux2Transformer
    from deepspeed_knap.models.flux.spec import TINY_FLUX2

    torch.manual_seed(0)  # the tiny model's initial weights (seed 0)
    initial = PackedFlux2Transformer(**TINY_FLUX2)
    checkpoint = initial.save_pretrained(tmp_path / "initial", max_shard_size=50_000)

    flux2 = dict(mix="flux2_edit", token_scale=1 / 64, steps=3, lr=1e-3)
    on = train(demo_config(), **flux2, family="flux2", export_dir=str(tmp_path / "export"),
               save_dir=str(tmp_path / "ckpt"))  # fmt: skip
    off = train(demo_config(balanced=False), **flux2, model_path=str(checkpoint))
    assert len(on.losses) == 3
    assert list(on.losses.values()) == pytest.approx(list(off.losses.values()), rel=1e-5)
    assert "ZeRO-3 partitioned" in off.stdout  # rank 0's loading report

    exported = diffusers.Flux2Transformer2DModel.from_pretrained(tmp_path / "export").state_dict()
    trained = PackedFlux2Transformer.from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(tensor, exported[name]) for name, tensor in trained.items())
    moved = max((trained[name] - tensor).abs().max().item() for name, tensor in initial.state_dict().items())
    assert moved > 1e-4, "training must have changed the weights"
    masters = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))  # the README's fp32 export
    with torch.device("meta"):
        shell = PackedFlux2Transformer(**TINY_FLUX2)
    shell.save_pretrained(tmp_path / "fp32", state_dict=masters)
    from_masters = diffusers.Flux2Transformer2DModel.from_pretrained(tmp_path / "fp32").state_dict()
    assert from_masters.keys() == trained.keys()
    assert all(torch.equal(from_masters[name], tensor) for name, tensor in trained.items())


@pytest.mark.parametrize("family", ["flux", "flux2"])
def test_a_lora_adapter_of_either_family_loads_into_diffusers_own_model(family, tmp_path):
    """The default targets adapt the family's layers (FLUX.2's ``attn.to_out`` is a linear layer in
    single blocks and a list in double blocks), and the exported adapter, loaded by diffusers into
    its own transformer, gives the packed model's output. (One process: no ranks.)"""
    from deepspeed_knap.models.lora import ADAPTER_FILE, adapter_state_dict, add_lora, lora_config, save_adapter
    from tests.support.flux_cases import diffusers_output, packed_class, random_samples, reference_model, relative_error

    reference = reference_model(family, torch.float32)
    ours = packed_class(family).from_diffusers(reference, attention_backend="sdpa")
    linear = {name for name, m in ours.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {name for name in linear if any(name.endswith(f".{t}") for t in ours.spec.lora_targets)}
    add_lora(ours, rank=4, alpha=8)
    adapted = {name.removesuffix(".lora_A") for name, _ in ours.named_modules() if name.endswith(".lora_A")}
    assert adapted == expected and any("single_transformer_blocks" in name for name in adapted)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.3)  # B starts at zero: make the adapter change the output
    path = save_adapter(tmp_path, adapter_state_dict(ours, ours.state_dict()), lora_config(ours), ours.spec.lora_loader)
    samples = random_samples(family, [(1, 3, 4, 5), (1, 2, 2, 3)], seed=1, dtype=torch.float32)
    with torch.no_grad():
        before = [diffusers_output(reference, sample) for sample in samples]
        reference.load_lora_adapter(str(path.parent), weight_name=ADAPTER_FILE, prefix="transformer")
        after = [diffusers_output(reference, sample) for sample in samples]
        packed = ours.forward_samples(samples)
    for theirs, mine, plain in zip(after, packed, before, strict=True):
        assert relative_error(mine, theirs) < 1e-5 and relative_error(theirs, plain) > 1e-3


def _rank_1_cannot_write(save_dir: str) -> None:
    """Rank 1's optimizer shard of tag step1 cannot be written: a folder stands at its path (torch.save
    raises the RuntimeError it raises for a full disk), put there as DeepSpeed writes it (before, the
    save's clearing of the tag would remove it)."""
    import os
    from pathlib import Path

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if os.environ["RANK"] != "1":
        return
    save = TorchCheckpointEngine.save

    def save_into_a_folder(self, state_dict, path):
        if Path(path) == Path(save_dir) / "step1" / SHARD.format(1):
            Path(path).mkdir(parents=True)
        return save(self, state_dict, path)

    TorchCheckpointEngine.save = save_into_a_folder


def test_accumulation_an_export_or_a_checkpoint_a_rank_cannot_write_are_one_error_on_every_rank(tmp_path):
    """A DeepSpeed config that accumulates gradients is refused at start-up (the loop steps the
    optimizer every step: steps, checkpoints and --resume would count micro-steps). An export that
    fails on rank 0, which writes it, fails every rank (the others went on, to wait elsewhere); so
    does a checkpoint file rank 1 cannot write (the others waited in DeepSpeed's save)."""
    accumulating = train({**demo_config(balanced=False, stage=2), "gradient_accumulation_steps": 2}, **COMMON,
                         fails=True)  # fmt: skip
    assert accumulating.errors[0].startswith("gradient accumulation of 2 steps"), accumulating.errors[0]
    (tmp_path / "a_file").write_text("not a folder")
    export = train(demo_config(balanced=False, stage=2), **{**COMMON, "steps": 1}, export_dir=str(tmp_path / "a_file"),
                   fails=True)  # fmt: skip
    assert "exporting the weights to" in export.errors[0] and "failed on rank 0" in export.errors[0], export.errors
    save_dir = str(tmp_path / "ckpt")
    full = train(demo_config(balanced=False), **{**COMMON, "steps": 1}, save_dir=save_dir,
                 setup=functools.partial(_rank_1_cannot_write, save_dir), fails=True)  # fmt: skip
    assert "checkpoint step1: rank 1 cannot write its files: RuntimeError" in full.errors[0], full.errors


def _in_rank_folder(root: str) -> None:
    """Each rank works in a folder of its own under ``root`` (a node of its own, say)."""
    import os

    os.chdir(os.path.join(root, f"rank{os.environ['RANK']}"))


def test_a_deepspeed_config_one_rank_cannot_read_is_one_error_on_every_rank(tmp_path):
    """--deepspeed_config ds.json, a path relative to a working directory where only rank 0 has the
    file: before, rank 1 raised alone while rank 0 waited in DeepSpeed's start-up."""
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
    (tmp_path / "rank0" / "ds.json").write_text(json.dumps(demo_config(balanced=False, stage=2)))
    run = train("ds.json", **COMMON, setup=functools.partial(_in_rank_folder, str(tmp_path)), fails=True)
    assert "rank(s) [1]" in run.errors[0] and "cannot read the DeepSpeed config ds.json" in run.errors[0], run.errors
