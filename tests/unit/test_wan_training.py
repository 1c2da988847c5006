"""Wan training pieces: the flow-matching objective against its definition, synthetic clips against the
mix's sizes, the prepared-file check naming each bad file, and ds_configs/wan14b_zero3_knap.json against
Wan 2.1 14B (its parameter count, its cost model, its cap on a full-size wan_image_video step)."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from deepspeed_knap.models.registry import sample_shapes
from deepspeed_knap.models.wan.data import SyntheticVideoLatents, check_video_latent_file, save_video_sample
from deepspeed_knap.models.wan.finetune import flow_matching
from deepspeed_knap.models.wan.spec import TINY_WAN
from deepspeed_knap.models.wan.wan import PackedWanTransformer, unpatchify

ROOT = Path(__file__).resolve().parents[2]


def test_flow_matching_noises_each_sample_at_its_own_level_and_targets_the_velocity():
    g = torch.Generator().manual_seed(0)
    latents = [
        {"latents": torch.randn(4, 3, 4, 6, generator=g), "encoder_hidden_states": torch.randn(5, 24, generator=g)},
        {"latents": torch.randn(4, 1, 8, 2, generator=g), "encoder_hidden_states": torch.randn(2, 24, generator=g)},
    ]
    objective = flow_matching(latents, torch.Generator().manual_seed(1), [1, 2, 2])
    samples, targets = objective.samples, objective.targets
    assert objective.weights is None  # every row in the loss
    sigmas = []
    for latent, sample, target in zip(latents, samples, targets, strict=True):
        x0 = latent["latents"]
        sigma = sample["timestep"] / 1000
        grid = [x0.shape[1], x0.shape[2] // 2, x0.shape[3] // 2]
        velocity = unpatchify(target, grid, [1, 2, 2])  # noise - x0, back in [C, F, H, W]
        assert target.shape == (math.prod(grid), 4 * 4)
        torch.testing.assert_close(sample["hidden_states"], x0 + sigma * velocity)  # (1 - s) x0 + s noise
        assert sample["encoder_hidden_states"] is latent["encoder_hidden_states"]
        sigmas.append(float(sigma))
    assert min(sigmas) > 0 and max(sigmas) < 1 and sigmas[0] != sigmas[1]


def test_one_expert_draws_its_noise_levels_on_its_side_of_the_boundary():
    """Wan 2.2 A14B trained one expert at a time: the high-noise expert's timesteps are at least
    boundary * 1000 (the pipeline runs it at t >= boundary * 1000), the low-noise one's below."""
    g = torch.Generator().manual_seed(0)
    latents = [{"latents": torch.randn(4, 1, 2, 2, generator=g), "encoder_hidden_states": torch.randn(2, 24, generator=g)}
               for _ in range(64)]  # fmt: skip
    high = flow_matching(latents, torch.Generator().manual_seed(1), [1, 2, 2], sigma_range=(0.875, 1.0)).samples
    low = flow_matching(latents, torch.Generator().manual_seed(1), [1, 2, 2], sigma_range=(0.0, 0.875)).samples
    assert min(float(s["timestep"]) for s in high) >= 875 and max(float(s["timestep"]) for s in low) < 875
    both = [float(s["timestep"]) for s in flow_matching(latents, torch.Generator().manual_seed(1), [1, 2, 2]).samples]
    assert min(both) < 875 <= max(both)  # both: the draw picks the expert


