#!/usr/bin/env bash
# The sixth lent-GPU call (2026-11-26, right after run5.sh): the second run of the six matrix
# configurations run5.sh's deadline cut, four lanes; FLUX.2 flux2_edit again with --debug to see
# which model runs out of the H100's memory.
#   run: carry [".whl"], command "bash docs/bench/gpu/run6.sh", timeout_s 240
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
deadline=$((SECONDS + 200))
source "$REPO/docs/bench/gpu/matrix.sh"
{
matrix A 2 kf_lowres:1 &
matrix B 2 kf_lowres:1:slow &
matrix C 2 kf_image_video:0.25 kf_lowres:0.25 &
matrix D 2 kf_image_video:0.25:slow kf_lowres:0.25:slow &
section flux2_edit 100 $knap --debug bench flux --family flux2 --mix flux2_edit --token-scale 0.25 --heads 48 \
  --head-dim 128 --layers 1 --single-layers 2 --dtype bfloat16 --repeats 3
while [ -n "$(jobs -r)" ]; do sleep 10; pack; done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
