"""Balanced generation of the Wan pipelines people generate with, on gloo ranks: Wan 2.2 A14B
text-to-video (two experts, ``guidance_2``), Wan 2.1 I2V (CLIP image context), Wan 2.2 I2V-A14B and
Wan 2.2 TI2V-5B (image-conditioned and text-only requests in one file). Tiny pipelines of each kind
are saved to folders and loaded by ``load_wan_generator`` as ``deepspeed-knap generate`` loads them;
every video equals the diffusers pipeline loaded from the same folder and run alone for that request
(``WanImageToVideoPipeline`` for TI2V-5B's image requests, as diffusers runs them), fp64 transformers,
1e-6, on 2 and 4 ranks, with requests joining and leaving under a token budget. Requests at different
steps run different experts in the same forward.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.wan_cases import WAN22_KINDS, save_wan22_pipeline

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("ftfy")  # WanImageToVideoPipeline cleans prompts with it

TEXT = {"max_sequence_length": 8}  # Wan 2.1 I2V takes 512 (its attention splits the context there)
# Tiny Wan: an 8x VAE (4x in time) and 1x2x2 patches, one video token per 16x16 px of a latent frame.
# Mixed sizes, frames and steps; guidance 1 runs one sequence a step, above 1 two. The two-expert
# pipelines switch at timestep 500 (boundary_ratio 0.5): a request's first steps run the high-noise
# expert, its last the low-noise one, while others at other steps run the other.
REQUESTS = {
    "a14b": [  # "b" and "d" start; "a" joins when "b" leaves, at the step "d" switches experts
        {"id": "b", "prompt": "a dog", "height": 32, "width": 32, "frames": 5, "steps": 2, "seed": 2, **TEXT},
        {"id": "d", "prompt": "the green dog", "negative_prompt": "blue", "height": 16, "width": 32, "frames": 5,
         "steps": 4, "seed": 4, **TEXT},
        {"id": "a", "prompt": "a red cat", "height": 32, "width": 48, "frames": 9, "steps": 4, "seed": 1,
         "guidance": 4.0, "guidance_2": 2.0, **TEXT},
        {"id": "c", "prompt": "bird video", "height": 48, "width": 64, "frames": 9, "steps": 2, "seed": 3,
         "guidance": 1.0, **TEXT},
    ],
    "i2v21": [
        {"id": "a", "prompt": "a red cat", "image": "wide.png", "height": 32, "width": 48, "frames": 5, "steps": 3,
         "seed": 1},
        {"id": "b", "prompt": "a dog", "image": "square.png", "height": 32, "width": 32, "frames": 9, "steps": 2,
         "seed": 2, "guidance": 1.0},
        {"id": "c", "prompt": "bird video", "negative_prompt": "blue", "image": "wide.png", "height": 48,
         "width": 32, "frames": 5, "steps": 4, "seed": 3},
    ],
    "i2v_a14b": [  # "b" and "c" start; "a" joins when "b" leaves, as "c" switches experts
        {"id": "b", "prompt": "a dog", "image": "square.png", "height": 32, "width": 32, "frames": 5, "steps": 2,
         "seed": 2, **TEXT},
        {"id": "c", "prompt": "the blue bird", "image": "square.png", "height": 16, "width": 48, "frames": 5,
         "steps": 4, "seed": 3, "guidance": 1.0, **TEXT},
        {"id": "a", "prompt": "a red cat", "image": "wide.png", "height": 32, "width": 48, "frames": 9, "steps": 4,
         "seed": 1, "guidance_2": 3.0, **TEXT},
    ],
    "ti2v": [
        {"id": "a", "prompt": "a red cat", "image": "wide.png", "height": 32, "width": 48, "frames": 9, "steps": 3,
         "seed": 1, **TEXT},
        {"id": "b", "prompt": "a dog", "height": 32, "width": 32, "frames": 5, "steps": 4, "seed": 2, **TEXT},
        {"id": "c", "prompt": "bird video", "image": "square.png", "height": 48, "width": 32, "frames": 5,
         "steps": 2, "seed": 3, "guidance": 1.0, **TEXT},
        {"id": "d", "prompt": "the green dog", "height": 16, "width": 32, "frames": 1, "steps": 3, "seed": 4, **TEXT},
    ],
}  # fmt: skip
IMAGES = {"wide.png": (40, 56), "square.png": (24, 24)}  # (height, width): resized by the pipeline
# Tokens per GPU: 2 ranks x 24 (4 ranks x 12) = 48 at a time, fewer than each file's requests need
# together (a14b: 16 + 8 + 36 + 36 video tokens a step), so requests wait and join as others leave.
# Timesteps of the tiny pipelines' UniPC: 2 steps 999, 500; 3 steps 999, 666, 333; 4 steps 999,
# 749, 500, 250.
BUDGET = 48


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    """Each kind's pipeline folder and request file (images beside it); diffusers' videos per kind."""
    from PIL import Image

    d = tmp_path_factory.mktemp("wan22_generate")
    for index, (name, (height, width)) in enumerate(IMAGES.items()):
        pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(d / name)
    references = {}
    for kind, requests in REQUESTS.items():
        save_wan22_pipeline(d / kind, WAN22_KINDS[kind])
        (d / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
        references[kind] = _references(d, kind)
    return d, references


def _load_reference(path, pipeline_class: str):
    import diffusers
    from transformers import CLIPVisionModel

    parts = {"vae": diffusers.AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)}
    if (path / "image_encoder").is_dir():
        parts["image_encoder"] = CLIPVisionModel.from_pretrained(path, subfolder="image_encoder",
                                                                 torch_dtype=torch.float32)  # fmt: skip
    pipe = getattr(diffusers, pipeline_class).from_pretrained(path, **parts, torch_dtype=torch.float64)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _references(d, kind: str) -> dict[str, np.ndarray]:
    """diffusers' pipeline loaded from the kind's folder (transformers fp64, the VAE and CLIP fp32, as
    ``load_wan_generator``), run alone on each request."""
    from PIL import Image

    pipes = {}
    videos = {}
    for r in REQUESTS[kind]:
        # TI2V-5B's image requests run through WanImageToVideoPipeline (diffusers' TI2V example).
        name = "WanImageToVideoPipeline" if "image" in r else WAN22_KINDS[kind]["pipeline"]
        if name not in pipes:
            pipes[name] = _load_reference(d / kind, name)
        options = {"guidance_scale": r["guidance"]} if "guidance" in r else {}
        options.update({key: r[key] for key in ("negative_prompt", "max_sequence_length") if key in r})
        if "guidance_2" in r:
            options["guidance_scale_2"] = r["guidance_2"]
        if "image" in r:
            options["image"] = Image.open(d / r["image"]).convert("RGB")
        output = pipes[name](prompt=r["prompt"], height=r["height"], width=r["width"], num_frames=r["frames"],
                             num_inference_steps=r["steps"], generator=torch.Generator().manual_seed(r["seed"]),
                             output_type="np", **options)  # fmt: skip
        videos[r["id"]] = output.frames[0]
    return videos


def _generate(rank: int, world: int, d, budget: int) -> dict:
    """Every kind's request file through ``generate`` on a balancer whose cost model splits sequences
    over groups (attention only, free all-to-alls); which experts each forward ran."""
    from deepspeed_knap.cost.model import CostModel
    from deepspeed_knap.generation.runner import generate, generation_balancer
    from deepspeed_knap.models.wan.experts import PackedWanExperts
    from deepspeed_knap.models.wan.generate import load_wan_generator
    from tests.support.balancing import join_gloo

    join_gloo(rank)
    experts_per_forward = []
    expert_of = PackedWanExperts.expert_of

    def recording_expert_of(self, inputs):
        experts = expert_of(self, inputs)
        experts_per_forward.append(sorted(set(experts.tolist())))
        return experts

    PackedWanExperts.expert_of = recording_expert_of
    results = {}
    for kind in REQUESTS:
        experts_per_forward.clear()
        generator = load_wan_generator(d / kind, torch.float64, "cpu")
        balancer = generation_balancer(generator.model, max_tokens_per_gpu=budget,
                                       cost_model=CostModel(linear_coef=0.0, quadratic_coef=1.0))  # fmt: skip
        sizes = set()
        begin_step = balancer.begin_step

        def recording_begin_step(request_set, plan, seq_lens_per_rank, begin_step=begin_step, sizes=sizes):
            sizes.update(int(size) for size in plan.seq_group_size)
            begin_step(request_set, plan, seq_lens_per_rank)

        balancer.begin_step = recording_begin_step
        videos = {}
        report = generate(str(d / f"{kind}.jsonl"), generator, balancer, progress=False,
                          on_image=lambda r, video, videos=videos: videos.__setitem__(r.id, video))  # fmt: skip
        results[kind] = {"videos": videos, "first_steps": {r["id"]: r["first_step"] for r in report.requests},
                         "group_sizes": sorted(sizes), "experts": list(experts_per_forward)}  # fmt: skip
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_each_kind_equals_the_pipeline_per_request_with_joins_and_leaves(pipelines, world):
    d, references = pipelines
    by_rank = run_distributed(_generate, world, args=(d, BUDGET // world), timeout=300)
    for kind, requests in REQUESTS.items():
        results = [ranks[kind] for ranks in by_rank]
        videos = {name: video for result in results for name, video in result["videos"].items()}
        assert sorted(videos) == sorted(r["id"] for r in requests), kind
        for name, video in videos.items():
            expected = references[kind][name]
            assert video.shape == expected.shape, (kind, name)
            assert np.abs(video - expected).max() < 1e-6, (kind, name, np.abs(video - expected).max())
        first_steps = {name: step for result in results for name, step in result["first_steps"].items()}
        assert max(first_steps.values()) > 0, kind  # some joined after the start
        assert max(size for result in results for size in result["group_sizes"]) > 1, kind
        if WAN22_KINDS[kind]["experts"] == 2:
            # Some forward (the ranks run them in step) ran both experts: requests at different steps.
            per_forward = [set().union(*step) for step in zip(*(result["experts"] for result in results), strict=True)]
            assert {0, 1} in per_forward, (kind, per_forward)
