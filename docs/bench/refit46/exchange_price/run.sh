#!/bin/bash
# Issue 46: the start-up calibration's timed Ulysses price (c) against its scaled prior (a worktree of
# 515c708 given as OLD), and the Wan row without the start-up calibration; interleaved, five runs
# each, 2 CPU ranks. Outputs beside this script: {new,old,none}_{wan,kf_image_video,kf_mixed_res}_runN.json
#   OLD=/path/to/515c708/worktree bash docs/bench/refit46/exchange_price/run.sh
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1
OUT=$PWD/docs/bench/refit46/exchange_price
PY=$PWD/.venv/bin/python
MODES="off,knapformer,knapformer@g1n2,auto"
WAN="bench train --ranks 2 --online --family wan --token-scale 0.0625 --steps 9 --modes $MODES"
FLUX="bench train --ranks 2 --online --family flux --token-scale 0.25 --steps 17 --modes $MODES --startup-calibration"
for run in ${RUNS:-1 2 3 4 5}; do
  $PY -m deepspeed_knap.cli $WAN --startup-calibration --json $OUT/new_wan_run$run.json > /dev/null 2>&1
  (cd "$OLD" && $PY -m deepspeed_knap.cli $WAN --startup-calibration --json $OUT/old_wan_run$run.json > /dev/null 2>&1)
  $PY -m deepspeed_knap.cli $WAN --json $OUT/none_wan_run$run.json > /dev/null 2>&1
  for mix in kf_image_video kf_mixed_res; do
    $PY -m deepspeed_knap.cli $FLUX --mix $mix --json $OUT/new_${mix}_run$run.json > /dev/null 2>&1
    (cd "$OLD" && $PY -m deepspeed_knap.cli $FLUX --mix $mix --json $OUT/old_${mix}_run$run.json > /dev/null 2>&1)
  done
  rm -f /dev/shm/sem.mp-* 2>/dev/null
  echo "run $run done $(date +%T)"
done
