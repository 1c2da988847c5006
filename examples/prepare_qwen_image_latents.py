"""Write Qwen-Image latent samples for examples/train_dit.py: one .safetensors file per image.

    # text to image: images with a caption each (photo.png + photo.txt), encoded by a QwenImagePipeline
    python examples/prepare_qwen_image_latents.py --pretrained /models/Qwen-Image --inputs /data/photos --out /data/qwen
    # editing: each target (edit.png + edit.txt, the instruction) with its references edit.ref1.png,
    # edit.ref2.png, ... beside it, encoded by a QwenImageEditPlusPipeline (Edit-2509, Edit-2511)
    python examples/prepare_qwen_image_latents.py --pretrained /models/Qwen-Image-Edit-2509 --inputs /data/edits --out /data/qwen_edit

The file format is documented in deepspeed_knap/models/qwenimage/data.py. Everything is the
pipeline's own code, as it prepares a generation: the VAE's posterior mode normalised by its
``latents_mean`` and ``latents_std`` and packed in 2x2 patches; ``encode_prompt`` (the chat template,
its prefix dropped, no padding); for an edit, each reference at about 1 megapixel for the VAE and
about 384 x 384 px for the vision-language encoder (``calculate_dimensions``), as
``QwenImageEditPlusPipeline`` does. A target keeps its own aspect ratio (the longer side at
``--resolution``, each side a multiple of 16 px). Runs once, before training, on one GPU (bf16) or
the CPU. ``manifest.json`` (each file's size and sha256) is written last.
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from deepspeed_knap.models.latents import prepared_image, targets_and_references, write_latent_manifest
from deepspeed_knap.models.qwenimage.data import REFERENCE_KEY, save_qwen_image_sample
from deepspeed_knap.runtime.manifest import MANIFEST

PIPELINES = ("QwenImagePipeline", "QwenImageEditPlusPipeline")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--pretrained", required=True, help="a QwenImagePipeline or QwenImageEditPlusPipeline directory")
parser.add_argument("--inputs", required=True, help="images with .txt captions (edits: and NAME.refN references)")
parser.add_argument("--out", required=True, help="directory to write the samples to (holding no samples)")
parser.add_argument("--resolution", type=int, default=1024, help="the longer side of a target, px")
parser.add_argument("--max-sequence-length", type=int, default=512, help="text-to-image: tokens per caption")
parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


@torch.no_grad()
def main() -> None:
    import diffusers
    import numpy as np
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise SystemExit(f"{out} already holds samples; give an empty directory")
    (out / MANIFEST).unlink(missing_ok=True)  # a manifest of what was there before would describe other files
    name = json.loads((Path(args.pretrained) / "model_index.json").read_text()).get("_class_name")
    if name not in PIPELINES:
        raise SystemExit(f"{args.pretrained} is a {name}; give a {' or a '.join(PIPELINES)} directory")
    try:
        found = targets_and_references(args.inputs)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    edits = name == "QwenImageEditPlusPipeline"
    if not edits and any(refs for _, _, refs in found):
        raise SystemExit(f"{args.inputs} holds reference images (NAME.refN), which a {name} does not take; give a "
                         "QwenImageEditPlusPipeline directory")  # fmt: skip
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vae = diffusers.AutoencoderKLQwenImage.from_pretrained(args.pretrained, subfolder="vae", torch_dtype=torch.float32)
    pipe = getattr(diffusers, name).from_pretrained(args.pretrained, transformer=None, vae=vae,
                                                    torch_dtype=dtype).to(device)  # fmt: skip
    multiple = pipe.vae_scale_factor * 2  # the VAE's downsampling, then the 2x2 patches

    def encode(image, height: int, width: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The packed, normalised latents ``[L, 4 C]`` of ``image`` at ``height x width`` and its grid."""
        pixels = pipe.image_processor.preprocess(image, height, width).unsqueeze(2).to(device, vae.dtype)
        latents = pipe._encode_vae_image(pixels, None) if edits else _normalised_mode(pipe, pixels)
        channels, frames, lat_h, lat_w = latents.shape[1:]
        packed = pipe._pack_latents(latents, 1, channels, lat_h, lat_w)[0]
        return packed, (frames, lat_h // 2, lat_w // 2)

    for index, (path, caption, refs) in enumerate(tqdm(found, desc="encode")):
        image = prepared_image(path)
        scale = args.resolution / max(image.size)
        width, height = (max(multiple, round(side * scale / multiple) * multiple) for side in image.size)
        latents, target_grid = encode(image, height, width)
        sample = {"latents": latents}
        grids = [target_grid]
        if edits:
            references, condition_images = [], []
            for ref_path in refs:
                ref = prepared_image(ref_path)
                ratio = ref.width / ref.height
                cond_w, cond_h = edit_plus.calculate_dimensions(edit_plus.CONDITION_IMAGE_SIZE, ratio)
                condition_images.append(pipe.image_processor.resize(ref, cond_h, cond_w))
                vae_w, vae_h = edit_plus.calculate_dimensions(edit_plus.VAE_IMAGE_SIZE, ratio)
                packed, grid = encode(ref, vae_h, vae_w)
                references.append(packed)
                grids.append(grid)
            text, _ = pipe.encode_prompt(prompt=caption, image=condition_images or None, device=device)
            if references:
                sample[REFERENCE_KEY] = torch.cat(references)
        else:
            text, _ = pipe.encode_prompt(prompt=caption, device=device, max_sequence_length=args.max_sequence_length)
        sample["encoder_hidden_states"] = text[0]
        sample["img_shapes"] = torch.tensor(np.array(grids), dtype=torch.float32)
        save_qwen_image_sample(out / f"{index:08d}.safetensors", {key: t.float() for key, t in sample.items()})
    manifest = write_latent_manifest(out)
    print(f"wrote {len(found)} samples to {out}, and their sizes and sha256 to {manifest}")


def _normalised_mode(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """``QwenImagePipeline`` has no ``_encode_vae_image`` (it encodes nothing): the VAE's posterior
    mode, normalised as the edit pipelines normalise theirs, ``(z - latents_mean) / latents_std``."""
    latents = pipe.vae.encode(pixels).latent_dist.mode()
    shape = (1, pipe.vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(shape).to(latents)
    std = torch.tensor(pipe.vae.config.latents_std).view(shape).to(latents)
    return (latents - mean) / std


if __name__ == "__main__":
    main()
