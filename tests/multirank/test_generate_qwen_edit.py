"""Balanced Qwen-Image edits on gloo ranks: every edited image equals diffusers'
``QwenImageEditPlusPipeline(...)(image=[...], prompt, ...)`` run alone for that request with the same
seed (tiny parts, fp64 transformer, 1e-6), on 2 ranks (Edit-2509's transformer) and 4 (Edit-2511's,
``zero_cond_t``), with edits of one and two references, with and without true CFG, joining and
leaving under a token budget.

At the pipeline's own sizes (references at ~1 megapixel) a tiny step takes seconds on a CPU, so its
module's ``CONDITION_IMAGE_SIZE`` and ``VAE_IMAGE_SIZE`` are shrunk on every rank and for the
reference run alike: the generator reads them from the module at each call, as the pipeline does.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.generation import check_outputs_and_records, reference_image, write_reference_images

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

# The vision-language encoder's images at ~112 x 112 px of area (the tiny processor's 112 x 112 at
# most: 14 to 16 vision tokens each), the VAE's at ~48 x 48 (sides rounded to 32 px).
CONDITION_IMAGE_SIZE = 112 * 112
VAE_IMAGE_SIZE = 48 * 48
REFERENCE_IMAGES = {"square.png": (64, 64), "wide.png": (40, 120), "tall.png": (90, 60)}  # (height, width) px
# Tiny Qwen-Image: a 4x VAE and 2x2 patches, 8 px a token. A reference is VAE-encoded at square.png
# 64x64 px (64 tokens), wide.png 32x96 (48), tall.png 64x32 (32). Each branch's text is the
# character tokenizer's long system prompt with a "Picture i:" block per reference, its vision
# tokens (square 16, wide 14, tall 15) and the prompt (the negative prompt's for the unconditional
# branch), less the 64 tokens dropped: about 300 rows.
REQUESTS = [
    {"id": "one", "prompt": "make it red", "image": "square.png", "height": 32, "width": 48, "steps": 3, "seed": 1},
    {"id": "two", "prompt": "put them together", "image": ["wide.png", "square.png"], "negative_prompt": " ",
     "height": 40, "width": 40, "steps": 2, "seed": 2},
    {"id": "cfg", "prompt": "in winter", "image": "tall.png", "negative_prompt": "blurry", "true_cfg_scale": 2.5,
     "height": 48, "width": 32, "steps": 4, "seed": 3},
    {"id": "small", "prompt": "a dot", "image": ["square.png", "tall.png"], "height": 16, "width": 24, "steps": 2,
     "seed": 4},
    {"id": "late", "prompt": "the sea", "image": "wide.png", "height": 24, "width": 40, "steps": 3, "seed": 5},
]  # fmt: skip
# Sequences (text + target + references): "one" 309 + 24 + 64; "two" (true CFG: the negative " ") 342
# + 25 + 48 + 64 and 326 + 25 + 112; "cfg" 306 + 24 + 32 and 303 + 56; "small" 331 + 6 + 64 + 32;
# "late" 303 + 15 + 48.
SEQ_LENS = {"one": (397,), "two": (479, 463), "cfg": (362, 359), "small": (433,), "late": (366,)}
# Tokens per GPU: 2 ranks x 700 (4 ranks x 350) = 1,400 at a time of the file's 2,859 a step.
BUDGET = 1400
ZERO_COND_T = {2: False, 4: True}  # Edit-2509's transformer on 2 ranks, Edit-2511's on 4


def _shrink(module) -> None:
    module.CONDITION_IMAGE_SIZE, module.VAE_IMAGE_SIZE = CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE


def _tiny(zero_cond_t: bool):
    from deepspeed_knap.models.qwenimage.generate import QwenImageEditPlusGenerator
    from deepspeed_knap.models.qwenimage.spec import TINY_QWEN_IMAGE

    return QwenImageEditPlusGenerator.tiny(torch.float64, "cpu", seed=0,
                                           config={**TINY_QWEN_IMAGE, "zero_cond_t": zero_cond_t})  # fmt: skip


@pytest.fixture(scope="module")
def request_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen_edit_generate")
    write_reference_images(directory, REFERENCE_IMAGES)
    (directory / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    return directory / "requests.jsonl"


@pytest.fixture(scope="module")
def references():
    """``references(zero_cond_t)``: ``QwenImageEditPlusPipeline`` of the tiny generator's parts and
    transformer weights (fp64) on each request alone, at the shrunk sizes; once per transformer."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    images: dict[bool, dict] = {}

    def of(zero_cond_t: bool) -> dict:
        if zero_cond_t in images:
            return images[zero_cond_t]
        ours = _tiny(zero_cond_t)
        transformer = type(ours.model).diffusers_model(ours.model.config, ours.model.state_dict())
        assert transformer.config.zero_cond_t == zero_cond_t
        parts = {key: part for key, part in ours.pipeline.components.items() if key != "transformer"}
        pipe = QwenImageEditPlusPipeline(**parts, transformer=transformer).to(torch.float64)
        pipe.set_progress_bar_config(disable=True)
        images[zero_cond_t] = {}
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipeline_qwenimage_edit_plus, "CONDITION_IMAGE_SIZE", CONDITION_IMAGE_SIZE)
            patch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", VAE_IMAGE_SIZE)
            for r in REQUESTS:
                names = [r["image"]] if isinstance(r["image"], str) else r["image"]
                options = {key: r[key] for key in ("negative_prompt", "true_cfg_scale") if key in r}
                output = pipe(image=[reference_image(REFERENCE_IMAGES, name) for name in names], prompt=r["prompt"], height=r["height"],
                              width=r["width"], num_inference_steps=r["steps"], output_type="np",
                              generator=torch.Generator().manual_seed(r["seed"]), **options)  # fmt: skip
                images[zero_cond_t][r["id"]] = output.images[0]
        return images[zero_cond_t]

    return of


def _generate(rank: int, world: int, path: str, budget: int, zero_cond_t: bool) -> dict:
    """The request file through ``generate`` at the shrunk sizes (this rank's process alone), on a
    balancer whose cost model splits sequences over groups (attention only, free all-to-alls); the
    group sizes the plans used."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    from tests.support.balancing import join_gloo
    from tests.support.generation import generate_recording_groups

    _shrink(pipeline_qwenimage_edit_plus)
    join_gloo(rank)
    return generate_recording_groups(path, _tiny(zero_cond_t), budget)


@pytest.mark.parametrize("world", sorted(ZERO_COND_T))
def test_each_edit_equals_the_edit_plus_pipeline_alone_with_joins_and_leaves(request_file, references, world):
    results = run_distributed(_generate, world, args=(str(request_file), BUDGET // world, ZERO_COND_T[world]),
                              timeout=300)  # fmt: skip
    expected = references(ZERO_COND_T[world])
    check_outputs_and_records(results, expected, REQUESTS, SEQ_LENS, world)
    assert all(expected[r["id"]].std() > 0.01 for r in REQUESTS)  # not flat images
