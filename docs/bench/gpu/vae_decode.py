"""Seconds of one VAE decode at the real families' VAE widths on one GPU, against the output's pixels:
the price of the decode that ``generate`` places on a rank (docs/generation.md, Decodes).

    python3 docs/bench/gpu/vae_decode.py --json vae_decode.json

The VAEs are built from their checkpoints' configs with random weights (the time does not depend on
the values) in the dtype their pipelines decode in: Wan 2.1's and Wan 2.2's ``AutoencoderKLWan`` in
float32 (diffusers' Wan examples load them so), FLUX's ``AutoencoderKL`` and Qwen-Image's
``AutoencoderKLQwenImage`` in bfloat16. Prints, per VAE and output size, the median seconds of
``vae.decode`` (after one warm-up), the peak memory, and the seconds per output megapixel-frame.
``--tiny`` shrinks every VAE, for a CPU check of the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                 patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
                 latents_mean=[0.0] * 48, latents_std=[1.0] * 48)  # fmt: skip
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                layers_per_block=2, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip


def cases(tiny: bool) -> list[tuple[str, object, torch.dtype, list[tuple[int, int, int]]]]:
    """``(name, VAE, dtype, [(frames, height, width), ...])``."""
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan

    shrink = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1) if tiny else {}
    wan22 = {**WAN22_VAE, **shrink, "decoder_base_dim": 8 if tiny else 256}
    flux = {**FLUX_VAE, "block_out_channels": [32, 32, 32, 32]} if tiny else FLUX_VAE
    video = [(17, 480, 832), (33, 480, 832), (81, 480, 832)] if not tiny else [(5, 64, 64), (9, 64, 64)]
    video_720 = [(17, 704, 1280), (81, 704, 1280)] if not tiny else [(5, 64, 64)]
    images = [(1, 1024, 1024), (1, 512, 512)] if not tiny else [(1, 64, 64)]
    return [
        ("wan2.1", AutoencoderKLWan(**shrink), torch.float32, video),
        ("wan2.2", AutoencoderKLWan(**wan22), torch.float32, video_720),
        ("flux", AutoencoderKL(**flux), torch.bfloat16, images),
        ("qwen-image", AutoencoderKLQwenImage(**shrink), torch.bfloat16, [(1, 1328, 1328), *images]),
    ]


def latent_shape(name: str, vae: object, frames: int, height: int, width: int) -> tuple[int, ...]:
    config = vae.config
    if name == "flux":
        return (1, config.latent_channels, height // 8, width // 8)
    spatial = getattr(config, "scale_factor_spatial", 8)
    return (1, config.z_dim, (frames - 1) // 4 + 1, height // spatial, width // spatial)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    rows = []
    for name, vae, dtype, sizes in cases(args.tiny):
        vae = vae.to(device, dtype).eval()
        for frames, height, width in sizes:
            latents = torch.randn(latent_shape(name, vae, frames, height, width), device=device, dtype=dtype)
            seconds = []
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                for _ in range(args.repeats + 1):
                    if cuda:
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    vae.decode(latents, return_dict=False)
                    if cuda:
                        torch.cuda.synchronize()
                    seconds.append(time.perf_counter() - start)
            median = statistics.median(seconds[1:])
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            row = dict(vae=name, dtype=str(dtype).removeprefix("torch."), frames=frames, height=height, width=width,
                       seconds=median, peak_gib=peak, seconds_per_mpixel_frame=median / (frames * height * width / 1e6))  # fmt: skip
            rows.append(row)
            print(f"{name:10s} {row['dtype']:8s} {frames:3d} x {height} x {width}: {median:7.3f} s, "
                  f"{peak:5.1f} GiB peak, {row['seconds_per_mpixel_frame']:.4f} s per megapixel-frame", flush=True)  # fmt: skip
        vae.to("cpu")
        del vae
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
