"""Training Wan on 2 gloo ranks in process (``Trainer``, tests/support/training.py): video files and
images this test writes (PyAV, PIL) -> examples/prepare_video_latents.py (a tiny random WanPipeline
with a transformer) -> ZeRO-3 and LoRA, the model loaded from that pipeline folder (partitioned),
clips and images of mixed sizes in each step, topology ``auto``.

Balanced training gives the losses of unbalanced training; a run resumed from the step-2 checkpoint
continues with the uninterrupted run's losses and ends with its adapter; validation clips are GIFs
written through diffusers' WanPipeline; the exported adapter loads into WanPipeline with
load_lora_weights, and its transformer then computes what our packed model computes with peft's LoRA
holding the same weights. The runs are shared by one module-scoped fixture. The documented CPU demo
(its config file as the example is given it) trains synthetic clips and renders at the tiny defaults.
"""

import numpy as np
import pytest
import torch

from tests.support.training import ROOT, demo_config, run_example, train

pytest.importorskip("av")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("transformers")

STEPS = 4
COMMON = dict(lora_rank=4, lora_alpha=8, samples_per_rank=2, steps=STEPS, lr=1e-3)
# source name: (frames, height, width), captions from the tiny tokenizer's words
SOURCES = {"a_clip.mp4": (9, 32, 48), "b_clip.mp4": (13, 48, 64), "c_clip.mp4": (5, 32, 32),
           "d_still.png": (1, 16, 32), "e_still.png": (1, 48, 48), "f_clip.mp4": (17, 32, 32)}  # fmt: skip


