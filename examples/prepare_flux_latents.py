"""Write latent samples for examples/train_flux.py: one .safetensors file per sample.

    # real data: images with a caption each (photo.jpg + photo.txt), encoded by a FLUX pipeline
    python examples/prepare_flux_latents.py --out /data/flux_latents --pipeline /models/FLUX.1-dev --images /data/photos
    # synthetic data of a bundled workload's sizes (no weights needed)
    python examples/prepare_flux_latents.py --out /tmp/latents --synthetic kf_mixed_res --count 64

The file format is documented in deepspeed_knap/models/flux_data.py. Encoding needs diffusers,
transformers and the pipeline's weights, and runs once, before training, on one GPU.
"""

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from deepspeed_knap.models.flux_data import save_latent_sample, synthetic_samples
from deepspeed_knap.workloads import sample_shapes

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--out", required=True, help="directory to write the samples to")
source = parser.add_mutually_exclusive_group(required=True)
source.add_argument("--images", help="a directory of images, each with a .txt caption of the same name")
source.add_argument("--synthetic", metavar="WORKLOAD", help="random latents of a bundled workload's sizes")
parser.add_argument("--pipeline", help="with --images: a diffusers FLUX pipeline directory")
parser.add_argument("--resolution", type=int, default=1024, help="with --images: resize the longer side to this")
parser.add_argument("--count", type=int, default=64, help="with --synthetic: how many samples")
parser.add_argument("--token-scale", type=float, default=1.0, help="with --synthetic: shrink sizes")
parser.add_argument("--in-channels", type=int, default=64, help="with --synthetic: the model's dims")
parser.add_argument("--joint-attention-dim", type=int, default=4096)
parser.add_argument("--pooled-projection-dim", type=int, default=768)
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)


def write_synthetic() -> None:
    dims = {"in_channels": args.in_channels, "joint_attention_dim": args.joint_attention_dim,
            "pooled_projection_dim": args.pooled_projection_dim}  # fmt: skip
    shapes = [shape for step in range(args.count) for rank in sample_shapes(args.synthetic, 1, seed=step)
              for shape in rank][: args.count]  # fmt: skip
    for index, sample in enumerate(tqdm(synthetic_samples(shapes, dims, seed=0, token_scale=args.token_scale))):
        save_latent_sample(out / f"{index:08d}.safetensors", sample)


@torch.no_grad()
def encode_images() -> None:
    from diffusers import FluxPipeline
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    if not args.pipeline:
        parser.error("--images needs --pipeline, the FLUX pipeline whose VAE and text encoders encode them")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = FluxPipeline.from_pretrained(args.pipeline, transformer=None, torch_dtype=torch.bfloat16).to(device)
    multiple = pipe.vae_scale_factor * 2  # the VAE's 8x, then 2x2 packing
    images = sorted(p for p in Path(args.images).iterdir() if p.suffix.lower() in {".jpg", ".jpeg", ".png", ".webp"})
    for index, path in enumerate(tqdm(images)):
        image = Image.open(path).convert("RGB")
        scale = args.resolution / max(image.size)
        width, height = (max(multiple, round(side * scale / multiple) * multiple) for side in image.size)
        pixels = pil_to_tensor(image.resize((width, height), Image.BICUBIC)).to(device, torch.bfloat16)
        latents = pipe.vae.encode(pixels[None] / 127.5 - 1).latent_dist.sample()
        latents = (latents - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        channels, lat_h, lat_w = latents.shape[1:]
        caption = path.with_suffix(".txt").read_text().strip()
        prompt_embeds, pooled, text_ids = pipe.encode_prompt(caption, device=device)
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
print(f"wrote {len(list(out.glob('*.safetensors')))} samples to {out}")
