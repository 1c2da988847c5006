#!/usr/bin/env bash
# The eighteenth lent-GPU call (2026-11-28, an H200): the cost model's error per step on one rank
# at FLUX.1's width (bench train --flux-dims: 24 heads of 128, the tiny model's 2 + 2 blocks, bf16),
# with the start-up calibration at the mix's lengths against the FLOP prior (issue 46).
#   run: carry [".whl"], command "bash docs/bench/gpu/run18.sh", timeout_s 300
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
section train_startup 120 $knap bench train --ranks 1 --flux-dims --token-scale 0.5 --steps 6 --modes off --startup-calibration --json train_startup.json
section train_prior 100 $knap bench train --ranks 1 --flux-dims --token-scale 0.5 --steps 6 --modes off --json train_prior.json
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
