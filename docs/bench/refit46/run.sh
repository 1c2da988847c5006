#!/bin/bash
# The issue-46 must-show on 2 CPU ranks: 5 runs each, JSON per run, into OUT (default: this folder;
# a relative OUT is taken from the repository root).
#   bash docs/bench/refit46/run.sh [OUT]
# NO_PREFETCH=1 also runs the FLUX rows with plans solved in the step, into OUT/no_prefetch.
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
OUT=${1:-docs/bench/refit46}
mkdir -p "$OUT"
B=".venv/bin/deepspeed-knap bench train --ranks 2 --online"
MODES="off,knapformer,knapformer@g1n2,auto"
for run in 1 2 3 4 5; do
  for mix in kf_lowres kf_mixed_res kf_image_video; do
    $B --family flux --mix $mix --token-scale 0.25 --steps 17 --modes $MODES --json "$OUT/${mix}_run$run.json" > /dev/null 2>&1
  done
  for slow in 0 1; do
    $B --family flux --token-scale 0.25 --steps 9 --modes off,auto --slow-rank $slow:2 --json "$OUT/slow${slow}_run$run.json" > /dev/null 2>&1
  done
  $B --family wan --token-scale 0.0625 --steps 9 --modes $MODES --json "$OUT/wan_run$run.json" > /dev/null 2>&1
  echo "run $run done $(date +%T)"
  rm -f /dev/shm/sem.mp-* 2>/dev/null
done
if [ -n "$NO_PREFETCH" ]; then
  # The same FLUX runs with plans solved in the step (no plan worker competing for the 2 cores).
  mkdir -p "$OUT/no_prefetch"
  for run in 1 2 3 4 5; do
    for mix in kf_image_video kf_mixed_res; do
      $B --family flux --mix $mix --token-scale 0.25 --steps 17 --modes $MODES --no-prefetch --json "$OUT/no_prefetch/np_${mix}_run$run.json" > /dev/null 2>&1
    done
  done
fi
