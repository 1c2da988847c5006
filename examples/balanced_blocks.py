"""Run a small DiT balanced and unbalanced on the same mixed-size samples, and compare.

    deepspeed --num_gpus 4 examples/balanced_blocks.py --topology g1n2+g2n1

On a machine without GPUs the launcher starts CPU ranks that talk over gloo. Each step every rank
draws samples of very different sizes (a bundled data mix, scaled down for CPU), the ranks plan
together, route tokens to their bags, run the blocks with Ulysses attention inside each bag, and
route the outputs back. The output must equal the unbalanced run of the same samples.
"""

import argparse
import os
import sys
import time

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator

from deepspeed_knap import (
    KnapBalancer,
    build_topology,
    create_process_groups,
    default_cost_model,
    plan_routing,
    sample_mix,
)
from deepspeed_knap.models.tiny_dit import TinyDiT, random_batch
from deepspeed_knap.options import add_mix_argument
from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--topology", default="g1n2+g2n1")
add_mix_argument(parser, "kf_image_video")
parser.add_argument("--token-scale", type=float, default=1 / 64, help="shrink lengths so CPU ranks keep up")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
args = parser.parse_args()

deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device(get_accelerator().current_device_name())  # collectives take tensors there
dist.barrier()  # every rank has mapped every rank's CPU all-reduce buffer: the files can go
unlink_own_shm_buffer(rank)
topology = build_topology(args.topology, world)
balancer = KnapBalancer(create_process_groups(topology), default_cost_model("flux-dev"))
torch.manual_seed(0)  # the same weights on every rank
model = TinyDiT(topology=topology).double().to(device)

for step in range(args.steps):
    all_lens = sample_mix(args.mix, world, seed=step)  # every rank draws the same, keeps its own
    my_lens = [max(1, round(n * args.token_scale)) for n in all_lens[rank]]
    batch = random_batch(my_lens, seed=1000 * step + rank, dtype=torch.float64).to(device)
    start = time.perf_counter()
    balanced = model(batch, balancer)
    seconds = time.perf_counter() - start
    unbalanced = model(batch)
    error = torch.tensor([(balanced - unbalanced).abs().max().item() if batch.num_tokens else 0.0], device=device)
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    if rank == 0:
        gathered = [[max(1, round(n * args.token_scale)) for n in lens] for lens in all_lens]
        none = plan_routing(gathered, topology, balancer.cost_model, "none")
        plan = plan_routing(gathered, topology, balancer.cost_model)
        print(f"step {step}: {plan.seq_lens.size} sequences, modeled imbalance {none.imbalance:.2f} -> "
              f"{plan.imbalance:.2f}, tokens moved {plan.tokens_moved_fraction:.0%}, "
              f"balanced forward {seconds:.2f} s, max |balanced - unbalanced| = {error.item():.1e}")  # fmt: skip

# DeepSpeed 0.19 on gloo CPU ranks can abort in C++ teardown at interpreter exit ("terminate called
# without an active exception", no Python frame; seen here once in a test run, see
# examples/train_tiny.py); leave without it once every rank is done.
dist.barrier()
sys.stdout.flush()
os._exit(0)
