"""Packed Qwen-Image against diffusers' ``QwenImageTransformer2DModel``, one sample at a time.

The reference is diffusers' model run on each sample alone (a batch of one), its output cut to the
target's tokens as the pipelines cut it; ours runs all samples packed in one batch, samples with no,
one and two reference images together. Balanced runs on 4 gloo ranks are in
tests/multirank/test_qwenimage.py.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from tests.support.qwenimage_cases import (
    CONFIGS,
    INPUTS,
    SHAPES,
    TOLERANCE,
    diffusers_output,
    random_samples,
    reference_model,
    relative_error,
)

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # diffusers on casting a model with .to(dtype)


def packed(ref, **kwargs):
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer

    return PackedQwenImageTransformer.from_diffusers(ref, attention_backend="sdpa", **kwargs)


def _run_both(case: str, dtype: torch.dtype, **kwargs):
    """Outputs, parameter and input gradients of a weighted sum of the outputs: packed, diffusers."""
    ref = reference_model(case, dtype)
    model = packed(ref, **kwargs)
    ours_in = random_samples(case, SHAPES, 1, dtype, requires_grad=True)
    theirs_in = random_samples(case, SHAPES, 1, dtype, requires_grad=True)
    ours = model.forward_samples(ours_in)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(o.shape, generator=g, dtype=dtype) for o in ours]
    sum((o * w).sum() for o, w in zip(ours, weights, strict=True)).backward()
    theirs = [diffusers_output(ref, s) for s in theirs_in]
    sum((o * w).sum() for o, w in zip(theirs, weights, strict=True)).backward()
    ours_grads = {name: p.grad for name, p in model.named_parameters()}
    theirs_grads = {name: p.grad for name, p in ref.named_parameters()}
    input_pairs = [(a[k].grad, b[k].grad) for a, b in zip(ours_in, theirs_in, strict=True) for k in INPUTS]
    return (ours, theirs), (ours_grads, theirs_grads), input_pairs


@pytest.mark.parametrize("case", list(CONFIGS))
def test_state_dict_names_and_shapes_equal_diffusers_both_ways(case):
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer

    ref = reference_model(case, torch.float32)
    ours = PackedQwenImageTransformer(**CONFIGS[case])
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in ref.state_dict().items()
    }
    ref.load_state_dict(packed(ref).state_dict(), strict=True)


@pytest.mark.parametrize("case", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_outputs_and_gradients_equal_diffusers_per_sample(case, dtype):
    """SHAPES in one packed batch: the target's outputs, every parameter's gradient and the latents'
    and text's input gradients. fp64 to 1e-10 (measured below 2e-14: diffusers' fp32 roundings, the
    norms' mean square and RoPE, are per token and reproduced, so no gradient is rounded apart);
    fp32 to 2e-5 (measured below 9e-6, and 1.01e-5 on another host: ``TOLERANCE``). The last
    block's text output reaches no output, so its to_add_out and txt_mlp get no gradient, here as
    in diffusers."""
    (ours, theirs), (ours_grads, theirs_grads), input_pairs = _run_both(case, dtype)
    tolerance = TOLERANCE[dtype]
    for out, want in zip(ours, theirs, strict=True):
        assert out.shape == want.shape and relative_error(out, want) <= tolerance
    assert ours_grads.keys() == theirs_grads.keys()
    unused = [name for name, grad in theirs_grads.items() if grad is None]
    assert unused and all(".txt_mlp." in name or ".to_add_out." in name for name in unused)
    for name, grad in theirs_grads.items():
        if grad is None:
            assert ours_grads[name] is None, name
        else:
            assert relative_error(ours_grads[name], grad) <= tolerance, name
    assert len(input_pairs) == 2 * len(SHAPES)
    for got, want in input_pairs:
        assert relative_error(got, want) <= tolerance


def test_gradient_checkpointing_gives_the_same_outputs_and_gradients():
    (ours, theirs), (ours_grads, theirs_grads), _ = _run_both(
        "qwen_image_zero_cond", torch.float64, gradient_checkpointing=True
    )
    for out, want in zip(ours, theirs, strict=True):
        assert relative_error(out, want) <= 1e-10
    for name, grad in theirs_grads.items():
        assert (grad is None and ours_grads[name] is None) or relative_error(ours_grads[name], grad) <= 1e-10, name


def test_zero_cond_t_modulates_references_by_timestep_zero_only():
    """Edit-2511's flag changes a sample with references, and one without only by rounding (its image
    modulation runs on twice the rows)."""
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer

    plain = packed(reference_model("qwen_image", torch.float64))
    zero_cond = PackedQwenImageTransformer(**CONFIGS["qwen_image"], zero_cond_t=True).double()
    zero_cond.load_state_dict(plain.state_dict())
    samples = random_samples("qwen_image", SHAPES[:2], 3, torch.float64)  # sample 1 has a reference
    (a0, a1), (b0, b1) = plain.forward_samples(samples), zero_cond.forward_samples(samples)
    assert relative_error(a0, b0) <= 1e-13 and relative_error(a1, b1) > 1e-3


def test_a_rank_without_samples_runs_forward_and_backward():
    """Zero tokens: every layer runs on empty tensors, every parameter on the path gets a (zero) gradient."""
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer

    model = PackedQwenImageTransformer(**CONFIGS["qwen_image_zero_cond"])
    out = model(model.pack([]))
    assert out.shape == (0, 2 * 2 * CONFIGS["qwen_image_zero_cond"]["out_channels"])
    out.sum().backward()
    assert all(not p.grad.any() for p in model.parameters() if p.grad is not None)
    assert model.forward_samples([]) == []


def test_rope_rows_and_timestep_features_are_bitwise_diffusers():
    """Each token's complex64 rotations are diffusers' ``QwenEmbedRope`` rows (images and text), the
    timestep features its ``Timesteps(256, scale=1000)``'s."""
    from diffusers.models.embeddings import get_timestep_embedding
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    from deepspeed_knap.models.layers import timestep_features
    from deepspeed_knap.models.qwenimage import image_positions
    from deepspeed_knap.models.qwenimage.layers import rotary_freqs

    img_shapes, text = [(1, 7, 5), (2, 4, 9), (1, 1, 1)], 11
    positions, text_start = image_positions(img_shapes)
    image_rows, text_rows = QwenEmbedRope(10000, [16, 56, 56], scale_rope=True)(
        [img_shapes], device=torch.device("cpu"), max_txt_seq_len=text
    )
    assert torch.equal(rotary_freqs(torch.as_tensor(positions), (16, 56, 56)), image_rows)
    text_positions = torch.arange(text_start, text_start + text)[:, None].expand(text, 3)
    assert torch.equal(rotary_freqs(text_positions, (16, 56, 56)), text_rows)
    t = torch.rand(16, dtype=torch.float64)
    assert torch.equal(timestep_features(t, 256, scale=1000), get_timestep_embedding(t, 256, True, 0, scale=1000))


