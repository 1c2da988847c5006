"""examples/prepare_video_latents.py on CPU: videos and an image this test writes with PyAV and PIL, a
tiny random Wan pipeline (VAE, UMT5, an offline tokenizer) -> samples that load, have the VAE's latent
shapes, match the pipeline's own encoding, and run through PackedWanTransformer; bad files refused with
their reasons in the summary, and exit code 1."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from deepspeed_knap.models.wan.data import (  # noqa: E402
    center_crop_multiple,
    frames_to_keep,
    load_video_sample,
    write_tiny_wan_pipeline,
)
from deepspeed_knap.runtime.manifest import read_manifest, verify_files  # noqa: E402
from tests.support.videos import write_video  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "prepare_video_latents.py"


def test_frame_and_crop_rules():
    assert [frames_to_keep(n) for n in (0, 1, 2, 4, 5, 7, 9, 10, 100)] == [0, 1, 1, 1, 5, 5, 9, 9, 97]
    assert frames_to_keep(100, max_frames=81) == 81 and frames_to_keep(7, max_frames=81) == 5
    assert center_crop_multiple(40, 56, 16) == (4, 4, 32, 48)
    assert center_crop_multiple(32, 48, 16) == (0, 0, 32, 48)
    assert center_crop_multiple(15, 48, 16)[2] == 0


def test_read_source_rate_and_limits(tmp_path):
    from deepspeed_knap.models.wan.data import Refused, read_source

    write_video(tmp_path / "clip.mp4", 10, 40, 56, "libx264", seed=0)
    source = read_source(tmp_path / "clip.mp4", fps=4)  # 8 fps: every other frame, 5 kept (4k+1)
    assert (source.frames, source.size, source.fps) == (5, (32, 48), 4)
    assert source.notes == {"fps": "8 -> 4 fps (10 frames read, 5 kept)", "cropped": "40x56 -> 32x48"}
    source = read_source(tmp_path / "clip.mp4", max_frames=5, max_area=20 * 28)
    assert (source.frames, source.size) == (5, (16, 16)) and source.notes["frames"].startswith("more than 5")
    assert source.notes["scaled"] == "40x56 -> 20x28 (max area 560)"
    with pytest.raises(Refused, match="too small: 40x56 pixels"):
        read_source(tmp_path / "clip.mp4", multiple=64)
    assert source.pixels.min() >= -1 and source.pixels.max() <= 1


def test_a_video_is_read_upright_by_its_display_matrix(tmp_path):
    """A phone stores a portrait clip landscape with a display matrix that turns it a quarter turn
    clockwise for display (PyAV reads it as -90: counterclockwise degrees); the source is the
    upright clip, as players (and ffmpeg's autorotate) show it, and the summary's note says so."""
    import av

    from deepspeed_knap.models.wan.data import read_source

    if not hasattr(av.video.stream.VideoStream, "set_display_rotation"):
        pytest.skip("this PyAV cannot write a display matrix (set_display_rotation: PyAV 18)")
    stored = np.zeros((32, 64, 3), dtype=np.uint8)  # stored 64 wide, 32 high
    stored[:, :32] = 255  # its left half white: after a quarter turn clockwise, its top half
    for name, degrees in (("portrait.mp4", -90), ("upside_down.mp4", 180)):
        with av.open(str(tmp_path / name), "w") as container:
            stream = container.add_stream("libx264", rate=8)
            stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
            stream.set_display_rotation(degrees)
            for _ in range(5):
                container.mux(stream.encode(av.VideoFrame.from_ndarray(stored, format="rgb24")))
            container.mux(stream.encode())
    source = read_source(tmp_path / "portrait.mp4")
    assert (source.frames, source.size, source.source_size) == (5, (64, 32), (64, 32))  # (height, width)
    top, bottom = source.pixels[..., :32, :].mean(), source.pixels[..., 32:, :].mean()
    assert top > 0.9 and bottom < -0.9
    assert source.notes == {"rotated": "turned 90 degrees clockwise (display matrix)"}
    source = read_source(tmp_path / "upside_down.mp4")  # the white half now on the right
    left, right = source.pixels[..., :32].mean(), source.pixels[..., 32:].mean()
    assert source.size == (32, 64) and left < -0.9 and right > 0.9


def test_an_image_is_read_upright_by_its_exif_orientation(tmp_path):
    """A phone stores a portrait photo landscape with an EXIF tag saying so (6: turn 90 degrees
    clockwise); the source is the upright image, as diffusers' load_image reads it."""
    from PIL import Image

    from deepspeed_knap.models.wan.data import read_source

    stored = np.zeros((32, 64, 3), dtype=np.uint8)  # stored 64 wide, 32 high
    stored[:, :32] = 255  # its left half white: after the turn, its top half
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(tmp_path / "portrait.png", exif=exif)
    source = read_source(tmp_path / "portrait.png")
    assert (source.frames, source.size) == (1, (64, 32))  # (height, width): upright
    top, bottom = source.pixels[..., :32, :].mean(), source.pixels[..., 32:, :].mean()
    assert top > 0.9 and bottom < -0.9


@pytest.mark.parametrize("contents", [(), ("notes.md", "clip.txt", "more/")])
def test_a_folder_without_videos_or_images_is_an_error_naming_it(tmp_path, contents):
    """Before, it exited 0 with an empty manifest."""
    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    for name in contents:
        (inputs / name).mkdir() if name.endswith("/") else (inputs / name).write_text("x")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--pretrained", str(tmp_path / "no-pipeline"), "--inputs", str(inputs), "--out",
         str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    held = "it holds 3 other entries" if contents else "it is empty"
    assert run.returncode == 2 and run.stderr.splitlines()[-1].endswith(
        f"error: --inputs {inputs} holds no videos or images to prepare: looked for .mp4 .webm .mkv .mov .avi .png "
        f".jpg .jpeg .webp files in it, not in its subfolders ({held})"
    ), run.stderr
    assert "Traceback" not in run.stderr and not out.exists()


def test_prepare_videos_and_images(tmp_path):
    from PIL import Image

    pipeline = write_tiny_wan_pipeline(tmp_path / "pipe")
    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    # name: (frames, H, W) of the source; expected (frames kept, H, W) after the 4k+1 rule and the crop.
    expected = {"a_clip.mp4": (9, 32, 48), "b_clip.webm": (5, 48, 32), "c_still.png": (1, 16, 32)}
    write_video(inputs / "a_clip.mp4", 9, 32, 48, "libx264", seed=0)  # 4k+1, multiples of 16 already
    write_video(inputs / "b_clip.webm", 7, 56, 40, "libvpx-vp9", seed=1)  # 7 frames -> 5; 56x40 -> 48x32
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (24, 40, 3), dtype=np.uint8)).save(inputs / "c_still.png")
    write_video(inputs / "d_nocaption.mp4", 5, 32, 32, "libx264", seed=3)
    (inputs / "e_corrupt.mp4").write_bytes(b"\x00not a video" * 64)
    with av.open(str(inputs / "f_empty.mp4"), "w") as container:  # a container with no frames
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        container.start_encoding()
    (inputs / "notes.md").write_text("not media")
    (inputs / "more").mkdir()
    captions = {"a_clip": "a red cat", "b_clip": "a blue dog on the grass", "c_still": "an image of a bird",
                "e_corrupt": "a video", "f_empty": "a video"}  # fmt: skip
    for stem, caption in captions.items():
        (inputs / f"{stem}.txt").write_text(caption + "\n")

    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--pretrained", str(pipeline), "--inputs", str(inputs), "--out", str(out),
         "--max-sequence-length", "16", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 1, log
    summary = run.stdout[run.stdout.index("prepared ") :]
    assert "prepared 3 of 6 files" in summary, log
    assert "REFUSED 3 files (no caption: 1, unreadable: 1, no video frames: 1)" in summary, log
    assert "d_nocaption.mp4: no caption: write it in d_nocaption.txt" in summary, log
    assert "e_corrupt.mp4: unreadable: PyAV cannot open it" in summary, log
    assert "f_empty.mp4: no video frames" in summary, log
    assert "b_clip.webm 7 -> 5 frames (4k+1)" in summary, log
    assert "b_clip.webm 56x40 -> 48x32" in summary and "c_still.png 24x40 -> 16x32" in summary, log
    assert (
        "ignored 2 files that are neither videos nor images (or directories, not read): more/, notes.md" in summary
    ), log

    manifest = read_manifest(out)
    assert verify_files(out, manifest) == []
    assert sorted(manifest["files"]) == [f"{i:08d}.safetensors" for i in range(3)]
    assert set(manifest["metadata"]["refused"]) == {"d_nocaption.mp4", "e_corrupt.mp4", "f_empty.mp4"}

    from diffusers import WanPipeline

    from deepspeed_knap.models.wan.spec import TINY_WAN
    from deepspeed_knap.models.wan.wan import PackedWanTransformer

    pipe = WanPipeline.from_pretrained(pipeline, transformer=None, transformer_2=None)
    samples, z_dim = [], pipe.vae.config.z_dim
    for name in sorted(manifest["files"]):
        tensors, meta = load_video_sample(out / name)
        frames, height, width = expected[meta["source"]]
        latents, text = tensors["latents"], tensors["encoder_hidden_states"]
        assert list(latents.shape) == [z_dim, 1 + (frames - 1) // 4, height // 8, width // 8], meta
        assert (int(meta["frames"]), meta["size"]) == (frames, f"{height}x{width}")
        caption = captions[Path(meta["source"]).stem]
        reference, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, max_sequence_length=16)
        torch.testing.assert_close(text, reference[0])  # fp32, another process
        samples.append({"hidden_states": latents, "encoder_hidden_states": text, "timestep": torch.tensor(500.0)})
        if meta["source"] == "c_still.png":  # lossless: the latents are the pipeline VAE's, normalised
            pixels = np.asarray(Image.open(inputs / "c_still.png").convert("RGB"))[4:20, 4:36]
            x = torch.from_numpy(pixels.copy()).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
            with torch.no_grad():
                z = pipe.vae.encode(x).latent_dist.mode()[0]
            config = pipe.vae.config
            mean, std = (torch.tensor(v).view(-1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
            torch.testing.assert_close(latents, (z - mean) / std)

    model = PackedWanTransformer(**{**TINY_WAN, "in_channels": z_dim, "out_channels": z_dim})
    with torch.no_grad():
        outputs = model.forward_samples(samples)
    assert [o.shape for o in outputs] == [s["hidden_states"].shape for s in samples]
    assert all(torch.isfinite(o).all() for o in outputs)
    sources = json.loads((out / "manifest.json").read_text())["metadata"]["sources"]
    assert sources == {"00000000.safetensors": "a_clip.mp4", "00000001.safetensors": "b_clip.webm",
                       "00000002.safetensors": "c_still.png"}  # fmt: skip


def test_bad_options_leave_the_old_samples_in_place(tmp_path):
    """--fps 0 was a ZeroDivisionError on the first clip, after --overwrite had deleted the folder's
    samples and manifest: options are checked by argparse, before anything in --out goes (and what
    it holds goes only once the encoders are loaded)."""
    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    (inputs / "still.png").write_bytes(b"")
    (inputs / "still.txt").write_text("a cat")
    (out / "00000000.safetensors").write_bytes(b"old sample")
    (out / "manifest.json").write_text("{}")
    command = [sys.executable, str(SCRIPT), "--pretrained", str(tmp_path / "no-pipeline"), "--inputs", str(inputs),
               "--out", str(out), "--overwrite"]  # fmt: skip
    bad = subprocess.run([*command, "--fps", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "argument --fps: 0 is not a finite number > 0" in bad.stderr, bad.stderr
    assert (out / "00000000.safetensors").read_bytes() == b"old sample" and (out / "manifest.json").is_file()
