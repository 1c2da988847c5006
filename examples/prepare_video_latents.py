"""Write Wan latent samples from video files and images: one .safetensors file per sample, and a manifest.

    python examples/prepare_video_latents.py --pretrained /models/Wan2.1-T2V-1.3B-Diffusers \\
        --inputs /data/clips --out /data/wan_latents

Every ``.mp4 .webm .mkv .mov .avi`` (decoded with PyAV) and ``.png .jpg .jpeg .webp`` in ``--inputs``
(name order, not recursive) is one sample, captioned by its sidecar text file (``clip.mp4`` ->
``clip.txt``). Latents come from the pipeline's ``AutoencoderKLWan`` (the mode of its posterior,
normalised with the VAE's ``latents_mean``/``latents_std`` as ``WanPipeline`` un-normalises them),
text rows from ``WanPipeline.encode_prompt`` (UMT5, zero-padded to ``--max-sequence-length``). For an
image-to-video pipeline (``WanImageToVideoPipeline``: Wan 2.1 I2V, Wan 2.2 I2V-A14B) each sample also
holds the pipeline's condition for its first frame, made by the pipeline's own
``prepare_latents`` (the first-frame mask and the VAE latents of the first frame followed by empty
frames), and, where the pipeline has an image encoder (Wan 2.1), the CLIP context of that frame
(``encode_image``). Wan 2.2 TI2V-5B needs nothing more: its condition is the clip's first latent
frame. The
file format and the frame and size rules are documented in deepspeed_knap/models/wan/data.py and
docs/models.md ("Preparing video data"): each sample keeps its own frame count (the first 4k+1) and
size (center-cropped to a multiple of 16 for Wan 2.1): no buckets.

An ``--inputs`` folder holding no videos or images is an error (exit 2), before anything is loaded
or written. A file that cannot be prepared (unreadable, no video frames, no caption, smaller than 16
pixels) is refused with its reason and the others go on; the run ends with a summary of what it refused, trimmed,
scaled and cropped, and exits 1 if it refused anything. ``manifest.json`` (each sample's size and
sha256, and the summary in its metadata) is written last: a run that did not finish leaves none.
Needs diffusers, transformers and PyAV (``pip install -e .[diffusers]`` installs them).
"""

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from deepspeed_knap.models.wan.data import (
    CAPTION_SUFFIX,
    I2V_TEXT_ROWS,
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    Refused,
    read_caption,
    read_source,
    save_video_sample,
)
from deepspeed_knap.options import nonnegative_int, positive_float, positive_int
from deepspeed_knap.runtime.manifest import MANIFEST, build_manifest, write_manifest

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument(
    "--pretrained", required=True, help="a local diffusers Wan pipeline folder (its vae/, text_encoder/, tokenizer/)"
)
parser.add_argument("--inputs", required=True, help="a directory of videos and images, each with a .txt caption")
parser.add_argument("--out", required=True, help="directory to write the samples to (empty, or --overwrite)")
parser.add_argument(
    "--overwrite", action="store_true", help="remove the .safetensors samples and manifest in --out first"
)
parser.add_argument(
    "--max-frames", type=nonnegative_int, default=81, help="at most this many frames per clip, 4k+1 (Wan: 81); 0: all"
)
parser.add_argument(
    "--max-area",
    type=nonnegative_int,
    default=1280 * 720,
    help="scale frames with more pixels down to this many first, aspect kept (default 720p); 0: never",
)
parser.add_argument(
    "--fps",
    type=positive_float,
    default=None,
    help="subsample clips above this frame rate to it (Wan: 16; Wan 2.2 TI2V-5B: 24)",
)
parser.add_argument("--max-sequence-length", type=positive_int, default=512, help="UMT5 tokens per caption (Wan: 512)")
parser.add_argument(
    "--device", help="where to encode (default: cuda if there is one, else cpu; bf16 text encoder on cuda)"
)
parser.add_argument("--vae-tiling", action="store_true", help="encode in spatial tiles (less memory at 720p and up)")
args = parser.parse_args()


