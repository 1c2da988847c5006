"""FLUX.3 generation in one process: what the intake counts of a request (text padded as the text
encoder step pads it, image and reference tokens as the modular pipeline prepares them) is what
``start`` packs; the keys and inputs it refuses; and ``deepspeed-knap generate --model-path`` of a
saved FLUX.3 folder, loaded by the modular pipeline, writing what the modular pipeline draws."""

from __future__ import annotations

import functools
import json
import re

import numpy as np
import pytest
import torch

from deepspeed_knap.generation.requests import RequestError, parse_request

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

# Tiny FLUX.3: a 2x VAE and 2x2 patches, one token per 4x4 px; the chat template adds 19 tokens
# (characters and markers) to the prompt's characters, and the text is padded to a multiple of 80.
LONG = "x" * 70  # 89 tokens templated: 160 rows
IMAGES = {"wide.png": (24, 40), "tall.png": (70, 52), "dot.png": (10, 30)}  # (height, width) px


@functools.cache
def _generator(dtype: torch.dtype = torch.float32):
    from deepspeed_knap.models.generators import tiny_generator

    return tiny_generator("flux3", dtype, "cpu", seed=0)


def _diffusers_transformer(generator):
    """diffusers' ``Flux3Transformer2DModel`` of the generator's packed weights."""
    model = generator.model
    return type(model).diffusers_model({key: model.config[key] for key in model.config_keys()}, model.state_dict())


@pytest.fixture
def images(tmp_path):
    from PIL import Image

    for index, (name, (height, width)) in enumerate(IMAGES.items()):
        pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / name)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    return tmp_path


@pytest.mark.parametrize(("fields", "expected"), [
    ({"height": 32, "width": 48}, (80 + 96, 80 + 96)),  # guidance 3.5 (the guider's): the negative "" too
    ({"height": 32, "width": 48, "guidance": 1.0}, (80 + 96,)),  # the guider runs no second branch at 1
    ({"prompt": LONG, "negative_prompt": "blurry", "height": 16, "width": 16}, (160 + 16, 80 + 16)),
    ({"prompt": LONG, "height": 16, "width": 16, "max_sequence_length": 100}, (100 + 16, 80 + 16)),  # truncated
    ({"height": 16, "width": 16, "max_sequence_length": 12, "guidance": 0.5}, (12 + 16, 12 + 16)),
    # One reference kept whole: 24x40 px on its 64x64 canvas, the image that canvas (cropped back).
    ({"image": "wide.png", "guidance": 1.0}, (80 + 256 + 256,)),
    ({"image": "tall.png", "height": 32, "guidance": 1.0}, (80 + 8 * 16 + 20 * 16,)),  # width: the canvas's 64
    # Several, each cropped to the 16 px grid: 64x48 and 16x32 px; the image the first one's size.
    ({"image": ["tall.png", "wide.png"], "guidance": 1.0}, (80 + 2 * 16 * 12 + 4 * 8,)),
])  # fmt: skip
def test_the_intake_counts_what_start_packs_and_the_text_encoder_gives(images, fields, expected):
    generator = _generator()
    request = parse_request(0, 1, json.dumps({"prompt": "a cat", **fields}), images, default_steps=28)
    assert generator.request_seq_lens(request) == expected
    state = generator.start(request)
    assert tuple(generator.model.pack(state.samples()).seq_lens) == expected
    assert (state.guidance_scale is None) == (len(expected) == 1)
    texts = [branch["encoder_hidden_states"].shape[0] for branch in state.branches]
    assert [branch["txt_ids"][:, 3].tolist() for branch in state.branches] == [list(range(n)) for n in texts]
    # A box to crop back to: a single reference's, when the request gives no size (several: [None, None]).
    cropped = any(box is not None for box in state.reference_crop or [])
    assert cropped == (isinstance(fields.get("image"), str) and "height" not in fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"embeddings": "e.safetensors"}, "encodes its prompt itself (the text's length is the prompt's, padded to a "
     "multiple of 80 tokens): give 'prompt', not 'embeddings'"),
    ({"frames": 1}, "FLUX.3 makes images: drop 'frames'"),
    ({"true_cfg_scale": 2.0}, "FLUX.3's 'guidance' is its classifier-free guidance scale (default 3.5): drop "
     "'true_cfg_scale'"),
    ({"guidance_2": 2.0}, "FLUX.3 takes 'guidance': drop 'guidance_2'"),
    ({"guidance": 1.0, "negative_prompt": "blurry"}, "'negative_prompt' does nothing at guidance 1.0"),
    ({"height": 30}, "30x48 px: FLUX.3's VAE (2x) and 2x2 patches need height and width in multiples of 4 px (the "
     "pipeline refuses others); e.g. 32x48"),
    ({"max_sequence_length": 200000}, "max_sequence_length 200000 is over the text encoder's 128000 positions"),
    ({"image": "missing.png"}, "cannot read image"),
    ({"image": "broken.png"}, "cannot read image"),
    ({"image": ["wide.png", "dot.png"]}, "dot.png is 30x10 px: with several references FLUX.3's pipeline crops each "
     "to its 16 px grid; give images of at least 16 px a side"),
])  # fmt: skip
def test_the_intake_refuses_what_flux3_does_not_take_naming_the_line_and_the_fix(images, fields, message):
    base = {"prompt": "a cat", "height": 32, "width": 48}
    if "embeddings" in fields:
        base.pop("prompt")
    request = parse_request(0, 4, json.dumps({**base, **fields}), images, default_steps=28)
    with pytest.raises(RequestError, match=re.escape(message)) as error:
        _generator().request_seq_lens(request)
    assert str(error.value).startswith("line 4: ")


