"""TinyDiT balanced under ZeRO-3 through ``deepspeed_knap.initialize``, a few training steps; the faults
of tests/e2e/test_faults_launch.py are injected around them.

    --stop-rank R --stop-step S   rank R stops itself (SIGSTOP) right before the forward of step S, so
                                  the others wait for it in ZeRO-3's parameter all-gather (TinyDiT's
                                  first layer runs before any routing; from the third step on, ZeRO-3's
                                  recorded trace checks nothing across ranks before it)

Each rank prints ``rank R started`` once ``initialize`` returned and ``rank R done`` after its steps.
"""

import argparse
import os
import signal
import sys
import time
import warnings

import deepspeed
import deepspeed.comm as dist
import torch

import deepspeed_knap
from deepspeed_knap.models.tiny_dit import TinyDiT, random_batch
from deepspeed_knap.runtime.shm_buffers import unlink_own_shm_buffer

warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--stop-rank", type=int, default=None)
parser.add_argument("--stop-step", type=int, default=0)
parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
model = TinyDiT()
engine, _, _, _, balancer = deepspeed_knap.initialize(
    args=args, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
)
rank = dist.get_rank()
dist.barrier()  # every rank has mapped every rank's CPU all-reduce buffer: this rank's file can go
unlink_own_shm_buffer(rank)
print(f"rank {rank} started", flush=True)
for step in range(args.steps):
    if rank == args.stop_rank and step == args.stop_step:
        print(f"rank {rank} stops at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    out = engine(random_batch([5, 9], seed=10 * step + rank).to(engine.device), balancer)
    engine.backward(deepspeed_knap.token_mean_loss(out.square().mean(dim=-1)))
    engine.step()
print(f"rank {rank} done", flush=True)
# Leave without DeepSpeed's C++ teardown, as examples/train_tiny.py does (ZeRO-3 on gloo sometimes
# aborts in static destruction at exit).
dist.barrier()
sys.stdout.flush()
os._exit(0)
