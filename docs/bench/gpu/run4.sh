#!/usr/bin/env bash
# The fourth lent-GPU call (2026-11-26): which lengths cuDNN's attention backward fails on, and
# bench flux with SDPA's other kernels (run3.sh's bench flux failed inside cuDNN's backward).
#   run: carry [".whl"], command "bash docs/bench/gpu/run4.sh"
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
section cudnn_probe 50 python3 "$REPO/docs/bench/gpu/cudnn_probe.py" 256,274,364,458,512,1000,1024,4097,4608
section flux_x1 45 $knap bench flux --mix kf_mixed_res --token-scale 1 --heads 24 --head-dim 128 \
  --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section flux_image_video 40 $knap bench flux --mix kf_image_video --token-scale 0.25 --heads 24 --head-dim 128 \
  --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section flux2_edit 40 $knap bench flux --family flux2 --mix flux2_edit --token-scale 0.25 --heads 48 --head-dim 128 \
  --layers 1 --single-layers 2 --dtype bfloat16 --repeats 3
} 2>&1 | tee "$OUT/log"
