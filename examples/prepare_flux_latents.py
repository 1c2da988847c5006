"""Write latent samples for examples/train_dit.py: one .safetensors file per sample.

    # real data: images with a caption each (photo.jpg + photo.txt), encoded by a FLUX pipeline
    python examples/prepare_flux_latents.py --out /data/flux_latents --pipeline /models/FLUX.1-dev --images /data/photos
    # synthetic data of a bundled mix's sizes (no weights needed)
    python examples/prepare_flux_latents.py --out /tmp/latents --synthetic kf_mixed_res --count 64

The file format is documented in deepspeed_knap/models/flux/data.py. Encoding needs diffusers,
transformers and the pipeline's weights, and runs once, before training, on one GPU. Images keep
their own sizes and aspect ratios: packing trains every size as it is, with no aspect-ratio buckets.

After the samples, ``manifest.json`` is written (each file's size and sha256): train_dit.py checks
the files each rank reads against it, so a copy that changed, or differs between nodes, is refused
instead of trained. It is removed first and written last: a run that did not finish leaves none.
``--out`` must hold no samples (training reads every sample there), or give ``--overwrite``.
"""

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from deepspeed_knap.models.flux.data import save_latent_sample, synthetic_samples
from deepspeed_knap.models.latents import prepared_image, read_caption_file, write_latent_manifest
from deepspeed_knap.models.registry import MIXES, sample_shapes
from deepspeed_knap.options import positive_float, positive_int
from deepspeed_knap.runtime.manifest import MANIFEST

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--out", required=True, help="directory to write the samples to (empty, or --overwrite)")
parser.add_argument(
    "--overwrite", action="store_true", help="remove the .safetensors samples and manifest in --out first"
)
source = parser.add_mutually_exclusive_group(required=True)
source.add_argument("--images", help="a directory of images, each with a .txt caption of the same name")
source.add_argument("--synthetic", metavar="MIX", choices=sorted(MIXES), help="random latents of a bundled mix's sizes")
parser.add_argument("--pipeline", help="with --images: a diffusers FLUX pipeline directory")
parser.add_argument(
    "--resolution", type=positive_int, default=1024, help="with --images: resize the longer side to this"
)
parser.add_argument(
    "--max-sequence-length", type=positive_int, default=512, help="with --images: T5 tokens per caption"
)
parser.add_argument("--count", type=positive_int, default=64, help="with --synthetic: how many samples")
parser.add_argument("--token-scale", type=positive_float, default=1.0, help="with --synthetic: shrink sizes")
parser.add_argument("--in-channels", type=positive_int, default=64, help="with --synthetic: the model's dims")
parser.add_argument("--joint-attention-dim", type=positive_int, default=4096)
parser.add_argument("--pooled-projection-dim", type=positive_int, default=768)
args = parser.parse_args()
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp"}
if args.images and not args.pipeline:
    parser.error("--images needs --pipeline, the FLUX pipeline whose VAE and text encoders encode them")


def images_with_captions(directory: Path) -> list[tuple[Path, str]]:
    """Every image of ``directory`` (name order) with the caption in its ``.txt`` twin; all missing
    captions are reported at once, before any encoding."""
    if not directory.is_dir():
        raise SystemExit(f"--images {directory} is not a directory")
    images = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise SystemExit(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {directory}")
    missing = [str(p.with_suffix(".txt")) for p in images if not p.with_suffix(".txt").is_file()]
    if missing:
        raise SystemExit(
            f"{len(missing)} images have no caption file: {', '.join(missing[:10])}; write one .txt per image"
        )
    try:
        return [(p, read_caption_file(p.with_suffix(".txt"))) for p in images]
    except ValueError as error:
        raise SystemExit(str(error)) from None


captioned = images_with_captions(Path(args.images)) if args.images else []  # before anything in --out goes
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
existing = sorted(out.glob("*.safetensors"))
if existing and not args.overwrite:  # training reads every sample of the folder: old ones would train too
    parser.error(f"--out {out} already holds {len(existing)} samples; give an empty directory, or --overwrite")


def clear_out() -> None:
    """What ``--out`` held goes (with ``--overwrite``), once every check passed (and the encoders
    loaded): the manifest of what was there would describe files this run rewrites."""
    (out / MANIFEST).unlink(missing_ok=True)
    for file in existing:
        file.unlink()


def write_synthetic() -> None:
    # FLUX.1's sample layout (3 position axes, pooled text) at the given widths.
    dims = {"in_channels": args.in_channels, "joint_attention_dim": args.joint_attention_dim,
            "pooled_projection_dim": args.pooled_projection_dim, "axes_dims_rope": (16, 56, 56)}  # fmt: skip
    shapes = [shape for step in range(args.count) for rank in sample_shapes(args.synthetic, 1, seed=step)
              for shape in rank][: args.count]  # fmt: skip
    clear_out()
    for index, sample in enumerate(tqdm(synthetic_samples(shapes, dims, seed=0, token_scale=args.token_scale))):
        save_latent_sample(out / f"{index:08d}.safetensors", sample)


@torch.no_grad()
def encode_images() -> None:
    import numpy as np
    from diffusers import FluxPipeline
    from PIL import Image

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pipe = FluxPipeline.from_pretrained(args.pipeline, transformer=None, torch_dtype=dtype).to(device)
    multiple = pipe.vae_scale_factor * 2  # the VAE's downsampling, then 2x2 packing
    clear_out()
    for index, (path, caption) in enumerate(tqdm(captioned, desc="encode")):
        # Every image keeps its own size and aspect ratio (longer side at --resolution, each side a
        # multiple of the patch): packing trains them as they are, no buckets, nothing dropped.
        image = prepared_image(path)
        scale = args.resolution / max(image.size)
        width, height = (max(multiple, round(side * scale / multiple) * multiple) for side in image.size)
        pixels = torch.from_numpy(np.asarray(image.resize((width, height), Image.BICUBIC))).permute(2, 0, 1)
        pixels = pixels.to(device, dtype)[None] / 127.5 - 1  # [1, 3, H, W] in [-1, 1]
        latents = pipe.vae.encode(pixels).latent_dist.sample()
        latents = (latents - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        channels, lat_h, lat_w = latents.shape[1:]
        prompt_embeds, pooled, text_ids = pipe.encode_prompt(
            caption, device=device, max_sequence_length=args.max_sequence_length
        )
        save_latent_sample(out / f"{index:08d}.safetensors", {
            "latents": FluxPipeline._pack_latents(latents, 1, channels, lat_h, lat_w)[0],
            "img_ids": FluxPipeline._prepare_latent_image_ids(1, lat_h // 2, lat_w // 2, device, torch.float32),
            "encoder_hidden_states": prompt_embeds[0],
            "txt_ids": text_ids.float(),
            "pooled_projections": pooled[0],
        })  # fmt: skip


if args.synthetic:
    write_synthetic()
else:
    encode_images()
manifest = write_latent_manifest(out)  # over every sample in the directory: training reads them all
print(f"wrote {len(list(out.glob('*.safetensors')))} samples to {out}, and their sizes and sha256 to {manifest}")
