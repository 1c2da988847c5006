"""Train TinyDiT balanced; rank 1 raises in the middle of step 1. The job must exit non-zero with
that error instead of hanging (tests/e2e/test_launch.py)."""

import argparse

import deepspeed
import deepspeed.comm as dist
import torch

import deepspeed_knap
from deepspeed_knap.models.tiny_dit import TinyDiT, random_batch

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
model = TinyDiT()
engine, _, _, _, balancer = deepspeed_knap.initialize(
    args=args, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
)
for step in range(3):
    batch = random_batch([5, 9], 10 * step + dist.get_rank())
    out = engine(batch, balancer)
    if step == 1 and dist.get_rank() == 1:
        raise RuntimeError("injected failure on rank 1 at step 1")
    engine.backward(deepspeed_knap.token_mean_loss(out.square().mean(dim=-1)))
    engine.step()
