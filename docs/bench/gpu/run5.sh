#!/usr/bin/env bash
# The fifth lent-GPU call (2026-11-26, seventh session). Two jobs side by side:
# - the GPU: bench flux's packed model on each attention kernel (is the ~15 GB peak above diffusers'
#   per-sample loop torch_varlen's backward?), the kf_mixed_res x1/4 command that failed in cuDNN,
#   and FLUX.2 flux2_edit, which did not finish in 40 s last time;
# - the host's 16 cores: issue 26's must-show matrix (bench train --ranks 2 on CPU ranks, the GPU
#   hidden), four lanes of 2 ranks at a time, so that ranks do not take turns on cores as on the
#   2-core CI machine (whether the 16 are 8 cores of two threads each was not checked). Each lane runs
#   its three configurations, then again until the deadline.
#   run: carry [".whl"], command "bash docs/bench/gpu/run5.sh", timeout_s 560
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
deadline=$((SECONDS + 500))
source "$REPO/docs/bench/gpu/matrix.sh"
lane() { local name=$1; shift; for round in 1 2 3; do matrix "$name" "$round" "$@"; done; }
{
nproc; lscpu | grep -i "model name"
lane A kf_image_video:1:slow kf_lowres:0.25 kf_lowres:0.25:slow &
lane B kf_mixed_res:1:slow kf_mixed_res:0.25 kf_mixed_res:0.25:slow &
lane C kf_lowres:1:slow kf_image_video:0.25 kf_image_video:0.25:slow &
lane D kf_image_video:1 kf_mixed_res:1 kf_lowres:1 &
flux="--heads 24 --head-dim 128 --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3"
section flux_iv_sdpa 60 $knap bench flux --mix kf_image_video --token-scale 0.25 $flux --backend sdpa
section flux_iv_varlen 60 $knap bench flux --mix kf_image_video --token-scale 0.25 $flux --backend torch_varlen
section flux_mixed_quarter 60 $knap bench flux --mix kf_mixed_res --token-scale 0.25 $flux
section flux2_edit 120 $knap bench flux --family flux2 --mix flux2_edit --token-scale 0.25 --heads 48 \
  --head-dim 128 --layers 1 --single-layers 2 --dtype bfloat16 --repeats 3
while [ -n "$(jobs -r)" ]; do sleep 20; pack; done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