def test_one_reference_alone_is_cropped_back_and_a_single_small_one_is_padded(images):
    """A single reference smaller than the 16 px grid is mirrored onto its 64x64 canvas (the pipeline
    pads, where several would be cropped to nothing); the image is cropped back to 30x10 px."""
    generator = _generator()
    request = parse_request(0, 1, json.dumps({"prompt": "a dot", "image": "dot.png", "steps": 1, "guidance": 1.0}),
                            images, default_steps=28)  # fmt: skip
    assert generator.request_seq_lens(request) == (80 + 256 + 256,)
    state = generator.start(request)
    state.advance(generator.model.forward_samples(state.samples()))
    assert generator.decode(state).shape == (10, 30, 3)


def test_generate_command_loads_a_flux3_folder_and_writes_what_the_modular_pipeline_draws(images, monkeypatch):
    """``--model-path`` of a FLUX.3 folder (a modular pipeline's: no ``model_index.json``): the
    transformer's family picks FLUX.3, the modular pipeline loads the other parts; the PNGs are the modular pipeline's own (``output_type="pil"``) for each
    request alone. Without torchvision no Qwen3-VL processor can be built, so ``AutoProcessor`` gives
    the folder's tokenizer in the processor's place (what the text encoder step uses of it)."""
    from PIL import Image

    from deepspeed_knap.cli import main
    from tests.support.flux3_cases import save_flux3_folder, tokenizer_as_processor

    generator = _generator(torch.float64)
    save_flux3_folder(images / "flux3", generator)
    tokenizer_as_processor(monkeypatch)
    lines = [{"id": "cat", "prompt": "a cat", "height": 16, "width": 24, "steps": 2, "seed": 3},
             {"id": "edit", "prompt": "in blue", "image": "wide.png", "steps": 2, "seed": 4, "guidance": 2.0},
             {"prompt": "x", "height": 10, "width": 16}]  # fmt: skip
    (images / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["generate", "--requests", str(images / "requests.jsonl"), "--model-path", str(images / "flux3"),
                 "--dtype", "float64", "--out", str(images / "out"), "--no-progress"])  # fmt: skip
    assert code == 1  # the last line refused
    timings = json.loads((images / "out" / "timings.json").read_text())
    assert [r["reason"][:20] for r in timings["refused"]] == ["line 3: 10x16 px: FL"]
    pipe = generator.reference_pipeline({"transformer": _diffusers_transformer(generator)})
    pipe.set_progress_bar_config(disable=True)
    for number, line in enumerate(lines[:2], start=1):
        request = parse_request(number - 1, number, json.dumps(line), images, default_steps=28)
        pipe.update_components(guider=generator.guider(request))
        expected = pipe(**generator.pipeline_call(request), output="images")[0]  # PIL, as the command writes
        written = np.asarray(Image.open(images / "out" / f"{line['id']}.png"))
        assert np.array_equal(written, np.asarray(expected)), line["id"]
    assert written.shape == (24, 40, 3)  # the edit cropped back to its reference


def test_a_folder_without_a_part_a_flow_map_and_another_guider_are_refused_at_load(images):
    """What the modular pipeline could not load is named (it only logs it); a tokenizer where the text
    encoder step takes a processor (``AutoProcessor`` falls back to the tokenizer, here where
    transformers cannot build Qwen3-VL's processor), a flow-map (step-distilled) transformer, which
    runs through other blocks, and a guider other than ``ClassifierFreeGuidance`` are refused when
    the generator is made."""
    from diffusers.guiders import AdaptiveProjectedGuidance

    from deepspeed_knap.models.flux3.flux3 import PackedFlux3Transformer
    from deepspeed_knap.models.flux3.generate import Flux3Generator, load_flux3_generator
    from deepspeed_knap.models.flux3.spec import TINY_FLUX3
    from tests.support.flux3_cases import save_flux3_folder

    generator = _generator()
    save_flux3_folder(images / "flux3", generator)
    with pytest.raises(ValueError, match=re.escape("the pipeline's tokenizer is a TokenizersBackend; FLUX.3's text")):
        load_flux3_generator(images / "flux3", torch.float32, "cpu")
    index_file = images / "flux3" / "modular_model_index.json"
    index_file.write_text(json.dumps({k: v for k, v in json.loads(index_file.read_text()).items() if k != "vae"}))
    with pytest.raises(ValueError, match=re.escape("flux3: the FLUX.3 modular pipeline could not load ['vae']")):
        load_flux3_generator(images / "flux3", torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"flow map .* Flux3DistilledAutoBlocks"):
        Flux3Generator(generator.pipeline, PackedFlux3Transformer(**TINY_FLUX3, flow_map=True))
    pipe = generator.pipeline.blocks.init_pipeline()
    parts = {name: part for name, part in generator.pipeline.components.items() if part is not None}
    pipe.update_components(**{**parts, "guider": AdaptiveProjectedGuidance()})
    with pytest.raises(ValueError, match=re.escape("the pipeline's guider is a AdaptiveProjectedGuidance")):
        Flux3Generator(pipe, generator.model)
