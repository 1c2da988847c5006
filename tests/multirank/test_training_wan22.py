"""Training Wan as people train it, on 2 gloo ranks in process (``Trainer``), ZeRO-3 and LoRA, topology
``auto``: tiny pipelines of each kind this test saves, data prepared from clips it writes
(examples/prepare_video_latents.py, the pipeline's own parts), each run checkpointed, resumed and
exported:

* ``a14b``: Wan 2.2 A14B text-to-video, two experts (``--expert both``: each sample's noise level
  picks its expert; one plan balances both);
* ``i2v21``: Wan 2.1 I2V, 36-channel-style input (noise, first-frame mask and latents) and CLIP image
  context, validation renders through ``WanImageToVideoPipeline``;
* ``i2v_a14b``: Wan 2.2 I2V-A14B, two image-to-video experts without CLIP;
* ``ti2v``: Wan 2.2 TI2V-5B-style (``expand_timesteps``), every clip trained image-conditioned.

A resumed run gives the uninterrupted run's losses and adapters; the exported adapters (one per
expert) load into the diffusers pipeline with ``load_lora_weights`` (``load_into_transformer_2`` for
the second expert), whose transformers then compute what our packed model computes with peft's LoRA.
"""

import numpy as np
import pytest
import torch

from tests.support.training import demo_config, run_example, train
from tests.support.wan_cases import WAN22_KINDS as KINDS
from tests.support.wan_cases import save_wan22_pipeline

pytest.importorskip("av")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("transformers")

STEPS = 3
COMMON = dict(lora_rank=4, lora_alpha=8, samples_per_rank=2, steps=STEPS, lr=1e-3, checkpoint_every=2)
SOURCES = {"a_clip.mp4": (9, 32, 48), "b_clip.mp4": (13, 48, 64), "c_clip.mp4": (5, 32, 32), "d_still.png": (1, 32, 32)}
WORDS = ["a red cat", "the blue dog", "a green bird", "an image of a cat"]


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    """Each kind's pipeline folder, prepared data, and its balanced run (checkpointed, exported) and
    the run resumed from its step-2 checkpoint."""
    from PIL import Image

    from tests.support.videos import write_video

    d = tmp_path_factory.mktemp("wan22")
    inputs = d / "inputs"
    inputs.mkdir()
    for index, ((name, (frames, height, width)), caption) in enumerate(zip(SOURCES.items(), WORDS, strict=True)):
        if name.endswith(".png"):
            pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(inputs / name)
        else:
            write_video(inputs / name, frames, height, width, "libx264", seed=index)
        (inputs / name).with_suffix(".txt").write_text(caption)
    runs = {}
    for name, kind in KINDS.items():
        save_wan22_pipeline(d / name, kind)
        run_example("prepare_video_latents.py", "--pretrained", str(d / name), "--inputs", str(inputs),
                    "--out", str(d / f"{name}_data"),
                    "--max-sequence-length", "512" if kind.get("clip") else "16",  # Wan 2.1 I2V's text is 512 rows
                    "--device", "cpu")  # fmt: skip
        job = dict(model_path=str(d / name), data_dir=str(d / f"{name}_data"), **COMMON)
        if "first_frame_share" in kind:
            job["first_frame_share"] = kind["first_frame_share"]
        extra = {}
        if name == "i2v21":  # renders through WanImageToVideoPipeline from an image and a prompt
            (d / "prompts.txt").write_text(f"{inputs / 'd_still.png'}\ta red cat\n")
            extra = dict(validation_every=STEPS, validation_prompts=str(d / "prompts.txt"),
                         validation_dir=str(d / "clips"), validation_inference_steps=2, validation_resolution=32,
                         validation_width=32, validation_frames=5)  # fmt: skip
        first = train(demo_config("wan"), **job, save_dir=str(d / f"{name}_ckpt"), export_dir=str(d / f"{name}_on"),
                      **extra)  # fmt: skip
        resumed = train(demo_config("wan"), **job, resume=str(d / f"{name}_ckpt" / "step2"),
                        export_dir=str(d / f"{name}_resumed"))  # fmt: skip
        runs[name] = (first, resumed)
    return d, runs


