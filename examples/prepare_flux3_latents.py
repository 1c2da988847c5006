"""Write FLUX.3 latent samples for examples/train_dit.py: one .safetensors file per image.

    # text to image: images with a caption each (photo.png + photo.txt)
    python examples/prepare_flux3_latents.py --pretrained /models/FLUX.3 --inputs /data/photos --out /data/flux3
    # edits: each target (edit.png + edit.txt, the instruction) with its references edit.ref1.png,
    # edit.ref2.png, ... beside it; a folder may mix edits and images without references
    python examples/prepare_flux3_latents.py --pretrained /models/FLUX.3 --inputs /data/edits --out /data/flux3_edit

The file format is documented in deepspeed_knap/models/flux3/data.py. ``--pretrained`` is a FLUX.3
modular pipeline folder (``modular_model_index.json`` or ``model_index.json``; its transformer is not
loaded). Everything is diffusers' modular FLUX.3 pipeline's own code (``Flux3AutoBlocks``), as it
prepares a generation: the caption by the text encoder step's helper (Qwen3-VL's stacked hidden
states of the chat-templated text, right-padded to a multiple of 80 tokens: the transformer attends
to the padding); the target by the VAE encoder step (posterior mode, normalised by the VAE's
batch-norm statistics, patchified: what the pipeline's decode undoes), at its own aspect ratio with
the longer side at ``--resolution`` and each side a multiple of 16 px; references as the pipeline
prepares them (one kept whole and reflect-padded to its 16 px canvas under 4 megapixels, several
each fitted under 1 megapixel and cropped to the grid), then encoded the same way. Ids are the
pipeline's (``flux3_image_ids``). Runs once, before training, on one GPU (bf16, the VAE in float32)
or the CPU. ``manifest.json`` (each file's size and sha256) is written last.
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from deepspeed_knap.models.flux3.data import flux3_latent_tokens, flux3_reference_tokens, save_flux3_sample
from deepspeed_knap.models.latents import prepared_image, targets_and_references, write_latent_manifest
from deepspeed_knap.runtime.manifest import MANIFEST

INDEXES = ("modular_model_index.json", "model_index.json")  # a FLUX.3 modular pipeline folder's, either

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--pretrained", required=True, help="a FLUX.3 modular pipeline directory")
parser.add_argument("--inputs", required=True, help="images with .txt captions (edits: and NAME.refN references)")
parser.add_argument("--out", required=True, help="directory to write the samples to (holding no samples)")
parser.add_argument("--resolution", type=int, default=1024, help="the longer side of a target, px")
parser.add_argument("--max-sequence-length", type=int, default=8192,
                    help="text tokens per caption at most (the text encoder step's default)")  # fmt: skip
parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")


def check_pretrained(path: Path) -> None:
    """Refuse a folder that is not a FLUX.3 modular pipeline's (reads its index only)."""
    index = next((path / name for name in INDEXES if (path / name).is_file()), None)
    if index is None:
        raise SystemExit(f"--pretrained {path}: no {' or '.join(INDEXES)} there; give a FLUX.3 modular pipeline "
                         "directory (its text_encoder/, tokenizer/ and vae/ encode the data)")  # fmt: skip
    name = json.loads(index.read_text()).get("_class_name", "")
    if not name.startswith("Flux3"):
        raise SystemExit(f"--pretrained {path} is a {name or 'pipeline without a _class_name'} ({index.name}); give a "
                         "FLUX.3 modular pipeline directory (Flux3ModularPipeline)")  # fmt: skip


@torch.no_grad()
def main() -> None:
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.modular_pipelines.flux3.encoders import Flux3VaeEncoderStep
    from diffusers.modular_pipelines.flux3.modular_blocks_flux3 import Flux3VaeEncoderSequentialStep

    from deepspeed_knap.models.flux3.generate import (
        blocks_pipeline,
        encode_flux3_prompt,
        load_flux3_pipeline,
        reference_problem,
    )

    args = parser.parse_args()
    try:
        found = targets_and_references(args.inputs)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    check_pretrained(Path(args.pretrained))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise SystemExit(f"{out} already holds samples; give an empty directory")
    (out / MANIFEST).unlink(missing_ok=True)  # a manifest of what was there before would describe other files
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        pipe = load_flux3_pipeline(args.pretrained, dtype, device)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if dtype != torch.float32:  # the targets' latents are what training fits: the VAE's float32 weights
        pipe.load_components(names=["vae"], dtype=torch.float32)
        pipe.vae.to(device)
    encode_target = blocks_pipeline(Flux3VaeEncoderStep(), pipe)  # normalised, patchified: [1, C, h, w]
    encode_references = blocks_pipeline(Flux3VaeEncoderSequentialStep(), pipe)  # preprocessed as the pipeline does
    multiple = pipe.vae_scale_factor * 2  # the VAE's downsampling, then the 2x2 patches
    grid = pipe.image_processor.config.vae_scale_factor

    for index, (path, caption, refs) in enumerate(tqdm(found, desc="encode")):
        image = prepared_image(path)
        scale = args.resolution / max(image.size)
        width, height = (max(multiple, round(side * scale / multiple) * multiple) for side in image.size)
        # The plain resize to the target's size (the FLUX.3 processor's own preprocess pads or crops references).
        pixels = VaeImageProcessor.preprocess(pipe.image_processor, image, height, width)
        latents = encode_target(condition_images=[pixels], output="image_cond_latents")[0]
        sample = dict(zip(("latents", "img_ids"), flux3_latent_tokens(latents), strict=True))
        sample["encoder_hidden_states"], sample["txt_ids"] = encode_flux3_prompt(pipe, caption,
                                                                                 args.max_sequence_length, device)  # fmt: skip
        if refs:
            images = [prepared_image(ref) for ref in refs]
            problem = reference_problem([str(ref) for ref in refs], images, grid)
            if problem:
                raise SystemExit(f"{path}: {problem}")
            cond = encode_references(image=images, output="image_cond_latents")
            sample["image_cond_hidden_states"], sample["image_cond_ids"] = flux3_reference_tokens(cond)
        save_flux3_sample(out / f"{index:08d}.safetensors", {key: t.float() for key, t in sample.items()})
    manifest = write_latent_manifest(out)
    edits = sum(bool(refs) for _, _, refs in found)
    print(f"wrote {len(found)} samples ({edits} edits) to {out}, and their sizes and sha256 to {manifest}")


if __name__ == "__main__":
    main()
