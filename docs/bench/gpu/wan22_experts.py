"""Wan 2.2 A14B's two experts at their real width on one GPU: PackedWanExperts against diffusers'
WanTransformer3DModel run sample by sample (each sample through the expert of its timestep, as
WanPipeline does), forward + backward, bf16.

    python3 docs/bench/gpu/wan22_experts.py --blocks 4 --token-scale 1 --json wan22_experts.json

Both experts have A14B's block (40 heads of 128, FFN 13,824, text 4,096; ``--i2v``: 36 input
channels, the I2V-A14B's) but ``--blocks`` blocks each, not 40, so both and their gradients fit.
The samples are one rank's step of ``wan_image_video`` (``--ranks`` pools several), every other one
with a timestep on the high-noise side, so both experts work. Prints, per model, the median seconds of forward + backward
and the peak memory above the weights, and the packed outputs' error against diffusers' (the
norm of the difference over the norm of diffusers', per sample, max): bf16 rounding only.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepspeed_knap.bench.flux import measure
from deepspeed_knap.models.registry import sample_shapes
from deepspeed_knap.models.wan import PackedWanTransformer
from deepspeed_knap.models.wan.data import synthetic_video_samples
from deepspeed_knap.models.wan.experts import DEFAULT_BOUNDARY_RATIO, PackedWanExperts
from deepspeed_knap.models.wan.finetune import flow_matching


def a14b_config(blocks: int, i2v: bool) -> dict:
    return dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=36 if i2v else 16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=blocks,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--token-scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--i2v", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="4 heads of 16, for a CPU check of the script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from diffusers import WanTransformer3DModel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    config = a14b_config(args.blocks, args.i2v)
    if args.tiny:
        config.update(num_attention_heads=4, attention_head_dim=16, ffn_dim=96, text_dim=32, freq_dim=16)
    torch.manual_seed(0)
    with device:
        references = [WanTransformer3DModel(**config).to(dtype) for _ in range(2)]
    shapes = [shape for rank in sample_shapes("wan_image_video", args.ranks, 0) for shape in rank]
    data_config = {**config, "image_dim": None}
    objective = flow_matching(synthetic_video_samples(shapes, data_config, 0, args.token_scale, dtype),
                              torch.Generator().manual_seed(0), config["patch_size"])  # fmt: skip
    samples = [{key: t.to(device) for key, t in s.items()} for s in objective.samples]
    boundary = DEFAULT_BOUNDARY_RATIO * 1000
    draw = torch.Generator().manual_seed(1)
    for i, s in enumerate(samples):  # every other sample on the high-noise side, so both experts work
        low, high = (boundary, 1000.0) if i % 2 == 0 else (0.0, boundary)
        s["timestep"] = (low + (high - low) * torch.rand((), generator=draw)).to(device)
    expert = [0 if float(s["timestep"].max()) >= boundary else 1 for s in samples]

    def run_diffusers(_model) -> torch.Tensor:
        total = 0
        for s, e in zip(samples, expert, strict=True):
            out = references[e](hidden_states=s["hidden_states"][None], timestep=s["timestep"].reshape(1),
                                encoder_hidden_states=s["encoder_hidden_states"][None]).sample  # fmt: skip
            total = total + out.float().square().mean()
        return total

    packed = PackedWanExperts(*(PackedWanTransformer.from_diffusers(r, attention_backend="sdpa") for r in references),
                              boundary_ratio=DEFAULT_BOUNDARY_RATIO)  # fmt: skip

    def run_packed(model) -> torch.Tensor:
        return sum(out.float().square().mean() for out in model.forward_samples(samples))

    # cuDNN's attention backward failed inside diffusers' models on an H100 (bench flux): SDPA's others.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        with torch.no_grad():
            errors = []
            for s, e, out in zip(samples, expert, packed.forward_samples(samples), strict=True):
                ref = references[e](hidden_states=s["hidden_states"][None], timestep=s["timestep"].reshape(1),
                                    encoder_hidden_states=s["encoder_hidden_states"][None]).sample[0]  # fmt: skip
                errors.append(((out.double() - ref.double()).norm() / ref.double().norm()).item())
        holder = torch.nn.ModuleList(references)
        results = {"diffusers": measure(functools.partial(run_diffusers, holder), holder, device, args.repeats),
                   "packed": measure(functools.partial(run_packed, packed), packed, device, args.repeats)}  # fmt: skip
    tokens = [s["hidden_states"][0].numel() // 4 for s in samples]
    summary = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "config": config,
               "samples": len(samples), "video_tokens": tokens, "experts": expert, "max_norm_error": max(errors),
               **results}  # fmt: skip
    print(json.dumps(summary, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)


if __name__ == "__main__":
    main()
