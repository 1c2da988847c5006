"""Fine-tune FLUX with DeepSpeed (ZeRO-3) and KnapFormer balancing on mixed image + video latents.

    deepspeed --num_gpus 4 examples/train_flux.py --deepspeed_config ds_configs/flux_cpu_demo.json --tiny
    deepspeed --hostfile hosts examples/train_flux.py --deepspeed_config ds_configs/flux_zero3_knap.json \\
        --model-path /models/FLUX.1-dev --data-dir /data/flux_latents --export-dir out/flux-finetuned

Each step every rank takes its samples (synthetic latents of a bundled workload, or ``--data-dir``
files written by ``examples/prepare_flux_latents.py``), draws the rectified-flow noise level per
sample, runs the packed model (balanced when the config's ``"knapformer"`` block is enabled) and
steps on the global token-mean loss. Rank 0 shows a progress bar and prints, per step, the loss,
the step time, tokens per second and the modeled imbalance before and after balancing.
"""

import argparse
import os
import sys
import time

import deepspeed
import deepspeed.comm as dist
import torch
from tqdm import tqdm

import deepspeed_knap
from deepspeed_knap.config import load_ds_config
from deepspeed_knap.models.flux import PackedFluxTransformer
from deepspeed_knap.models.flux_data import LatentDirectory, SyntheticLatents, rectified_flow

# A FLUX small enough for CPU ranks: every kind of block and guidance, 4 heads for bags of up to 4.
TINY_FLUX = dict(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))  # fmt: skip

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
model_source = parser.add_mutually_exclusive_group(required=True)
model_source.add_argument("--model-path", help="diffusers FLUX checkpoint: a pipeline or transformer directory")
model_source.add_argument("--tiny", action="store_true", help="a small random FLUX for CPU runs")
parser.add_argument("--data-dir", help="latent samples (.safetensors); default: synthetic latents of --workload")
parser.add_argument("--samples-per-rank", type=int, default=1, help="with --data-dir: files per rank per step")
parser.add_argument("--workload", default="kf_image_video", help="synthetic data: a deepspeed-knap workload name")
parser.add_argument("--token-scale", type=float, default=1.0, help="synthetic data: shrink sample sizes (CPU: 1/64)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (unless the config has an optimizer)")
parser.add_argument("--guidance", type=float, default=1.0, help="guidance scale fed to guidance-distilled models")
parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute each block in backward")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--save-dir", help="save a DeepSpeed (ZeRO) checkpoint here at the end")
parser.add_argument("--export-dir", help="write the trained weights here in diffusers format at the end")
parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(args.seed)  # the same initial weights on every rank
options = dict(gradient_checkpointing=args.gradient_checkpointing)
if args.model_path:
    model = PackedFluxTransformer.from_pretrained(args.model_path, **options)
else:
    model = PackedFluxTransformer(**TINY_FLUX, **options)
if "optimizer" in load_ds_config(args.deepspeed_config):  # DeepSpeed's own (fused on GPU)
    engine, _, _, _, balancer = deepspeed_knap.initialize(args=args, model=model, model_parameters=model.parameters())
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    engine, _, _, _, balancer = deepspeed_knap.initialize(args=args, model=model, optimizer=optimizer)
rank, world = dist.get_rank(), dist.get_world_size()
flux = engine.module
dtype = next(flux.parameters()).dtype  # bf16 under a "bf16" config: inputs must match
data = (
    LatentDirectory(args.data_dir, args.samples_per_rank)
    if args.data_dir
    else SyntheticLatents(args.workload, flux.config, args.token_scale, args.seed)
)
guidance = args.guidance if flux.config["guidance_embeds"] else None

progress = tqdm(range(args.steps), desc="train_flux", disable=rank != 0, file=sys.stdout)
for step in progress:
    start = time.perf_counter()
    samples, targets = rectified_flow(
        data.step_samples(step, rank, world, dtype),
        torch.Generator().manual_seed((args.seed * 7919 + step) * 4099 + rank),
        guidance,
    )
    inputs = flux.pack(samples).to(engine.device)
    prediction = engine(inputs, balancer)  # [tokens, C] for this rank's image/video tokens
    target = torch.cat(targets).to(prediction.device) if targets else torch.zeros_like(prediction)
    loss = deepspeed_knap.token_mean_loss((prediction.float() - target.float()).square().mean(dim=-1))
    engine.backward(loss)
    engine.step()
    mean_loss = deepspeed_knap.global_mean_loss(loss)  # also a barrier: the step is over everywhere
    seconds = time.perf_counter() - start
    tokens = torch.tensor([float(sum(inputs.img_lens) + sum(inputs.txt_lens))])
    dist.all_reduce(tokens)
    if rank == 0:
        line = f"step {step} loss {mean_loss:.6f} time {seconds:.2f}s tokens/s {tokens.item() / seconds:,.0f}"
        if balancer is not None:
            metrics = balancer.metrics()
            line += (
                f" imbalance {metrics['knapformer/imbalance_before']:.3f} -> "
                f"{metrics['knapformer/imbalance_after']:.3f}"
            )
        progress.write(line)

if args.save_dir:
    engine.save_checkpoint(args.save_dir)
if args.export_dir:
    state_dict = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_stage() == 3 else None
    if rank == 0:
        flux.save_pretrained(args.export_dir, state_dict)
        print(f"exported diffusers weights to {args.export_dir}", flush=True)

# DeepSpeed 0.19's ZeRO-3 on gloo CPU ranks aborts in C++ teardown at exit in about one run in five
# (see examples/train_tiny.py); leave without it once every rank is done.
dist.barrier()
sys.stdout.flush()
os._exit(0)
