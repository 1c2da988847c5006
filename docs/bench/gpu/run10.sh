#!/usr/bin/env bash
# The tenth lent-GPU call (2026-11-26, tenth session, after run9.sh), two jobs side by side:
# - the GPU (4 host threads): bench flux at FLUX.1 [dev]'s full width and depth (19 + 38 blocks, 12B
#   parameters, their gradients too), which ran out of memory in run9 with two copies of the weights
#   on the device; now one model at a time, built on the device;
# - the host's 16 cores: issue 26's must-show matrix at 7d34991 (auto's search floor), two lanes of
#   2 CPU ranks (the GPU hidden): x1/4 with and without a slow rank, x1 without, until the deadline.
#   run: carry [".whl"], command "bash docs/bench/gpu/run10.sh", timeout_s 450
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
deadline=$((SECONDS + 390))
source "$REPO/docs/bench/gpu/matrix.sh"
{
( matrix A 1 kf_mixed_res:0.25 kf_image_video:0.25 kf_lowres:0.25 kf_mixed_res:0.25:slow kf_image_video:0.25:slow \
    kf_lowres:0.25:slow; matrix A 2 kf_mixed_res:0.25 kf_image_video:0.25 kf_lowres:0.25 kf_mixed_res:0.25 ) &
( matrix B 1 kf_mixed_res:1 kf_image_video:1 kf_lowres:1 kf_image_video:1:slow ) &
export OMP_NUM_THREADS=4
section flux_full 200 $knap bench flux --flux-dims --mix kf_mixed_res --token-scale 0.03125 --dtype bfloat16 --repeats 2
section flux_full_iv 130 $knap bench flux --flux-dims --mix kf_image_video --token-scale 0.03125 --dtype bfloat16 --repeats 2
while [ -n "$(jobs -r)" ]; do sleep 10; pack; done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