def test_two_experts_trained_together_split_the_samples_by_the_high_noise_share():
    """--expert both with --high-noise-share P: each sample draws the high-noise expert with
    probability P, then its noise level on that side; without it, one logit-normal draw over both
    sides puts about 3% of samples above 0.875. The trainer hooks refuse the share without both."""
    from deepspeed_knap.models.registry import spec
    from deepspeed_knap.models.wan.finetune import WanTraining
    from deepspeed_knap.training.arguments import TrainingArguments

    g = torch.Generator().manual_seed(0)
    latents = [{"latents": torch.randn(4, 1, 2, 2, generator=g), "encoder_hidden_states": torch.randn(2, 24, generator=g)}
               for _ in range(400)]  # fmt: skip

    def high_share(**draw):
        samples = flow_matching(latents, torch.Generator().manual_seed(1), [1, 2, 2], **draw).samples
        return sum(float(s["timestep"]) >= 875 for s in samples) / len(samples)

    assert high_share() < 0.08  # one draw over both sides: about 3%
    assert high_share(expert_draw=(0.875, 0.0)) == 0 and high_share(expert_draw=(0.875, 1.0)) == 1
    assert 0.4 < high_share(expert_draw=(0.875, 0.5)) < 0.6  # 200 +- 10 (1 sd) of 400
    hooks = WanTraining(spec("wan"))
    hooks.load_model(TrainingArguments(None, family="wan", expert="both", high_noise_share=0.5), {})
    assert hooks.expert_draw == (0.875, 0.5)  # the tiny pipeline's boundary
    for expert in (None, "high"):
        with pytest.raises(ValueError, match=r"--high-noise-share 0\.5: it splits the samples between the two experts"):
            hooks.check_arguments(TrainingArguments(None, family="wan", expert=expert, high_noise_share=0.5))
    with pytest.raises(ValueError, match=r"--high-noise-share 0\.5: FLUX\.1 has one transformer .*; drop it$"):
        spec("flux").hooks().check_arguments(TrainingArguments(None, family="flux", high_noise_share=0.5))
    with pytest.raises(ValueError, match=r"^--expert both and --high-noise-share 0\.5: FLUX\.1 .*; drop them$"):
        spec("flux").hooks().check_arguments(
            TrainingArguments(None, family="flux", expert="both", high_noise_share=0.5)
        )
    with pytest.raises(ValueError, match=r"high_noise_share 1\.5 must lie in \[0, 1\]"):
        TrainingArguments(None, family="wan", high_noise_share=1.5)


def test_image_to_video_samples_feed_the_condition_beside_the_noisy_latents():
    """WanImageToVideoPipeline's input: [noisy latents | first-frame mask | first-frame latents] on
    the channels; the target is the noisy latents' velocity only; the CLIP context goes along."""
    g = torch.Generator().manual_seed(0)
    x0, condition = torch.randn(4, 3, 2, 2, generator=g), torch.randn(8, 3, 2, 2, generator=g)
    image = torch.randn(5, 8, generator=g)
    latent = {"latents": x0, "encoder_hidden_states": torch.randn(2, 24, generator=g), "condition": condition,
              "encoder_hidden_states_image": image}  # fmt: skip
    (sample,), (target,) = (lambda o: (o.samples, o.targets))(flow_matching([latent], g, [1, 2, 2]))
    assert sample["hidden_states"].shape == (12, 3, 2, 2) and torch.equal(sample["hidden_states"][4:], condition)
    assert target.shape == (3 * 1 * 1, 4 * 4) and sample["encoder_hidden_states_image"] is image


def test_ti2v_image_conditioned_clips_keep_the_first_frame_clean_at_timestep_zero_out_of_the_loss():
    """Wan 2.2 TI2V (expand_timesteps): a clip trained image-conditioned has its first latent frame
    clean in the input, those tokens at timestep 0 and weight 0; the rest as text-to-video. An image
    (one latent frame) is never conditioned on itself."""
    g = torch.Generator().manual_seed(0)
    clip = {"latents": torch.randn(4, 3, 4, 2, generator=g), "encoder_hidden_states": torch.randn(2, 24, generator=g)}
    still = {"latents": torch.randn(4, 1, 4, 2, generator=g), "encoder_hidden_states": torch.randn(2, 24, generator=g)}
    objective = flow_matching([clip, still], torch.Generator().manual_seed(1), [1, 2, 2], first_frame_share=1.0)
    (conditioned, image), (weights, image_weights) = objective.samples, objective.weights
    frame = 2 * 1  # tokens of one latent frame: 4 / 2 x 2 / 2
    assert torch.equal(conditioned["hidden_states"][:, :1], clip["latents"][:, :1])
    assert not torch.equal(conditioned["hidden_states"][:, 1:], clip["latents"][:, 1:])
    assert conditioned["timestep"].shape == (3 * frame,) and (conditioned["timestep"][:frame] == 0).all()
    assert (conditioned["timestep"][frame:] > 0).all() and len(set(conditioned["timestep"][frame:].tolist())) == 1
    assert weights.tolist() == [0.0] * frame + [1.0] * 2 * frame and (image_weights == 1).all()
    assert image["timestep"].dim() == 0