@pytest.mark.parametrize("name", list(KINDS))
def test_each_kind_trains_balanced_and_resumes_with_the_same_losses_and_adapters(wan22, name):
    from safetensors.torch import load_file

    from deepspeed_knap.models.lora import ADAPTER_FILE

    d, runs = wan22
    first, resumed = runs[name]
    assert sorted(first.losses) == list(range(STEPS)) and all(np.isfinite(list(first.losses.values())))
    assert resumed.losses == {step: first.losses[step] for step in range(2, STEPS)}
    experts = ("transformer", "transformer_2")[: KINDS[name]["experts"]] if KINDS[name]["experts"] == 2 else ("",)
    for expert in experts:
        uninterrupted = load_file(d / f"{name}_on" / expert / ADAPTER_FILE)
        continued = load_file(d / f"{name}_resumed" / expert / ADAPTER_FILE)
        assert uninterrupted.keys() == continued.keys() and all(k.startswith("transformer.") for k in uninterrupted)
        assert all(torch.equal(continued[k], t) for k, t in uninterrupted.items())


def test_image_to_video_validation_renders_through_the_image_to_video_pipeline(wan22):
    from PIL import Image

    d, runs = wan22
    (clip,) = sorted((d / "clips").glob("*.gif"))
    with Image.open(clip) as gif:
        assert (gif.size, gif.n_frames) == ((32, 32), 5)
    assert f"validation clip {clip} after step {STEPS - 1}: 'a red cat'" in runs["i2v21"][0].stdout


@pytest.mark.parametrize("name", list(KINDS))
def test_exported_adapters_load_into_the_pipeline_as_peft_lora_on_our_model(wan22, name):
    """``load_lora_weights`` (and, for the low-noise expert, ``load_into_transformer_2``) reads each
    exported adapter; each of the pipeline's transformers then computes what our packed expert
    computes with peft's LoRA holding the same weights, and not its base."""
    import diffusers
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from deepspeed_knap.models.lora import ADAPTER_FILE, add_lora
    from deepspeed_knap.models.wan import PackedWanTransformer
    from deepspeed_knap.models.wan.data import load_video_sample
    from deepspeed_knap.models.wan.finetune import flow_matching
    from tests.support.wan_cases import diffusers_output, relative_error

    d, _ = wan22
    kind = KINDS[name]
    latents, _ = load_video_sample(sorted((d / f"{name}_data").glob("*.safetensors"))[0])
    (sample,) = flow_matching([latents], torch.Generator().manual_seed(0), [1, 2, 2]).samples
    pipe = getattr(diffusers, kind["pipeline"]).from_pretrained(d / name)
    names = ("transformer", "transformer_2")[: kind["experts"]]
    with torch.no_grad():
        before = [diffusers_output(getattr(pipe, expert), sample) for expert in names]
        for expert in names:
            folder = d / f"{name}_on" / (expert if kind["experts"] == 2 else "")
            pipe.load_lora_weights(folder, **({"load_into_transformer_2": True} if expert == "transformer_2" else {}))
        for index, expert in enumerate(names):
            after = diffusers_output(getattr(pipe, expert), sample)
            ours = PackedWanTransformer.from_pretrained(d / name / expert, attention_backend="sdpa")
            add_lora(ours, rank=4, alpha=8)
            folder = d / f"{name}_on" / (expert if kind["experts"] == 2 else "")
            state = {k.removeprefix("transformer."): t for k, t in load_file(folder / ADAPTER_FILE).items()}
            assert not set_peft_model_state_dict(ours, state).unexpected_keys
            expected = ours.forward_samples([sample])[0]
            assert relative_error(after, expected) < 1e-5, (name, expert)
            assert relative_error(after, before[index]) > 1e-4, (name, expert)
