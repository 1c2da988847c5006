#!/bin/bash
# Twins: knapformer on g1n2 twice in one run (--topology g1n2 makes the plain mode g1n2 too), beside
# auto, 8 runs of kf_mixed_res x1/4 on 2 CPU ranks; JSON per run into OUT (default: this folder).
#   bash docs/bench/refit46/twin/run.sh [OUT]; .venv/bin/python docs/bench/refit46/twin/twins.py OUT/*.json
cd "$(dirname "$0")/../../../.."
export OMP_NUM_THREADS=1
OUT=${1:-docs/bench/refit46/twin}
mkdir -p "$OUT"
for run in 1 2 3 4 5 6 7 8; do
  .venv/bin/deepspeed-knap bench train --ranks 2 --online --family flux --mix kf_mixed_res --token-scale 0.25 \
    --steps 17 --topology g1n2 --modes off,knapformer,knapformer@g1n2,auto \
    --json "$OUT/kf_mixed_res_twin_run$run.json" > /dev/null 2>&1
  rm -f /dev/shm/sem.mp-* 2>/dev/null
done