def sources(directory: Path) -> tuple[list[Path], list[Path]]:
    """``(videos and images, other entries)`` of ``directory`` in name order; captions are neither, and
    subdirectories are others (not read: say so rather than skip them silently)."""
    if not directory.is_dir():
        parser.error(f"--inputs {directory} is not a directory")
    entries = sorted(directory.iterdir())
    media = [p for p in entries if p.is_file() and p.suffix.lower() in VIDEO_SUFFIXES + IMAGE_SUFFIXES]
    other = [p for p in entries if p not in media and not (p.is_file() and p.suffix.lower() == CAPTION_SUFFIX)]
    if not media:  # an empty manifest and exit 0 would pass for a prepared folder
        held = f"it holds {len(entries)} other entries" if entries else "it is empty"
        parser.error(f"--inputs {directory} holds no videos or images to prepare: looked for "
                     f"{' '.join(VIDEO_SUFFIXES + IMAGE_SUFFIXES)} files in it, not in its subfolders ({held})")  # fmt: skip
    return media, other


def patch_size(pretrained: Path) -> list[int]:
    """The transformer's patch from the pipeline folder (Wan 2.x: ``[1, 2, 2]`` when it has none)."""
    config = pretrained / "transformer" / "config.json"
    return json.loads(config.read_text()).get("patch_size", [1, 2, 2]) if config.is_file() else [1, 2, 2]


def image_to_video(pretrained: Path) -> bool:
    """Whether the pipeline folder is an image-to-video one (``model_index.json``'s ``_class_name``)."""
    index = pretrained / "model_index.json"
    return index.is_file() and json.loads(index.read_text()).get("_class_name") == "WanImageToVideoPipeline"


