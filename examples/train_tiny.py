"""Train TinyDiT for a few steps with DeepSpeed and balancing: the smallest end-to-end training script.

    deepspeed --num_gpus 4 examples/train_tiny.py --deepspeed_config ds_configs/tiny_cpu_zero3.json
    mpirun -n 4 python examples/train_tiny.py --deepspeed_config ds_configs/tiny_cpu_zero3.json

Every step each rank draws samples of very different sizes (a bundled data mix, scaled down for
CPU), runs the balanced model, and takes an optimizer step on the global token-mean loss. Rank 0
prints the loss per step. The same script runs with balancing off when the config's "knapformer"
block says "enabled": false.
"""

import argparse
import os
import sys
import warnings

import deepspeed
import deepspeed.comm as dist
import torch

import deepspeed_knap
from deepspeed_knap import sample_mix
from deepspeed_knap.models.tiny_dit import TinyDiT, random_batch
from deepspeed_knap.options import add_mix_argument
from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

# ZeRO-3 calls two torch.distributed functions that torch deprecated, on every rank, every step.
warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
add_mix_argument(parser, "kf_mixed_res")
parser.add_argument("--token-scale", type=float, default=1 / 64, help="shrink lengths so CPU ranks keep up")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--save-dir", default=None, help="save a DeepSpeed checkpoint here at the end")
parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)  # the same initial weights on every rank
model = TinyDiT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, _, _, _, balancer = deepspeed_knap.initialize(args=args, model=model, optimizer=optimizer)
rank, world = dist.get_rank(), dist.get_world_size()
dist.barrier()  # every rank has mapped every rank's CPU all-reduce buffer: the files can go
unlink_own_shm_buffer(rank)

for step in range(args.steps):
    lengths = [max(1, round(n * args.token_scale)) for n in sample_mix(args.mix, world, seed=step)[rank]]
    batch = random_batch(lengths, seed=1000 * step + rank).to(engine.device)  # collectives need it there
    target = torch.randn(batch.tokens.shape, generator=torch.Generator().manual_seed(7 * step + rank)).to(engine.device)
    out = engine(batch, balancer)
    loss = deepspeed_knap.token_mean_loss((out - target).square().mean(dim=-1))
    engine.backward(loss)
    engine.step()
    mean_loss = deepspeed_knap.global_mean_loss(loss)
    if rank == 0:
        print(f"step {step} loss {mean_loss:.8f}", flush=True)

if args.save_dir:
    engine.save_checkpoint(args.save_dir)

# DeepSpeed 0.19's ZeRO-3 on gloo CPU ranks aborts in C++ static destruction at interpreter exit in
# about one run in five ("terminate called without an active exception", no Python frame), even after
# engine.destroy() and destroy_process_group(); ZeRO-1/2 do not. Leave without that teardown.
dist.barrier()
sys.stdout.flush()
os._exit(0)