def test_export_loads_in_diffusers_and_diffusers_checkpoints_load_here(tmp_path):
    from deepspeed_knap.models.auto import from_pretrained
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer

    ref = reference_model("qwen_image_zero_cond", torch.float32)
    samples = random_samples("qwen_image_zero_cond", SHAPES[:3], 6, torch.float32)
    expected = [diffusers_output(ref, s) for s in samples]
    exported = packed(ref).save_pretrained(tmp_path / "ours")
    reloaded = diffusers.QwenImageTransformer2DModel.from_pretrained(exported)
    assert reloaded.config.zero_cond_t
    assert all(torch.equal(t, ref.state_dict()[k]) for k, t in reloaded.state_dict().items())
    ref.save_pretrained(tmp_path / "pipeline" / "transformer")
    # Qwen/Qwen-Image's released config.json holds pooled_projection_dim, which diffusers' class does
    # not take and ignores (with a warning): so does the loader.
    config = tmp_path / "pipeline" / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooled_projection_dim": 768}))
    model = from_pretrained(tmp_path / "pipeline", attention_backend="sdpa")  # the family from _class_name
    assert type(model) is PackedQwenImageTransformer and model.config["zero_cond_t"]
    assert "pooled_projection_dim" not in model.config
    for output, want in zip(model.forward_samples(samples), expected, strict=True):
        assert relative_error(output, want) <= TOLERANCE[torch.float32]