def test_synthetic_clips_have_the_mix_sizes_scaled():
    config = {**TINY_WAN, "patch_size": [1, 2, 2]}
    data = SyntheticVideoLatents("wan_image_video", config, token_scale=1 / 64, seed=3)
    shapes = sample_shapes("wan_image_video", 2, seed=3 * 100_003 + 5)[1]
    samples = data.step_samples(5, 1, 2)
    assert len(samples) == len(shapes)
    for shape, sample in zip(shapes, samples, strict=True):
        channels, frames, height, width = sample["latents"].shape
        tokens = frames * (height // 2) * (width // 2)
        assert (channels, frames) == (4, shape.frames)
        assert abs(tokens - shape.visual / 64) <= frames * (math.sqrt(shape.visual / 64 / frames) + 1), (shape, tokens)
        assert sample["encoder_hidden_states"].shape == (shape.cross_text // 64, 24)
    again = SyntheticVideoLatents("wan_image_video", config, token_scale=1 / 64, seed=3).step_samples(5, 1, 2)
    assert all(torch.equal(a["latents"], b["latents"]) for a, b in zip(samples, again, strict=True))


def test_prepared_file_check_names_each_problem(tmp_path):
    config = {**TINY_WAN, "patch_size": [1, 2, 2]}
    good = {"latents": torch.zeros(4, 2, 4, 6), "encoder_hidden_states": torch.zeros(16, 24)}
    cases = {
        "good": (good, None),
        "channels": ({**good, "latents": torch.zeros(6, 2, 4, 6)}, "must be [C, F, H, W] with C = 4 latent channels"),
        "odd": ({**good, "latents": torch.zeros(4, 2, 5, 6)}, "height 5 not a positive multiple of the patch"),
        "text": ({**good, "encoder_hidden_states": torch.zeros(16, 32)}, "must be [Lt >= 1, text_dim = 24]"),
        "rope": ({**good, "latents": torch.zeros(4, 65, 2, 2)}, "exceeds the model's rope_max_seq_len=64"),
    }
    for name, (sample, expected) in cases.items():
        save_video_sample(tmp_path / f"{name}.safetensors", sample)
        problem = check_video_latent_file(tmp_path / f"{name}.safetensors", config)
        if expected is None:
            assert problem is None
        else:
            assert problem.startswith(str(tmp_path / f"{name}.safetensors")) and expected in problem, problem
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    assert "not a readable .safetensors file" in check_video_latent_file(tmp_path / "junk.safetensors", config)
    from safetensors.torch import save_file

    save_file({**good, "img_ids": torch.zeros(3, 3)}, str(tmp_path / "flux.safetensors"))
    assert "a video latent sample for this model holds exactly" in check_video_latent_file(
        tmp_path / "flux.safetensors", config
    )
    # An image-to-video model's samples hold its condition and, with image_dim, the CLIP context.
    i2v = {**config, "in_channels": 12, "out_channels": 4, "image_dim": 8, "added_kv_proj_dim": 72}
    assert "holds exactly ['latents', 'encoder_hidden_states', 'condition', 'encoder_hidden_states_image']" in (
        check_video_latent_file(tmp_path / "good.safetensors", i2v)
    )
    i2v_text = torch.zeros(512, 24)  # Wan 2.1 I2V's text is 512 rows (diffusers splits the context there)
    save_video_sample(tmp_path / "i2v.safetensors", {**good, "encoder_hidden_states": i2v_text,
                                                      "condition": torch.zeros(8, 2, 4, 6),
                                                      "encoder_hidden_states_image": torch.zeros(3, 8)})  # fmt: skip
    assert check_video_latent_file(tmp_path / "i2v.safetensors", i2v) is None
    save_video_sample(tmp_path / "i2v16.safetensors", {**good, "condition": torch.zeros(8, 2, 4, 6),
                                                        "encoder_hidden_states_image": torch.zeros(3, 8)})  # fmt: skip
    assert "takes its text as 512 rows" in check_video_latent_file(tmp_path / "i2v16.safetensors", i2v)
    save_video_sample(tmp_path / "short.safetensors", {**good, "encoder_hidden_states": i2v_text,
                                                        "condition": torch.zeros(8, 1, 4, 6),
                                                        "encoder_hidden_states_image": torch.zeros(3, 8)})  # fmt: skip
    assert "condition [8, 1, 4, 6] must be [8, 2, 4, 6]" in check_video_latent_file(tmp_path / "short.safetensors", i2v)


def test_wan14b_config_fits_wan21_14b_and_its_cap_holds_a_full_size_step():
    """docs/training.md's premises: P is Wan 2.1 14B's, the config prices with its FLOP model, and
    full-size wan_image_video steps on 4 x 8 GPUs (each rank's samples fill up to one 720p 81-frame
    clip, 75,600 tokens) plan every GPU under the 76,800-token cap."""
    from deepspeed_knap.models.registry import default_cost_model, sample_mix
    from deepspeed_knap.planner.solve import plan_routing
    from deepspeed_knap.planner.topology import build_topology
    from deepspeed_knap.runtime.config import get_knapformer_config, load_ds_config

    knap = get_knapformer_config(load_ds_config(str(ROOT / "ds_configs" / "wan14b_zero3_knap.json")))
    ours, flops = knap.cost_model.build(), default_cost_model("wan2.1-14b")
    assert (ours.linear_coef, ours.quadratic_coef, ours.num_heads) == (flops.linear_coef, flops.quadratic_coef, 40)
    with torch.device("meta"):
        model = PackedWanTransformer(num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824,
                                     num_layers=40)  # fmt: skip
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(14.29e9, rel=1e-3)
    topology = build_topology(knap.topology, 32, knap.gpus_per_node)
    for seed in range(3):
        seq_lens = sample_mix("wan_image_video", 32, seed=seed)
        plan = plan_routing(seq_lens, topology, ours, knap.solver, knap.max_tokens_per_gpu)
        assert np.max(plan.gpu_tokens) <= knap.max_tokens_per_gpu


def test_validation_lines_and_one_experts_runs_are_checked_for_the_pipeline_that_renders_them(tmp_path):
    """A text-to-video model's validation line is its prompt (a tab in it too); an image-to-video
    model's must be IMAGE<TAB>PROMPT. One expert of two trains without --validation-every (the
    pipeline renders with both), and its adapter goes to its own folder as the pipeline loads it."""
    from PIL import Image

    from deepspeed_knap.models.registry import spec
    from deepspeed_knap.models.wan.finetune import WanTraining, WanValidation
    from deepspeed_knap.training.arguments import TrainingArguments

    validation = WanValidation(spec("wan"))
    t2v = PackedWanTransformer(**TINY_WAN)
    i2v = PackedWanTransformer(**{**TINY_WAN, "in_channels": 12, "out_channels": 4})
    assert validation.call("a cat\ton a mat", tmp_path, t2v) == {"prompt": "a cat\ton a mat"}
    with pytest.raises(ValueError, match="an image-to-video model renders from an image: write IMAGE<TAB>PROMPT"):
        validation.call("a cat", tmp_path, i2v)
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "cat.png")
    assert validation.call("cat.png\ta cat", tmp_path, i2v)["prompt"] == "a cat"
    hooks = WanTraining(spec("wan"))
    with pytest.raises(ValueError, match="--validation-every with --expert low: validation renders run both experts"):
        hooks.check_arguments(TrainingArguments(None, family="wan", expert="low", validation_every=5,
                                                validation_prompts="p.txt"))  # fmt: skip
    from deepspeed_knap.models.lora import add_lora, lora_config

    model = hooks.load_model(TrainingArguments(None, family="wan", expert="low"), {})
    add_lora(model, rank=2, alpha=2)
    assert lora_config(model) is not None
    [(path, load)] = hooks.save_adapters(model, model.state_dict(), tmp_path / "lora")
    assert path.parent == tmp_path / "lora" / "transformer_2" and load == {"load_into_transformer_2": True}


def test_a_pipeline_folder_is_read_once_at_the_checks_and_two_experts_need_their_boundary(tmp_path):
    """``check_arguments`` (which the trainer runs where the ranks agree on its errors) reads
    ``model_index.json``; ``load_model`` builds from what it read, not from a second read that one
    rank might see otherwise. Two experts without ``boundary_ratio`` are refused there, naming the
    file and the fix (else one expert trained on a range of ``(0, None)``, a TypeError at its first
    objective)."""
    import json

    from deepspeed_knap.models.registry import spec
    from deepspeed_knap.models.wan.finetune import WanTraining
    from deepspeed_knap.training.arguments import TrainingArguments

    index = tmp_path / "model_index.json"
    index.write_text(json.dumps({"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
                                 "transformer_2": ["diffusers", "WanTransformer3DModel"]}))  # fmt: skip
    for expert in (None, "high", "low", "both"):
        with pytest.raises(ValueError, match=re.escape(f"{index} names transformer_2 but no boundary_ratio")):
            WanTraining(spec("wan")).check_arguments(TrainingArguments(None, model_path=str(tmp_path), expert=expert))
    # One expert's folder of such a pipeline, alone, would train on every noise level: refused,
    # naming the pipeline and the --expert that trains it on its side of the boundary.
    index.write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.875,
                                 "transformer": ["diffusers", "WanTransformer3DModel"],
                                 "transformer_2": ["diffusers", "WanTransformer3DModel"]}))  # fmt: skip
    for folder, side in (("transformer", "high"), ("transformer_2", "low")):
        (tmp_path / folder).mkdir()
        with pytest.raises(ValueError, match=re.escape(f"give --model-path {tmp_path} --expert {side}")):
            WanTraining(spec("wan")).check_arguments(TrainingArguments(None, model_path=str(tmp_path / folder)))
    index.write_text(json.dumps({"_class_name": "WanPipeline", "expand_timesteps": True}))
    WanTraining(spec("wan")).check_arguments(TrainingArguments(None, model_path=str(tmp_path / "transformer")))
    hooks = WanTraining(spec("wan"))
    hooks.check_arguments(TrainingArguments(None, model_path=str(tmp_path), first_frame_share=0.25))
    index.unlink()  # a second read would find no expand_timesteps (nor, for a rank, any file)
    assert hooks._pipeline_config(str(tmp_path)) == (None, False, True)