def image_condition(pipe, pixels: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """The image-to-video condition of a clip (``pixels [3, F, H, W]`` in ``[-1, 1]``): what
    ``WanImageToVideoPipeline`` makes from its first frame, with the pipeline's own code:
    ``prepare_latents``' condition (``[4 + C, F', H', W']``: the first-frame mask, then the VAE latents
    of the first frame followed by empty frames, normalised), and with an image encoder the CLIP
    context of the frame (``encode_image``, ``[257, D]`` for ViT-H/14)."""
    from PIL import Image

    frames, height, width = pixels.shape[1:]
    z_dim = pipe.vae.config.z_dim
    shape = (1, z_dim, (frames - 1) // pipe.vae_scale_factor_temporal + 1, height // pipe.vae_scale_factor_spatial,
             width // pipe.vae_scale_factor_spatial)  # fmt: skip
    # Given latents the pipeline draws no noise: only the condition is wanted.
    _, condition = pipe.prepare_latents(pixels[:, 0][None].to(device), 1, z_dim, height, width, frames,
                                        torch.float32, device, latents=torch.zeros(shape, device=device))  # fmt: skip
    sample = {"condition": condition[0].float()}
    if pipe.image_encoder is not None:
        first = ((pixels[:, 0].permute(1, 2, 0).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
        sample["encoder_hidden_states_image"] = pipe.encode_image(Image.fromarray(first), device)[0].float()
    return sample


def main() -> int:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    out, inputs, pretrained = Path(args.out), Path(args.inputs), Path(args.pretrained)
    max_frames = args.max_frames or None
    if max_frames is not None and (max_frames < 1 or (max_frames - 1) % 4):
        parser.error(f"--max-frames {max_frames} must be 4k+1 (e.g. 33, 49, 81): the VAE encodes 1 + 4k frames")
    media, other = sources(inputs)
    if not (pretrained / "model_index.json").is_file():
        parser.error(f"--pretrained {pretrained} is not a diffusers Wan pipeline folder (no model_index.json in it)")
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.glob("*.safetensors"))
    if existing and not args.overwrite:
        parser.error(f"--out {out} already holds {len(existing)} samples; give an empty directory, or --overwrite")

    refused: dict[str, Refused] = {}
    captions = {}
    for path in media:  # every missing caption before the encoders load
        try:
            captions[path] = read_caption(path)
        except Refused as error:
            refused[path.name] = error

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # The VAE in fp32, as Wan's pipelines run it; the text encoder in bf16 on a GPU.
    i2v = image_to_video(pretrained)
    if i2v and (pretrained / "image_encoder").is_dir() and args.max_sequence_length != I2V_TEXT_ROWS:
        parser.error(f"--max-sequence-length {args.max_sequence_length}: {pretrained} has image context (Wan 2.1 I2V), "
                     f"whose text is {I2V_TEXT_ROWS} rows (diffusers splits the context there); drop it")  # fmt: skip
    pipeline_class = WanImageToVideoPipeline if i2v else WanPipeline
    # The VAE and the CLIP image encoder in fp32, as Wan's pipelines and `generate` run them.
    pipe = pipeline_class.from_pretrained(pretrained, transformer=None, transformer_2=None,
                                          torch_dtype={"vae": torch.float32, "image_encoder": torch.float32,
                                                       "default": dtype})  # fmt: skip
    pipe.vae.to(device)
    pipe.text_encoder.to(device)
    if i2v and pipe.image_encoder is not None:
        pipe.image_encoder.to(device)
    if args.vae_tiling:
        pipe.vae.enable_tiling()
    # Every check passed and the encoders loaded: what --out held goes now (the manifest of what was
    # there before would describe files this run rewrites).
    (out / MANIFEST).unlink(missing_ok=True)
    for file in existing:
        file.unlink()
    vae = pipe.vae.config
    multiple = pipe.vae_scale_factor_spatial * patch_size(pretrained)[1]
    mean = torch.tensor(vae.latents_mean, device=device).view(-1, 1, 1, 1)
    std = torch.tensor(vae.latents_std, device=device).view(-1, 1, 1, 1)

    written: dict[str, str] = {}  # {sample file: its source}
    notes: dict[str, list[str]] = {"rotated": [], "fps": [], "frames": [], "scaled": [], "cropped": []}
    start = time.time()
    for path, caption in captions.items():
        try:
            source = read_source(path, multiple, pipe.vae_scale_factor_temporal, max_frames, args.max_area or None,
                                 args.fps)  # fmt: skip
            with torch.no_grad():
                try:  # the clip, and for image to video its first frame's condition (a second encode)
                    z = pipe.vae.encode(source.pixels[None].to(device)).latent_dist.mode()[0]
                    condition = image_condition(pipe, source.pixels, device) if i2v else {}
                except torch.cuda.OutOfMemoryError:
                    raise Refused("out of memory", f"out of memory encoding {source.frames} frames of "
                                  f"{source.size[0]}x{source.size[1]}; lower --max-area or --max-frames, or "
                                  "pass --vae-tiling") from None  # fmt: skip
                text, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False,
                                             max_sequence_length=args.max_sequence_length, device=device)  # fmt: skip
        except Refused as error:
            refused[path.name] = error
            print(f"refused {path.name}: {error}", file=sys.stderr)
            continue
        latents = (z.float() - mean) / std  # WanPipeline decodes latents * std + mean
        name = f"{len(written):08d}.safetensors"
        save_video_sample(out / name, {"latents": latents, "encoder_hidden_states": text[0], **condition}, {
            "source": path.name, "caption": caption, "kind": "video" if source.is_video else "image",
            "frames_read": source.source_frames, "frames": source.frames, "fps": source.fps or "",
            "source_size": "x".join(map(str, source.source_size)), "size": "x".join(map(str, source.size)),
        })  # fmt: skip
        written[name] = path.name
        for key, note in source.notes.items():
            notes[key].append(f"{path.name} {note}")
        print(f"{name} <- {path.name}: {source.frames} frames of {source.size[0]}x{source.size[1]} -> latents "
              f"{list(latents.shape)}")  # fmt: skip

    metadata = {
        "prepared_by": "examples/prepare_video_latents.py",
        "pretrained": str(pretrained),
        "sources": written,
        "refused": {name: str(error) for name, error in refused.items()},
        **{key: value for key, value in notes.items() if value},
    }
    manifest = write_manifest(out, build_manifest(out, list(written), metadata))
    print(summary(len(media), written, refused, notes, other, out, manifest, time.time() - start, multiple))
    return 1 if refused else 0


def summary(total, written, refused, notes, other, out, manifest, seconds, multiple) -> str:
    lines = [f"prepared {len(written)} of {total} files into {out} in {seconds:.1f} s; sizes and sha256 in {manifest}"]
    described = {
        "rotated": "turned upright as their display matrix says",
        "fps": "subsampled to --fps",
        "frames": "trimmed to their first 4k+1 frames (the VAE encodes 1 + 4k) and at most --max-frames",
        "scaled": "scaled down to --max-area",
        "cropped": f"center-cropped to multiples of {multiple} pixels",
    }
    for key, what in described.items():
        if notes[key]:
            lines.append(f"{what} ({len(notes[key])}): " + "; ".join(notes[key]))
    if other:
        lines.append(f"ignored {len(other)} files that are neither videos nor images (or directories, not read): "
                     + ", ".join(p.name + "/" * p.is_dir() for p in other))  # fmt: skip
    if refused:
        kinds = Counter(error.kind for error in refused.values())
        lines.append(f"REFUSED {len(refused)} files (" + ", ".join(f"{k}: {n}" for k, n in kinds.items()) + "):")
        lines += [f"  {name}: {error}" for name, error in refused.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