def test_the_preset_prices_diffusers_default_config():
    """``qwen-image`` is the FLOP dims of diffusers' defaults (the released Qwen-Image)."""
    from deepspeed_knap.models.qwenimage.spec import QWEN_IMAGE, qwen_image_cost_dims

    signature = inspect.signature(diffusers.QwenImageTransformer2DModel.__init__).parameters
    defaults = {name: p.default for name, p in signature.items() if p.default is not inspect.Parameter.empty}
    assert qwen_image_cost_dims(defaults) == QWEN_IMAGE.presets["qwen-image"]


def test_layered_configs_are_refused():
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer

    for key in ("use_additional_t_cond", "use_layer3d_rope"):
        with pytest.raises(ValueError, match=f"{key} \\(Qwen-Image-Layered\\) not supported"):
            PackedQwenImageTransformer(**CONFIGS["qwen_image"], **{key: True})
    with pytest.raises(ValueError, match=r"axes_dims_rope \[2, 2, 2, 2\] must be 3 sizes"):
        PackedQwenImageTransformer(**{**CONFIGS["qwen_image"], "axes_dims_rope": (2, 2, 2, 2)})


def test_bad_samples_name_the_sample_and_the_problem():
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer

    model = PackedQwenImageTransformer(**CONFIGS["qwen_image"])
    good = random_samples("qwen_image", SHAPES[:2], 7, torch.float32)  # sample 1: 6 + 9 image tokens, 6 text rows

    def without(sample, key):
        return {k: v for k, v in sample.items() if k != key}

    cases = [
        ([good[0], without(good[1], "img_shapes")], r"sample 1 has no \['img_shapes'\]"),
        ([good[0], {**good[1], "img_shapes": [(1, 2, 3)]}],
         r"sample 1: 'hidden_states' has shape \[15, 8\]; expected \[6, 8\] \(one unbatched sample: 6 = the tokens "
         r"img_shapes \[\(1, 2, 3\)\] count"),
        ([{**good[0], "img_shapes": []}], r"sample 0: img_shapes \[\] must be a non-empty list of positive"),
        ([{**good[0], "img_shapes": [(3, 5)]}], r"sample 0: img_shapes \[\(3, 5\)\] must be a non-empty list"),
        ([{**good[0], "img_shapes": [(1, 0, 5), (1, 3, 5)]}], r"sample 0: img_shapes .* positive"),
        ([good[0], {**good[1], "encoder_hidden_states_mask": torch.ones(6)}],
         r"sample 1 has an encoder_hidden_states_mask; pack its text without padding"),
        ([{**good[0], "encoder_hidden_states": torch.zeros(4, 16)}],
         r"sample 0: 'encoder_hidden_states' has shape \[4, 16\]; expected \[4, 12\]"),
        ([{**good[0], "timestep": torch.zeros(2)}], r"sample 0: 'timestep' has shape \[2\]; expected \[\]"),
        ([{**good[0], "encoder_hidden_states": torch.zeros(4095, 12)}],
         r"sample 0: RoPE positions -3..4096 .* fall outside diffusers' tables of positions -4096..4095"),
    ]  # fmt: skip
    for samples, message in cases:
        with pytest.raises(ValueError, match=message):
            model.pack(samples)
        assert model.pack(samples, on_problem="carry").problem is not None
    with pytest.raises(ValueError, match=r"sample 0 has no \['timestep'\]"):
        model.forward_samples([without(good[0], "timestep")])


def test_synthetic_samples_in_bfloat16_keep_their_grids_whole():
    """A side of 733 tokens is not a bfloat16 number: the grids stay float32, so they count the rows."""
    from deepspeed_knap.data.mixes import SampleShape
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer
    from deepspeed_knap.models.qwenimage.data import synthetic_qwen_image_samples
    from deepspeed_knap.models.qwenimage.spec import TINY_QWEN_IMAGE

    model = PackedQwenImageTransformer(**TINY_QWEN_IMAGE).to(torch.bfloat16)
    shape = SampleShape(text=100, visual=3 * 733 + 2 * 1871, frames=3, reference=2 * 1871)
    (sample,) = synthetic_qwen_image_samples([shape], model.config, 0, 1.0, torch.bfloat16)
    grids = sample["img_shapes"].long().tolist()
    assert sample["img_shapes"].dtype == torch.float32 and sum(f * h * w for f, h, w in grids) == shape.visual
    assert any(float(torch.tensor(float(max(g)), dtype=torch.bfloat16)) != max(g) for g in grids)  # would round
    packed = model.pack([{"hidden_states": torch.cat([sample["latents"], sample["reference_latents"]]),
                          "encoder_hidden_states": sample["encoder_hidden_states"], "img_shapes": sample["img_shapes"],
                          "timestep": torch.tensor(0.5)}])  # fmt: skip
    assert packed.seq_lens == (100 + shape.visual,)


