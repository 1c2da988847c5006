"""FLUX.3 training's inputs, checked before any weights load. examples/prepare_flux3_latents.py
refuses bad inputs naming what is wrong and the fix: a folder without target images, images without
captions, references without their target or their number, a folder that is not a FLUX.3 modular
pipeline's, an output folder that holds samples. Validation (``Flux3Validation``) reads a prompts
line as text or as an edit of the images it names, refuses what the modular pipeline cannot render,
takes its parts from a modular pipeline folder only, and with ``--tiny`` renders through the modular
pipeline with tiny parts. (Preparing real images, training on them and rendering:
tests/multirank/test_training_flux3.py.)"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys

import pytest

from tests.support.training import ROOT

SCRIPT = ROOT / "examples" / "prepare_flux3_latents.py"


@pytest.fixture
def folders(tmp_path):
    """``inputs/`` (two captioned images and an edit's reference), a FLUX.3 ``pipeline/`` folder's
    index (no weights: the refusals come first) and ``out/``."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for name in ("a.png", "b.png", "b.ref1.png"):
        (inputs / name).write_bytes(b"")  # never opened: the refusals read names only
    for name in ("a.txt", "b.txt"):
        (inputs / name).write_text("a caption")
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "modular_model_index.json").write_text(json.dumps({"_class_name": "Flux3ModularPipeline"}))
    return tmp_path


def refusal(monkeypatch, folders, *extra: str) -> str:
    """The message the script stops with (run in this process, as ``python SCRIPT ...``)."""
    argv = ["--pretrained", str(folders / "pipeline"), "--inputs", str(folders / "inputs"), "--out",
            str(folders / "out"), *extra]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert isinstance(stop.value.code, str), stop.value.code
    return stop.value.code


def test_images_without_captions_are_listed_together(monkeypatch, folders):
    for name in ("a.txt", "b.txt"):
        (folders / "inputs" / name).unlink()
    message = refusal(monkeypatch, folders)
    assert message == f"{folders / 'inputs'}: 2 images have no caption file (a.txt, b.txt): write one .txt per image"
    assert not (folders / "out").exists()  # nothing made before the inputs pass


@pytest.mark.parametrize(("change", "expected"), [
    (lambda inputs: [p.unlink() for p in inputs.glob("*.png")], "no target images (.jpg, .jpeg, .png, .webp) in "),
    (lambda inputs: (inputs / "c.ref1.png").write_bytes(b""), "references without their target image (c.ref1.png): "
     "NAME.refN.png is a reference of NAME.png beside it; add the target or remove them"),
    # "b.ref.png" is no reference (no number): a target, which needs its caption.
    (lambda inputs: (inputs / "b.ref.png").write_bytes(b""), "1 images have no caption file (b.ref.txt)"),
    (lambda inputs: [(inputs / name).write_bytes(b"") for name in ("b.ref07.png", "b.ref7.png")],
     "references of a number already taken (b.ref7.png): one file per NAME.refN"),
])  # fmt: skip
def test_inputs_it_cannot_pair_are_refused(monkeypatch, folders, change, expected):
    change(folders / "inputs")
    assert expected in refusal(monkeypatch, folders)


def test_a_folder_that_is_not_flux3_and_an_output_holding_samples_are_refused(monkeypatch, folders):
    pipeline = folders / "pipeline"
    index = pipeline / "modular_model_index.json"
    index.rename(pipeline / "model_index.json")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "Flux2Pipeline"}))
    assert refusal(monkeypatch, folders) == (f"--pretrained {pipeline} is a Flux2Pipeline (model_index.json); give a "
                                             "FLUX.3 modular pipeline directory (Flux3ModularPipeline)")  # fmt: skip
    (pipeline / "model_index.json").unlink()
    assert re.match(rf"--pretrained {re.escape(str(pipeline))}: no modular_model_index.json or model_index.json "
                    "there", refusal(monkeypatch, folders))  # fmt: skip
    index.write_text(json.dumps({"_class_name": "Flux3ModularPipeline"}))
    (folders / "out").mkdir()
    (folders / "out" / "00000000.safetensors").write_bytes(b"")
    assert refusal(monkeypatch, folders) == f"{folders / 'out'} already holds samples; give an empty directory"


