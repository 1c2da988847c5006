"""Qwen-Image training on 2 gloo ranks in process (``Trainer``), ZeRO-3 and LoRA, topology ``auto``: a
tiny ``QwenImagePipeline`` this test saves, images and captions it writes, prepared by
examples/prepare_qwen_image_latents.py (the pipeline's own VAE and text-encoder code), trained
balanced with a validation image through the pipeline (the losses of the same run unbalanced),
checkpointed, resumed with the same losses and adapter; the exported adapter loaded by ``QwenImagePipeline.load_lora_weights`` makes its
transformer compute what our packed model with peft's LoRA computes, and not its base.
"""

import numpy as np
import pytest
import torch

from tests.support.training import demo_config, run_example, train

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("transformers")

STEPS = 3
# (height, width) px: 16 px a token, each a near-square or elongated target of its own size.
IMAGES = {"a_cat.png": (48, 64), "b_dog.png": (64, 32), "c_bird.png": (32, 32), "d_red.png": (80, 48)}
CAPTIONS = ["a red cat", "the blue dog", "a green bird", "an image of red"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The pipeline folder, the prepared data, a balanced run (checkpointed, exported, one validation
    image) and the run resumed from its step-2 checkpoint."""
    from PIL import Image

    from deepspeed_knap.models.qwenimage.finetune import tiny_qwen_image_components
    from deepspeed_knap.models.qwenimage.spec import TINY_QWEN_IMAGE

    d = tmp_path_factory.mktemp("qwen")
    torch.manual_seed(0)
    transformer = diffusers.QwenImageTransformer2DModel(**TINY_QWEN_IMAGE)
    diffusers.QwenImagePipeline(**tiny_qwen_image_components(TINY_QWEN_IMAGE), transformer=transformer).save_pretrained(
        d / "pipeline"
    )
    inputs = d / "inputs"
    inputs.mkdir()
    for index, ((name, (height, width)), caption) in enumerate(zip(IMAGES.items(), CAPTIONS, strict=True)):
        pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(inputs / name)
        (inputs / name).with_suffix(".txt").write_text(caption)
    run_example("prepare_qwen_image_latents.py", "--pretrained", str(d / "pipeline"), "--inputs", str(inputs),
                "--out", str(d / "data"), "--resolution", "64", "--max-sequence-length", "64", "--device", "cpu")  # fmt: skip
    (d / "prompts.txt").write_text("a red cat\n")
    job = dict(model_path=str(d / "pipeline"), data_dir=str(d / "data"), lora_rank=4, lora_alpha=8,
               samples_per_rank=2, steps=STEPS, lr=1e-3)  # fmt: skip
    config = demo_config("qwen_image")
    first = train(config, **job, save_dir=str(d / "ckpt"), checkpoint_every=2, export_dir=str(d / "on"),
                  validation_every=STEPS, validation_prompts=str(d / "prompts.txt"), validation_dir=str(d / "images"),
                  validation_inference_steps=2, validation_resolution=32)  # fmt: skip
    resumed = train(config, **job, resume=str(d / "ckpt" / "step2"), export_dir=str(d / "resumed"))
    plain = train(demo_config("qwen_image", balanced=False), **job)
    return d, first, resumed, plain


def test_prepared_images_train_balanced_resume_and_render(qwen):
    from safetensors.torch import load_file

    from deepspeed_knap.models.lora import ADAPTER_FILE

    d, first, resumed, plain = qwen
    assert sorted(first.losses) == list(range(STEPS)) and all(np.isfinite(list(first.losses.values())))
    for step, loss in plain.losses.items():  # balancing moves tokens, not what the model computes
        assert loss == pytest.approx(first.losses[step], rel=1e-5), step
    assert resumed.losses == {2: first.losses[2]}  # the resumed step is the uninterrupted one's
    assert max(after for _, after in first.imbalances()) < max(before for before, _ in first.imbalances())
    assert (d / "images" / "step000003_prompt00.png").is_file()
    on, again = load_file(d / "on" / ADAPTER_FILE), load_file(d / "resumed" / ADAPTER_FILE)
    assert on.keys() == again.keys() and all(torch.equal(on[key], again[key]) for key in on)


def test_exported_adapter_loads_into_the_pipeline_as_peft_lora_on_our_model(qwen):
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from deepspeed_knap.models.lora import ADAPTER_FILE, add_lora
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer
    from deepspeed_knap.models.qwenimage.data import flow_matching
    from tests.support.wan_cases import relative_error

    d, _, _, _ = qwen
    latents = load_file(sorted((d / "data").glob("*.safetensors"))[0])
    ((sample,), _) = flow_matching([latents], torch.Generator().manual_seed(0))
    pipe = diffusers.QwenImagePipeline.from_pretrained(d / "pipeline")

    def diffusers_output():
        grids = [tuple(row) for row in sample["img_shapes"].tolist()]
        return pipe.transformer(hidden_states=sample["hidden_states"][None], timestep=sample["timestep"].reshape(1),
                                encoder_hidden_states=sample["encoder_hidden_states"][None],
                                img_shapes=[grids]).sample[0]  # fmt: skip

    with torch.no_grad():
        before = diffusers_output()
        pipe.load_lora_weights(d / "on")
        after = diffusers_output()
        ours = PackedQwenImageTransformer.from_pretrained(d / "pipeline", attention_backend="sdpa")
        add_lora(ours, rank=4, alpha=8)
        state = {k.removeprefix("transformer."): t for k, t in load_file(d / "on" / ADAPTER_FILE).items()}
        assert not set_peft_model_state_dict(ours, state).unexpected_keys
        expected = ours.forward_samples([sample])[0]
    assert relative_error(after, expected) < 1e-5
    assert relative_error(after, before) > 1e-4