def test_latent_files_keep_their_grids_whole_in_bfloat16_and_flat_tensors_are_refused(tmp_path):
    """Read from files too (``LatentDirectory.read``): a grid side of 257 would round to 256 in
    bfloat16. A file whose tensor is not 2-D is named by the start-up check (not an IndexError on
    the rank that checks it, while the others wait in the agreement)."""
    from deepspeed_knap.models.qwenimage.data import (
        check_qwen_image_latent_file,
        latent_directory,
        save_qwen_image_sample,
    )
    from deepspeed_knap.models.qwenimage.spec import TINY_QWEN_IMAGE

    width, text_width = TINY_QWEN_IMAGE["in_channels"], TINY_QWEN_IMAGE["joint_attention_dim"]
    sample = {"latents": torch.zeros(2 * 257, width), "encoder_hidden_states": torch.zeros(3, text_width),
              "img_shapes": torch.tensor([[1.0, 2.0, 257.0]])}  # fmt: skip
    save_qwen_image_sample(tmp_path / "a.safetensors", sample)
    assert check_qwen_image_latent_file(tmp_path / "a.safetensors", TINY_QWEN_IMAGE) is None
    _, (read,) = latent_directory(tmp_path).read(0, 1, torch.bfloat16)
    assert read["img_shapes"].tolist() == [[1.0, 2.0, 257.0]] and read["latents"].dtype == torch.bfloat16
    save_qwen_image_sample(tmp_path / "b.safetensors", {**sample, "encoder_hidden_states": torch.tensor(1.0)})
    problem = check_qwen_image_latent_file(tmp_path / "b.safetensors", TINY_QWEN_IMAGE)
    assert "{'encoder_hidden_states': []} must be [rows, width] (2-D)" in problem


def test_rope_positions_past_diffusers_tables_are_refused_at_start_up_as_at_the_step(tmp_path):
    """The start-up check of a latent file names text rows past diffusers' RoPE tables (before, the
    step that read the file did); the range from the grids alone matches the positions built one by
    one (``image_positions``), near the tables' ends."""
    import numpy as np

    from deepspeed_knap.models.qwenimage.data import check_qwen_image_latent_file, save_qwen_image_sample
    from deepspeed_knap.models.qwenimage.layers import ROPE_POSITIONS
    from deepspeed_knap.models.qwenimage.qwenimage import image_positions, rope_range_problem
    from deepspeed_knap.models.qwenimage.spec import TINY_QWEN_IMAGE

    width, text_width = TINY_QWEN_IMAGE["in_channels"], TINY_QWEN_IMAGE["joint_attention_dim"]
    for rows, refused in ((ROPE_POSITIONS - 1, False), (ROPE_POSITIONS, True)):
        sample = {"latents": torch.zeros(4, width), "encoder_hidden_states": torch.zeros(rows, text_width),
                  "img_shapes": torch.tensor([[1.0, 2.0, 2.0]])}  # fmt: skip
        save_qwen_image_sample(tmp_path / f"{rows}.safetensors", sample)
        problem = check_qwen_image_latent_file(tmp_path / f"{rows}.safetensors", TINY_QWEN_IMAGE)
        assert (problem is not None and f"{rows}.safetensors: RoPE positions -1..{rows}" in problem) == refused, problem
    rng = np.random.default_rng(0)
    for _ in range(300):  # one long side per image (positions built one by one stay few), near the ends
        grids = []
        for _ in range(int(rng.integers(1, 4))):
            long, short = int(rng.integers(1, 8300)), int(rng.integers(1, 6))
            grids.append((int(rng.integers(1, 4)), *((long, short) if rng.random() < 0.5 else (short, long))))
        rows = int(rng.integers(1, 4200))
        positions, text_start = image_positions(grids)
        low, high = min(int(positions.min()), text_start), max(int(positions.max()), text_start + rows - 1)
        problem = rope_range_problem(grids, rows)
        if low >= -ROPE_POSITIONS and high < ROPE_POSITIONS:
            assert problem is None, (grids, rows)
        else:
            assert problem is not None and problem.startswith(f"RoPE positions {low}..{high} "), (grids, rows, problem)


