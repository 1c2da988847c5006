"""Qwen-Image at its real width on one GPU: PackedQwenImageTransformer against diffusers'
QwenImageTransformer2DModel run sample by sample, forward + backward, bf16.

    python3 docs/bench/gpu/qwen_image.py --blocks 4 --token-scale 1 --json qwen_image.json

The block is the released model's (24 heads of 128, 3,072 wide, text 3,584 wide; ``--zero-cond``:
Edit-2511's reference tokens at timestep 0), ``--blocks`` of its 60. The samples are ``--ranks``
ranks' step of the ``qwen_edit`` mix (text-to-image and edits with 1-3 references of ~1 megapixel)
scaled by ``--token-scale``. Prints, per model, the median seconds of forward + backward and the
peak memory above the weights, and the packed outputs' error against diffusers' (norm of the
difference over diffusers' norm, per sample, max): bf16 rounding only.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepspeed_knap.bench.flux import measure
from deepspeed_knap.models.qwenimage import PackedQwenImageTransformer
from deepspeed_knap.models.qwenimage.data import flow_matching, synthetic_qwen_image_samples
from deepspeed_knap.models.registry import sample_shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--token-scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--zero-cond", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="4 heads of 16, for a CPU check of the script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from diffusers import QwenImageTransformer2DModel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    config = dict(num_layers=args.blocks, zero_cond_t=args.zero_cond)  # the rest: diffusers' defaults, the release
    if args.tiny:
        config.update(num_attention_heads=4, attention_head_dim=16, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    torch.manual_seed(0)
    with device:
        reference = QwenImageTransformer2DModel(**config).to(dtype)
    shapes = [shape for rank in sample_shapes("qwen_edit", args.ranks, 0) for shape in rank]
    latents = synthetic_qwen_image_samples(shapes, reference.config, 0, args.token_scale, dtype)
    samples, _ = flow_matching(latents, torch.Generator().manual_seed(0))
    samples = [{key: t.to(device) for key, t in s.items()} for s in samples]
    packed = PackedQwenImageTransformer.from_diffusers(reference, attention_backend="sdpa")

    def run_diffusers(model) -> torch.Tensor:
        total = 0
        for s in samples:
            grids = [tuple(row) for row in s["img_shapes"].tolist()]
            out = model(hidden_states=s["hidden_states"][None], timestep=s["timestep"].reshape(1),
                        encoder_hidden_states=s["encoder_hidden_states"][None], img_shapes=[grids]).sample  # fmt: skip
            total = total + out[:, : grids[0][0] * grids[0][1] * grids[0][2]].float().square().mean()
        return total

    def run_packed(model) -> torch.Tensor:
        return sum(out.float().square().mean() for out in model.forward_samples(samples))

    # cuDNN's attention backward failed inside diffusers' models on an H100 (bench flux): SDPA's others.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        with torch.no_grad():
            errors = []
            for s, out in zip(samples, packed.forward_samples(samples), strict=True):
                grids = [tuple(row) for row in s["img_shapes"].tolist()]
                ref = reference(hidden_states=s["hidden_states"][None], timestep=s["timestep"].reshape(1),
                                encoder_hidden_states=s["encoder_hidden_states"][None],
                                img_shapes=[grids]).sample  # fmt: skip
                ref = ref[0, : len(out)]
                errors.append(((out.double() - ref.double()).norm() / ref.double().norm()).item())
        results = {"diffusers": measure(functools.partial(run_diffusers, reference), reference, device, args.repeats),
                   "packed": measure(functools.partial(run_packed, packed), packed, device, args.repeats)}  # fmt: skip
    summary = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "config": dict(config),
               "samples": len(samples), "tokens": [len(s["hidden_states"]) + len(s["encoder_hidden_states"])
                                                   for s in samples],
               "references": [len(s["img_shapes"]) - 1 for s in samples], "max_norm_error": max(errors), **results}  # fmt: skip
    print(json.dumps(summary, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)


if __name__ == "__main__":
    main()
