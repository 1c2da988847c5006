"""Balanced FLUX.3 generation on gloo ranks: every image equals diffusers' modular FLUX.3 pipeline
(``Flux3AutoBlocks`` without the prompt upsampler, the guider at the request's scale) run alone for
that request with the same seed (tiny parts, fp64 transformer, 1e-6), on 2 and 4 ranks, with
requests of mixed sizes, text lengths and step counts joining and leaving under a token budget:
classifier-free guidance's two branches (of different text lengths) and requests without it (guidance
1), edits of one reference image (sized by it and cropped back, or at a given size) and of two.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.generation import check_outputs_and_records, reference_image, write_reference_images

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

# Tiny FLUX.3: a 2x VAE and 2x2 patches, one token per 4x4 px; text padded to 80 tokens (a prompt of
# more than 80 with the chat template: 160), the negative prompt's ("" unless given) its own 80.
# Sequences (text + image + references): "wide" 2 x (80 + 96), "small" 80 + 16, "tall" 2 x (80 +
# 128), "long" 160 + 36; "edit" is one 24x40 px reference kept whole on its 64x64 canvas (256
# tokens), the image that canvas (256) and cropped back to 24x40 px: 2 x (80 + 512); "edits" two
# references, each cropped to the 16 px grid (64x48 px: 192 tokens; 16x32 px: 32): 80 + 48 + 224;
# "framed" one 70x52 px reference on its 80x64 canvas (320 tokens) at a given size (no crop-back):
# 2 x (80 + 64 + 320).
REQUESTS = [
    {"id": "wide", "prompt": "a wide red barn", "height": 32, "width": 48, "steps": 4, "seed": 1},
    {"id": "small", "prompt": "a cat", "height": 16, "width": 16, "steps": 2, "seed": 2, "guidance": 1.0},
    {"id": "tall", "prompt": "a tall tower at night", "negative_prompt": "blurry", "height": 64, "width": 32,
     "steps": 3, "seed": 3, "guidance": 5.0},
    {"id": "long", "prompt": "a long description of a quiet harbour at dawn, with boats, gulls, ropes and a "
     "lighthouse", "height": 24, "width": 24, "steps": 2, "seed": 4, "guidance": 1.0},
    {"id": "edit", "prompt": "the same scene in blue", "image": "ref_a.png", "steps": 2, "seed": 5},
    {"id": "edits", "prompt": "both together", "image": ["ref_b.png", "ref_a.png"], "height": 24, "width": 32,
     "steps": 3, "seed": 6, "guidance": 1.0},
    {"id": "framed", "prompt": "framed", "image": "ref_b.png", "height": 32, "width": 32, "steps": 2, "seed": 7,
     "guidance": 2.0},
]  # fmt: skip
REFERENCE_IMAGES = {"ref_a.png": (24, 40), "ref_b.png": (70, 52)}  # (height, width) px
SEQ_LENS = {"wide": (176, 176), "small": (96,), "tall": (208, 208), "long": (196,), "edit": (592, 592),
            "edits": (352,), "framed": (464, 464)}  # fmt: skip
# Tokens per GPU: 2 ranks x 640 (4 ranks x 320) = 1,280 at a time, of the file's 3,524 a step: "wide",
# "small" and "tall" start, the others wait and join as they leave.
BUDGET = 1280


@pytest.fixture(scope="module")
def request_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("flux3_generate")
    write_reference_images(d, REFERENCE_IMAGES)
    (d / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    return d / "requests.jsonl"


@pytest.fixture(scope="module")
def references():
    """The modular pipeline (``Flux3AutoBlocks`` less the prompt upsampler, its tiny parts built anew
    and the tiny generator's transformer weights, all fp64) on each request alone."""
    from diffusers import ClassifierFreeGuidance, Flux3Transformer2DModel
    from diffusers.modular_pipelines import Flux3AutoBlocks

    from deepspeed_knap.models.flux3.generate import tiny_flux3_pipeline_components
    from deepspeed_knap.models.flux3.spec import TINY_FLUX3
    from deepspeed_knap.models.generators import tiny_generator

    ours = tiny_generator("flux3", torch.float64, "cpu", seed=0)
    transformer = Flux3Transformer2DModel(**TINY_FLUX3)
    transformer.load_state_dict(ours.model.state_dict())
    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline()
    pipe.update_components(**tiny_flux3_pipeline_components(TINY_FLUX3, 0), transformer=transformer)
    pipe.to(torch.float64)
    pipe.set_progress_bar_config(disable=True)
    images = {}
    for r in REQUESTS:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=r.get("guidance", 3.5)))
        options = {key: r[key] for key in ("height", "width", "negative_prompt") if key in r}
        if "image" in r:
            names = [r["image"]] if isinstance(r["image"], str) else r["image"]
            options["image"] = [reference_image(REFERENCE_IMAGES, name) for name in names]
        images[r["id"]] = pipe(prompt=r["prompt"], num_inference_steps=r["steps"], output_type="np", output="images",
                               generator=torch.Generator().manual_seed(r["seed"]), **options)[0]  # fmt: skip
    return images


def _generate(rank: int, world: int, path: str, budget: int) -> dict:
    """The request file through ``generate`` on a balancer whose cost model splits sequences over
    groups (attention only, free all-to-alls); the group sizes the plans used."""
    from deepspeed_knap.models.generators import tiny_generator
    from tests.support.balancing import join_gloo
    from tests.support.generation import generate_recording_groups

    join_gloo(rank)
    return generate_recording_groups(path, tiny_generator("flux3", torch.float64, "cpu", seed=0), budget)


@pytest.mark.parametrize("world", [2, 4])
def test_each_image_equals_the_modular_pipeline_alone_with_joins_and_leaves(request_file, references, world):
    results = run_distributed(_generate, world, args=(str(request_file), BUDGET // world), timeout=300)
    check_outputs_and_records(results, references, REQUESTS, SEQ_LENS, world)
    images = {name: image for result in results for name, image in result["images"].items()}
    assert images["edit"].shape == (24, 40, 3)  # sized by its reference's canvas, cropped back to it