def test_validation_lines_sizes_and_folders(tmp_path):
    """A line is a prompt, or reference images each before a tab and then the prompt, read at
    start-up; several references each at least the 16 px grid; FLUX.3's 50 steps, the guider's 3.5
    and each prompt's own text length; a folder with either index."""
    import numpy as np
    from PIL import Image

    from deepspeed_knap.models.flux3.finetune import Flux3Validation
    from deepspeed_knap.models.hooks import ValidationSettings
    from deepspeed_knap.models.registry import spec

    for name, (height, width) in {"wide.png": (24, 40), "tall.png": (70, 52), "dot.png": (10, 30)}.items():
        Image.fromarray(np.zeros((height, width, 3), dtype=np.uint8)).save(tmp_path / name)
    hooks = Flux3Validation(spec("flux3"))
    assert hooks.call("a cat", tmp_path, None) == {"prompt": "a cat"}
    edit = hooks.call("wide.png\tin blue", tmp_path, None)
    assert edit["prompt"] == "in blue" and [image.size for image in edit["image"]] == [(40, 24)]
    several = hooks.call("tall.png\twide.png\tboth", tmp_path, None)["image"]
    assert [image.size for image in several] == [(52, 70), (40, 24)]
    assert hooks.call("dot.png\tsmall alone", tmp_path, None)["prompt"] == "small alone"  # one is padded
    with pytest.raises(
        ValueError, match=re.escape("image dot.png is 30x10 px: with several references FLUX.3's pipeline crops")
    ):
        hooks.call("wide.png\tdot.png\tboth", tmp_path, None)
    with pytest.raises(ValueError, match=r"an edit is IMAGE<TAB>PROMPT .* one of them is empty"):
        hooks.call("wide.png\t ", tmp_path, None)
    with pytest.raises(ValueError, match=r"cannot read image .*missing\.png: \[Errno 2\]"):
        hooks.call("missing.png\tin blue", tmp_path, None)
    # A FIFO (open would block every rank) and a file PIL refuses with its own error type (a
    # decompression bomb's is no ValueError) are named, as generate's requests are.
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(ValueError, match=r"pipe\.png: it is a FIFO \(named pipe\), not a regular file"):
        hooks.call("pipe.png\tin blue", tmp_path, None)
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"cannot read image .*text\.png: not an image PIL reads"):
        hooks.call("text.png\tin blue", tmp_path, None)
    assert hooks.options(ValidationSettings(tiny=True)) == dict(height=32, width=32, num_inference_steps=2,
                                                                guidance_scale=3.5)  # fmt: skip
    assert hooks.options(ValidationSettings(tiny=False, guidance=2.0)) == dict(height=1024, width=1024,
                                                                               num_inference_steps=50,
                                                                               guidance_scale=2.0)  # fmt: skip
    assert re.match(r"--validation-every needs --model-path to be a FLUX.3 modular pipeline directory \(with "
                    r"modular_model_index.json or model_index.json", hooks.model_path_problem(str(tmp_path)))  # fmt: skip
    for index in ("modular_model_index.json", "model_index.json"):
        (tmp_path / index).write_text("{}")
        assert hooks.model_path_problem(str(tmp_path)) is None
        (tmp_path / index).unlink()


def test_tiny_validation_renders_text_and_an_edit_through_the_modular_pipeline(tmp_path):
    """``--tiny``: the tiny random parts, the modular pipeline built around a transformer of the
    model's weights, each line rendered at the validation size and guidance."""
    import numpy as np
    import torch
    from PIL import Image

    from deepspeed_knap.models.flux3.finetune import Flux3Validation
    from deepspeed_knap.models.hooks import ValidationSettings
    from deepspeed_knap.models.registry import spec

    Image.fromarray(np.zeros((24, 40, 3), dtype=np.uint8)).save(tmp_path / "wide.png")
    model = spec("flux3").tiny_model()
    hooks = Flux3Validation(model.spec)
    transformers = type(model).pipeline_transformers(model.config, model.state_dict())
    pipe = hooks.build_pipeline(model, hooks.components(None, model, 0, torch.float32), transformers)
    options = hooks.options(ValidationSettings(tiny=True, height=16, width=24, steps=1, guidance=2.0))
    for index, line in enumerate(["a cat", "wide.png\tin blue"]):
        call = hooks.call(line, tmp_path, model)
        file = hooks.render(pipe, call, torch.Generator().manual_seed(0), options, tmp_path / f"render{index}")
        assert Image.open(file).size == (24, 16)
    assert pipe.guider.guidance_scale == 2.0


