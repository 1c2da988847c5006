#!/usr/bin/env bash
# The twentieth lent-GPU call (2026-11-28, an H200): the online refit's model error per step at
# FLUX.1's width on one rank, with the start-up calibration "auto" runs on a GPU, before and after
# the refit kept the prior's overhead in proportion (issue 46). "old" is d715882's package, carried
# as gpu_old/ for this call only (mkdir gpu_old && git archive d715882 deepspeed_knap | tar x -C gpu_old;
# removed after); runs interleaved, new first.
#   run: carry [".whl"], command "bash docs/bench/gpu/run20.sh", timeout_s 420
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
args="bench train --ranks 1 --flux-dims --token-scale 0.5 --steps 12 --modes off,auto --online"
for run in 1 2; do
  section auto_new_$run 100 $knap $args --json auto_new_$run.json
  section auto_old_$run 100 env PYTHONPATH=/tmp/site:$REPO/gpu_old $knap $args --json auto_old_$run.json
done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
