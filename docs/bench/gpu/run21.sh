#!/usr/bin/env bash
# The twenty-first lent-GPU call (2026-11-28, an H200): run20's "new" runs again with the refit as
# reviewed (5894b49: where the shape departs the prior's overhead is still tested; a shown overhead
# below zero is none), the online refit's model error per step at FLUX.1's width on one rank (issue 46).
#   run: carry [".whl"], command "bash docs/bench/gpu/run21.sh", timeout_s 300
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
args="bench train --ranks 1 --flux-dims --token-scale 0.5 --steps 12 --modes off,auto --online"
for run in 1 2; do
  section auto_$run 100 $knap $args --json auto_$run.json
done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
