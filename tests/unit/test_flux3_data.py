"""FLUX.3 training data: the latent file check names each problem (keys, references without ids,
dtypes, empty modes, widths), a directory of written samples reads back in order with ids kept in
float32, synthetic flux3_edit samples have the mix's segments scaled and pack as diffusers' pipeline
ids, and the rectified-flow objective noises only the image tokens."""

from __future__ import annotations

import pytest
import torch

from deepspeed_knap.data.mixes import SampleShape
from deepspeed_knap.models.flux3.data import (
    check_flux3_latent_file,
    latent_directory,
    rectified_flow,
    save_flux3_sample,
    synthetic_flux3_samples,
    write_latent_manifest,
)
from deepspeed_knap.models.flux3.flux3 import PackedFlux3Transformer
from deepspeed_knap.models.flux3.spec import TINY_FLUX3
from deepspeed_knap.models.latents import latent_directory_error
from deepspeed_knap.models.registry import sample_shapes

CONFIG = PackedFlux3Transformer(**TINY_FLUX3).config
# (text, visual, frames, reference): text-to-image, one reference, three references.
SHAPES = [SampleShape(5, 12, 1), SampleShape(3, 18, 2, reference=9), SampleShape(4, 20, 4, reference=11)]


def test_synthetic_samples_have_the_segments_and_the_pipeline_ids():
    samples = synthetic_flux3_samples(SHAPES, CONFIG, seed=0)
    assert [tuple(len(s.get(key, ())) for key in ("encoder_hidden_states", "latents", "image_cond_hidden_states"))
            for s in samples] == [shape.segments for shape in SHAPES]  # fmt: skip
    refs = samples[2]["image_cond_ids"]
    assert sorted(set(refs[:, 3].tolist())) == [-3.0, -2.0, -1.0]  # three references at l = -1, -2, -3
    assert [int((refs[:, 3] == layer).sum()) for layer in (-1, -2, -3)] == [4, 4, 3]
    assert (samples[0]["img_ids"][:, 3] == 0).all() and (samples[0]["txt_ids"][:, 3] == torch.arange(5)).all()
    inputs = PackedFlux3Transformer(**TINY_FLUX3).pack(rectified_flow(samples, torch.Generator())[0])
    assert inputs.segments.tolist() == [list(shape.segments) for shape in SHAPES]
    # A mix scaled far down keeps one text and one image token per sample.
    tiny = synthetic_flux3_samples(sample_shapes("flux3_edit", 1, seed=0)[0], CONFIG, seed=0, token_scale=1e-4)
    assert all(len(s["encoder_hidden_states"]) >= 1 and len(s["latents"]) >= 1 for s in tiny)


def test_rectified_flow_noises_the_image_and_keeps_the_conditioning():
    (latents,) = synthetic_flux3_samples(SHAPES[1:2], CONFIG, seed=0)
    (sample,), (target,) = rectified_flow([latents], torch.Generator().manual_seed(3))
    sigma = sample["timestep"]
    assert 0 < sigma < 1
    noise = target + latents["latents"]  # the target is noise - x0
    torch.testing.assert_close(sample["hidden_states"], (1 - sigma) * latents["latents"] + sigma * noise)
    for key in ("encoder_hidden_states", "image_cond_hidden_states", "img_ids", "txt_ids", "image_cond_ids"):
        assert sample[key] is latents[key]
    assert "target_timestep" not in sample and "latents" not in sample


def test_written_samples_read_back_in_order(tmp_path):
    samples = synthetic_flux3_samples(SHAPES, CONFIG, seed=0)
    for index, sample in enumerate(samples):
        save_flux3_sample(tmp_path / f"{index:03d}.safetensors", sample)
    write_latent_manifest(tmp_path)
    data = latent_directory(tmp_path, samples_per_rank=2)
    assert latent_directory_error([data.check(rank, 1, CONFIG) for rank in range(1)]) is None
    names, read = data.read(2, 2, dtype=torch.bfloat16)
    assert [name.rsplit("/", 1)[1] for name in names] == ["002.safetensors", "000.safetensors"]
    assert read[0]["image_cond_hidden_states"].dtype == torch.bfloat16
    assert read[0]["image_cond_ids"].dtype == torch.float32  # positions stay exact
    assert torch.equal(read[0]["image_cond_ids"], samples[2]["image_cond_ids"])
    assert "image_cond_hidden_states" not in read[1]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda s: s.pop("txt_ids"), "missing ['txt_ids']"),
        (lambda s: s.update(pooled_projections=torch.zeros(4)), "unexpected ['pooled_projections']"),
        (lambda s: s.pop("image_cond_ids"), "has image_cond_hidden_states without image_cond_ids"),
        (lambda s: s.pop("image_cond_hidden_states"), "has image_cond_ids without image_cond_hidden_states"),
        (lambda s: s.update(latents=s["latents"].to(torch.int32)), "not floating point"),
        (lambda s: s.update(encoder_hidden_states=torch.zeros(0, 32), txt_ids=torch.zeros(0, 4)), "at least one token"),
        (lambda s: s.update(image_cond_ids=s["image_cond_ids"][:, :3]), "'image_cond_ids': '[9, 3] (expected [9, 4])'"),
        (lambda s: s.update(latents=torch.zeros(12, 8)), "'latents': '[12, 8] (expected [12, 16])'"),
        (lambda s: s.update(img_ids=s["img_ids"][:5]), "'img_ids': '[5, 4] (expected [9, 4])'"),
    ],
)
def test_the_file_check_names_each_problem(tmp_path, change, expected):
    from safetensors.torch import save_file

    sample = synthetic_flux3_samples(SHAPES[1:2], CONFIG, seed=0)[0]
    file = tmp_path / "bad.safetensors"
    save_flux3_sample(file, sample)
    assert check_flux3_latent_file(file, CONFIG) is None
    change(sample)
    save_file({key: t.contiguous() for key, t in sample.items()}, str(file))
    problem = check_flux3_latent_file(file, CONFIG)
    assert problem is not None and problem.startswith(f"{file}: ") and expected in problem, problem
    assert problem.endswith("or remove it")


def test_an_unreadable_file_and_a_bad_sample_to_save_are_refused(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00garbage" * 20)
    assert "not a readable .safetensors file" in check_flux3_latent_file(garbage, CONFIG)
    sample = synthetic_flux3_samples(SHAPES[1:2], CONFIG, seed=0)[0]
    del sample["image_cond_ids"]
    with pytest.raises(ValueError, match="optionally both of"):
        save_flux3_sample(tmp_path / "x.safetensors", sample)


def test_flux3_ids_are_the_modular_pipelines():
    """The target's and each reference's ids are what diffusers' modular FLUX.3 pipeline makes
    (half positions; reference ``i`` on the fourth axis at ``-1 - i``)."""
    pytest.importorskip("diffusers")
    from diffusers.modular_pipelines.flux3.before_denoise import _prepare_image_ids

    from deepspeed_knap.models.flux3.data import flux3_image_ids

    assert torch.equal(flux3_image_ids(3, 5), _prepare_image_ids(3, 5, image_rope_scale=0.5))
    for i in range(3):
        assert torch.equal(flux3_image_ids(4, 2, i), _prepare_image_ids(4, 2, image_rope_scale=0.5, l_coord=-(1 + i)))
