#!/bin/bash
# Issue 46, later session: the must-show's FLUX mixes with the start-up calibration (--startup-calibration,
# the mix's lengths), before (d715882, a worktree given as OLD) and after the online refit kept the
# prior's overhead in proportion; interleaved, five runs each, 2 CPU ranks.
#   OLD=/path/to/d715882/worktree bash docs/bench/refit46/startup/run.sh
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1
OUT=$PWD/docs/bench/refit46/startup
PY=$PWD/.venv/bin/python
ARGS="bench train --ranks 2 --online --family flux --token-scale 0.25 --steps 17 --startup-calibration"
MODES="off,knapformer,knapformer@g1n2,auto"
for run in ${RUNS:-1 2 3 4 5}; do
  for mix in kf_image_video kf_mixed_res; do
    $PY -m deepspeed_knap.cli $ARGS --mix $mix --modes $MODES --json $OUT/new_${mix}_run$run.json > /dev/null 2>&1
    (cd "$OLD" && $PY -m deepspeed_knap.cli $ARGS --mix $mix --modes $MODES --json $OUT/old_${mix}_run$run.json > /dev/null 2>&1)
    rm -f /dev/shm/sem.mp-* 2>/dev/null
  done
  echo "run $run done $(date +%T)"
done