@pytest.fixture(scope="module")
def wan_job(tmp_path_factory):
    """The pipeline folder, the prepared data, and the balanced (checkpointed, validated, exported),
    unbalanced and resumed runs."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from PIL import Image

    from deepspeed_knap.models.wan.data import tiny_wan_pipeline
    from deepspeed_knap.models.wan.spec import TINY_WAN
    from tests.support.videos import write_video

    d = tmp_path_factory.mktemp("wan")
    torch.manual_seed(0)
    parts = tiny_wan_pipeline().components
    parts["transformer"] = WanTransformer3DModel(**TINY_WAN)
    WanPipeline(**parts).save_pretrained(d / "pipe")
    inputs = d / "inputs"
    inputs.mkdir()
    words = ["a red cat", "the blue dog", "a green bird", "an image of a cat", "the red bird", "a video of a dog"]
    for index, ((name, (frames, height, width)), caption) in enumerate(zip(SOURCES.items(), words, strict=True)):
        if name.endswith(".png"):
            pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(inputs / name)
        else:
            write_video(inputs / name, frames, height, width, "libx264", seed=index)
        (inputs / name).with_suffix(".txt").write_text(caption)
    run_example("prepare_video_latents.py", "--pretrained", str(d / "pipe"), "--inputs", str(inputs),
                "--out", str(d / "data"), "--max-sequence-length", "16", "--device", "cpu")  # fmt: skip
    (d / "prompts.txt").write_text("a red cat\nthe blue dog\n")
    job = dict(model_path=str(d / "pipe"), data_dir=str(d / "data"), **COMMON)
    on = train(demo_config("wan"), **job, save_dir=str(d / "ckpt"), checkpoint_every=2, export_dir=str(d / "on"),
               validation_every=STEPS, validation_prompts=str(d / "prompts.txt"), validation_dir=str(d / "clips"),
               validation_resolution=32, validation_width=32, validation_frames=5, validation_inference_steps=2)  # fmt: skip
    off = train(demo_config("wan", balanced=False), **job)
    resumed = train(demo_config("wan"), **job, resume=str(d / "ckpt" / "step2"), export_dir=str(d / "resumed"))
    return d, on, off, resumed


def test_prepared_videos_and_images_train_balanced_as_unbalanced(wan_job):
    _, on, off, _ = wan_job
    assert sorted(on.losses) == list(range(STEPS))
    assert list(on.losses.values()) == pytest.approx(list(off.losses.values()), rel=1e-5)
    # The steps mix clips and images of every prepared size; balancing moved work (imbalance fell).
    assert any(after < before for before, after in on.imbalances()), on.imbalances()


def test_resumed_run_continues_with_the_uninterrupted_losses_and_adapter(wan_job):
    from safetensors.torch import load_file

    from deepspeed_knap.models.lora import ADAPTER_FILE

    d, on, _, resumed = wan_job
    assert f"--resume: loading checkpoint step2 from {d / 'ckpt'}\n" in resumed.stdout
    assert resumed.losses == {step: on.losses[step] for step in range(2, STEPS)}
    uninterrupted, continued = (load_file(d / name / ADAPTER_FILE) for name in ("on", "resumed"))
    assert uninterrupted.keys() == continued.keys()
    assert all(torch.equal(continued[name], tensor) for name, tensor in uninterrupted.items())


def test_validation_clips_are_gifs_of_the_pipeline(wan_job):
    from PIL import Image

    d, on, _, _ = wan_job
    clips = sorted((d / "clips").glob("*.gif"))
    assert [p.name for p in clips] == [f"step{STEPS:06d}_prompt00.gif", f"step{STEPS:06d}_prompt01.gif"]
    for clip in clips:
        with Image.open(clip) as gif:
            assert (gif.size, gif.n_frames) == ((32, 32), 5)  # the tiny pipeline's 32 x 32, 5 frames
    assert f"validation clip {clips[1]} after step {STEPS - 1}: 'the blue dog'" in on.stdout


def test_exported_adapter_loads_into_wan_pipeline_as_peft_lora_on_our_model(wan_job):
    """WanPipeline.load_lora_weights reads the adapter (every layer of it); its transformer then
    computes what our packed model computes with peft's LoRA holding the same weights, and not the
    base."""
    from diffusers import WanPipeline
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from deepspeed_knap.models.lora import ADAPTER_FILE, add_lora
    from deepspeed_knap.models.wan import PackedWanTransformer
    from deepspeed_knap.models.wan.data import load_video_sample
    from deepspeed_knap.models.wan.finetune import flow_matching
    from tests.support.wan_cases import diffusers_output, relative_error

    d, _, _, _ = wan_job
    adapter = load_file(d / "on" / ADAPTER_FILE)
    assert len(adapter) == 2 * 2 * len(PackedWanTransformer.spec.lora_targets)  # A and B, 2 blocks
    latents, _ = load_video_sample(sorted((d / "data").glob("*.safetensors"))[1])
    (sample,) = flow_matching([latents], torch.Generator().manual_seed(0), [1, 2, 2]).samples
    pipe = WanPipeline.from_pretrained(d / "pipe")
    with torch.no_grad():
        before = diffusers_output(pipe.transformer, sample)
        pipe.load_lora_weights(d / "on")
        after = diffusers_output(pipe.transformer, sample)
        ours = PackedWanTransformer.from_pretrained(d / "pipe", attention_backend="sdpa")
        add_lora(ours, rank=4, alpha=8)
        state = {name.removeprefix("transformer."): t for name, t in adapter.items()}
        assert not set_peft_model_state_dict(ours, state).unexpected_keys
        expected = ours.forward_samples([sample])[0]
    assert relative_error(after, expected) < 1e-5
    assert relative_error(after, before) > 1e-4


def test_the_documented_cpu_demo_trains_synthetic_clips_and_renders_with_the_tiny_defaults(tmp_path):
    """train_dit.py's Wan demo (its config file, synthetic wan_image_video clips, the tiny model, full
    fine-tuning) with validation at the tiny pipeline's defaults: 32 x 32, 5 frames."""
    from PIL import Image

    (tmp_path / "prompts.txt").write_text("a red cat\n")
    run = train(str(ROOT / "ds_configs" / "wan_cpu_demo.json"), family="wan", token_scale=1 / 64, steps=2,
                validation_every=2, validation_prompts=str(tmp_path / "prompts.txt"),
                validation_dir=str(tmp_path / "clips"))  # fmt: skip
    assert sorted(run.losses) == [0, 1]
    with Image.open(tmp_path / "clips" / "step000002_prompt00.gif") as gif:
        assert (gif.size, gif.n_frames) == ((32, 32), 5)


def test_guidance_is_refused_for_a_model_without_a_guidance_embedding():
    """Wan has no guidance embedding: a --guidance would be ignored, so it is refused on every rank
    before any step (it was silently dropped)."""
    run = train(str(ROOT / "ds_configs" / "wan_cpu_demo.json"), ranks=1, fails=True, family="wan",
                token_scale=1 / 64, steps=1, guidance=2.0)  # fmt: skip
    assert "--guidance 2.0: this model has no guidance embedding" in run.errors[0], run.errors[0]