def test_flux2_klein_validation_renders_through_the_klein_pipeline(tmp_path):
    """A FLUX.2 [klein] folder (``Flux2KleinPipeline``, Qwen3 text encoder) was rendered through
    ``Flux2Pipeline`` around its parts: Mistral's prompt template and hidden states (an IndexError
    with fewer than 31 text layers, wrong images with 36). Validation follows the folder's
    ``model_index.json``, as the generator does: its render is the klein pipeline's own."""
    import numpy as np
    import torch
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
    from PIL import Image

    from deepspeed_knap.models.flux.finetune import Flux2Validation, tiny_flux2_klein_pipeline_components
    from deepspeed_knap.models.flux.spec import TINY_FLUX2_KLEIN
    from deepspeed_knap.models.hooks import ValidationSettings
    from deepspeed_knap.models.registry import spec

    torch.manual_seed(0)
    saved = Flux2KleinPipeline(**tiny_flux2_klein_pipeline_components(TINY_FLUX2_KLEIN, 2),
                               transformer=Flux2Transformer2DModel(**TINY_FLUX2_KLEIN))  # fmt: skip
    saved.save_pretrained(tmp_path / "klein")
    hooks = Flux2Validation(spec("flux2"), str(tmp_path / "klein"))
    assert hooks.model_path_problem(str(tmp_path / "klein")) is None
    model = spec("flux2").model_class.from_diffusers(saved.transformer)
    components = hooks.components(str(tmp_path / "klein"), model, 0, torch.float32)
    components.pop("transformer")
    pipe = hooks.build_pipeline(model, components, type(model).pipeline_transformers(model.config, model.state_dict()))
    assert type(pipe) is Flux2KleinPipeline
    options = hooks.options(ValidationSettings(tiny=True, height=16, width=16, steps=2))
    file = hooks.render(pipe, {"prompt": "a cat"}, torch.Generator().manual_seed(3), options, tmp_path / "render")
    expected = saved(prompt="a cat", generator=torch.Generator().manual_seed(3), **options).images[0]
    assert np.array_equal(np.asarray(Image.open(file)), np.asarray(expected))
    assert options["guidance_scale"] == 4.0 and not pipe.config.is_distilled
    # A step-distilled klein: the pipeline keeps is_distilled, and renders without guidance unless told.
    saved.register_to_config(is_distilled=True)
    saved.save_pretrained(tmp_path / "distilled")
    hooks = Flux2Validation(spec("flux2"), str(tmp_path / "distilled"))
    assert hooks.model_path_problem(str(tmp_path / "distilled")) is None
    components = hooks.components(str(tmp_path / "distilled"), model, 0, torch.float32)
    components.pop("transformer")
    pipe = hooks.build_pipeline(model, components, type(model).pipeline_transformers(model.config, model.state_dict()))
    assert pipe.config.is_distilled and hooks.options(ValidationSettings(tiny=True))["guidance_scale"] == 1.0
    assert hooks.options(ValidationSettings(tiny=True, guidance=2.0))["guidance_scale"] == 2.0
    index = tmp_path / "other" / "model_index.json"
    index.parent.mkdir()
    index.write_text('{"_class_name": "FluxPipeline"}')
    assert "names 'FluxPipeline'" in hooks.model_path_problem(str(index.parent))


def test_validation_renders_at_each_pipelines_default_steps():
    """Without --validation-inference-steps a render takes its pipeline's steps: FluxPipeline's 28,
    Flux2Pipeline's (and klein's) 50; FLUX.2 rendered at 28. --tiny: 2; given: as given."""
    from deepspeed_knap.models.flux.finetune import Flux2Validation, FluxValidation
    from deepspeed_knap.models.hooks import ValidationSettings
    from deepspeed_knap.models.registry import spec

    for hooks, steps in ((FluxValidation(spec("flux"), None), 28), (Flux2Validation(spec("flux2"), None), 50)):
        assert hooks.options(ValidationSettings(tiny=False))["num_inference_steps"] == steps
        assert hooks.options(ValidationSettings(tiny=True))["num_inference_steps"] == 2
        assert hooks.options(ValidationSettings(tiny=False, steps=7))["num_inference_steps"] == 7