def test_ti2v_validation_renders_an_image_line_as_diffusers_generates_from_an_image(tmp_path):
    """Wan 2.2 TI2V (a pipeline folder with expand_timesteps) trains image-conditioned, and its
    validation line IMAGE<TAB>PROMPT was rendered as the text prompt "IMAGE<TAB>PROMPT". An image
    line now renders through WanImageToVideoPipeline of the same parts with expand_timesteps, a
    text line through WanPipeline with expand_timesteps (the parts alone dropped it): each clip is
    the one diffusers' own pipeline gives, called directly."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    from deepspeed_knap.models.registry import spec
    from deepspeed_knap.models.wan.data import tiny_wan_pipeline
    from deepspeed_knap.models.wan.finetune import WanValidation, write_gif

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "expand_timesteps": True}))
    validation = WanValidation(spec("wan"), str(tmp_path))
    model = PackedWanTransformer(**TINY_WAN)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "cat.png")
    image_call, text_call = (validation.call(line, tmp_path, model) for line in ("cat.png\ta cat", "a dog"))
    assert image_call["prompt"] == "a cat" and image_call["image"].size == (32, 32) and text_call == {"prompt": "a dog"}
    components = tiny_wan_pipeline(TINY_WAN["text_dim"], TINY_WAN["in_channels"], seed=0).components
    transformers = type(model).pipeline_transformers(model.config, model.state_dict())
    pipe = validation.build_pipeline(model, {k: v for k, v in components.items() if "transformer" not in k},
                                     transformers)  # fmt: skip
    assert type(pipe) is WanPipeline and pipe.config.expand_timesteps
    options = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0, max_sequence_length=8)
    for name, call, reference in (("image", image_call, WanImageToVideoPipeline), ("text", text_call, WanPipeline)):
        ours = validation.render(pipe, call, torch.Generator().manual_seed(3), options, tmp_path / name)
        theirs = reference(**pipe.components, expand_timesteps=True)(
            **call, generator=torch.Generator().manual_seed(3), output_type="np", **options
        ).frames[0]
        # (at TI2V-5B's 24 frames per second)
        assert ours.read_bytes() == write_gif(theirs, tmp_path / f"{name}_theirs.gif", 24).read_bytes(), name


def test_resuming_one_expert_from_the_others_checkpoint_is_refused(monkeypatch, tmp_path):
    """Wan 2.2 A14B's two experts have the same parameter names and shapes: a checkpoint records the
    expert it trained, and a resume with the other (or both) is refused naming the --expert to give,
    from the manifest before DeepSpeed loads anything, and from the files' own record after
    (DeepSpeed had loaded one expert's weights and optimizer into the other's run)."""
    from types import SimpleNamespace

    from deepspeed_knap.training import trainer as trainer_module
    from deepspeed_knap.training.trainer import Trainer, TrainingError

    saved = {"step": 4, "data_position": 8, "lora_alpha": None, "expert": "high"}
    choice = SimpleNamespace(tag="step4", load_dir=str(tmp_path), skipped=[], given=True, manifest={"metadata": saved})
    loads = []
    monkeypatch.setattr(trainer_module, "find_checkpoint", lambda path: choice)
    monkeypatch.setattr(trainer_module, "load_checkpoint",
                        lambda engine, load_dir, tag: loads.append(tag) or (None, dict(saved)))  # fmt: skip
    monkeypatch.setattr(trainer_module, "check_same_on_every_rank", lambda views: None)

    def raise_alone(problem):
        if problem:
            raise TrainingError(problem)

    def resume(expert):
        run = SimpleNamespace(arguments=SimpleNamespace(resume=str(tmp_path), data_dir=None), rank=1, engine=None,
                              hooks=SimpleNamespace(expert=expert), raise_together=raise_alone,
                              _lora_alpha=lambda: None, _data_order=lambda: None,
                              _data_files=lambda: None)  # fmt: skip
        run._saved_run_problem = lambda recorded, tag: Trainer._saved_run_problem(run, recorded, tag)
        Trainer._resume(run)
        return run

    assert resume("high").start_step == 4 and loads == ["step4"]
    for other, now in (("low", "--expert low"), (None, "both experts (or one transformer)")):
        with pytest.raises(TrainingError, match=re.escape(f"was trained with --expert high and this run trains {now}")):
            resume(other)
    assert loads == ["step4"]  # refused before the load, from the manifest
    choice.manifest = {}  # no manifest record: the files' own, after the load
    with pytest.raises(TrainingError, match="resume with --expert high"):
        resume("low")
    saved.pop("expert")  # a checkpoint saved before the expert was recorded: resumed as before
    assert resume("low").start_step == 4


def test_a_gif_plays_at_16_frames_per_second(tmp_path):
    """A GIF holds delays in hundredths of a second: one delay of 6 for every frame played 81 frames
    in 4.86 s (16.7 fps); each frame ends at its time at 16 fps rounded, 5.06 s for 81."""
    from PIL import Image

    from deepspeed_knap.models.wan.finetune import write_gif

    frames = np.random.default_rng(0).random((81, 8, 8, 3))
    with Image.open(write_gif(frames, tmp_path / "clip.gif", 16)) as gif:
        durations = []
        for index in range(gif.n_frames):
            gif.seek(index)
            durations.append(gif.info["duration"])
    assert durations[:4] == [60, 60, 70, 60] and sum(durations) == 5060  # 81 / 16 = 5.0625 s
