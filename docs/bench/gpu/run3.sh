#!/usr/bin/env bash
# The third lent-GPU call (2026-11-26), after run2.sh found the plan worker dead in every
# non-editable install (fixed) and bench flux failing in cuBLAS: the GPU tests again, bench flux
# with blocking launches and its traceback, the one-rank overheads with a live worker, Wan on NCCL.
#   run: carry [".whl"], command "bash docs/bench/gpu/run3.sh"
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
# tests/support/launch.py runs the deepspeed launcher beside sys.executable
ln -sf /tmp/site/bin/deepspeed "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/deepspeed"
{
section gpu_tests 150 bash -c "cd $REPO && python3 -m pytest -m gpu -q -rA -p no:cacheprovider"
section flux_debug 60 env CUDA_LAUNCH_BLOCKING=1 $knap --debug bench flux --mix kf_mixed_res --token-scale 1 --heads 24 \
  --head-dim 128 --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section flux_quarter 40 $knap bench flux --mix kf_mixed_res --token-scale 0.25 --heads 24 --head-dim 128 \
  --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section train_1rank 60 $knap bench train --ranks 1 --flux-dims --mix kf_mixed_res --token-scale 1 --steps 9 \
  --modes off,auto --json train_1rank.json --plot train_1rank.png
section train_wan_1rank 60 $knap bench train --ranks 1 --family wan --mix wan_image_video --token-scale 0.05 --steps 5 \
  --modes off,auto --json train_wan_1rank.json
section generate_1rank 40 $knap bench generate --ranks 1 --heads 24 --head-dim 128 --dtype bfloat16 \
  --modes balanced,no-reuse,unbalanced --json generate_1rank.json
section generate_wan_1rank 60 $knap bench generate --ranks 1 --family wan --dtype bfloat16 \
  --modes balanced,unbalanced,pipeline --json generate_wan_1rank.json
} 2>&1 | tee "$OUT/log"