@pytest.mark.parametrize("head_dim", [8, 24, 40, 128])
def test_the_generator_s_tiny_config_builds_at_any_even_head_size(head_dim):
    """``bench generate --head-dim``: every RoPE axis even (an odd one, as 6, 9, 9 of 24, is refused
    by the model), 16, 56, 56 of 128 as the pipeline's model."""
    from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer
    from deepspeed_knap.models.qwenimage.generate import QwenImageGenerator

    config = QwenImageGenerator.tiny_config(2, head_dim)
    axes = config["axes_dims_rope"]
    assert sum(axes) == head_dim and all(axis > 0 and axis % 2 == 0 for axis in axes)
    assert head_dim != 128 or tuple(axes) == (16, 56, 56)
    PackedQwenImageTransformer(**config)


def test_an_edit_checkpoint_validates_edits_of_its_references_through_its_own_pipeline(tmp_path, monkeypatch):
    """Training an edit model (a QwenImageEditPlusPipeline folder) validated it as text to image
    through QwenImagePipeline; its renders are edits of the line's references, through its pipeline."""
    import numpy as np
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
    from PIL import Image

    from deepspeed_knap.models.hooks import ValidationSettings
    from deepspeed_knap.models.qwenimage.finetune import QwenImageValidation
    from deepspeed_knap.models.qwenimage.generate import QwenImageEditPlusGenerator
    from deepspeed_knap.models.registry import spec

    tiny = QwenImageEditPlusGenerator.tiny(torch.float32, "cpu", seed=0)
    (tmp_path / "edit").mkdir()  # the folder's index (the tiny processor cannot be saved: its parts are)
    (tmp_path / "edit" / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageEditPlusPipeline"}))
    hooks = QwenImageValidation(spec("qwen-image"), str(tmp_path / "edit"))
    assert hooks.model_path_problem(str(tmp_path / "edit")) is None
    assert hooks.pipeline(tiny.model)[0] == "QwenImageEditPlusPipeline"
    with pytest.raises(
        ValueError, match="QwenImageEditPlusPipeline checkpoint edits reference images: write IMAGE<TAB>"
    ):
        hooks.call("a cat", tmp_path, tiny.model)
    for name, colour in (("red.png", (255, 0, 0)), ("blue.png", (0, 0, 255))):
        Image.new("RGB", (48, 48), colour).save(tmp_path / name)
    calls = [hooks.call(f"{name}\ta cat", tmp_path, tiny.model) for name in ("red.png", "blue.png")]
    assert calls[0]["prompt"] == "a cat" and len(calls[0]["image"]) == 1
    unsized = hooks.options(ValidationSettings(False, width=64, steps=2))
    assert (unsized["height"], unsized["width"]) == (None, 64)  # the height the pipeline's, from the reference
    options = hooks.options(ValidationSettings(False, 32, 32, steps=2))
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", 112 * 112)  # tiny images
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 48 * 48)
    components = {name: part for name, part in tiny.pipeline.components.items() if name != "transformer"}
    transformers = type(tiny.model).pipeline_transformers(tiny.model.config, tiny.model.state_dict())
    pipe = hooks.build_pipeline(tiny.model, components, transformers)
    pipe.set_progress_bar_config(disable=True)
    files = [hooks.render(pipe, call, torch.Generator().manual_seed(0), options, tmp_path / f"out{i}")
             for i, call in enumerate(calls)]  # fmt: skip
    red, blue = (np.asarray(Image.open(file), dtype=np.float64) for file in files)
    # The renders differ only in their reference (same prompt and seed): it conditions the edit.
    assert red.shape == (32, 32, 3) and not np.array_equal(red, blue)
