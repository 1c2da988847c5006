#!/usr/bin/env bash
# The ninth lent-GPU call (2026-11-26, tenth session), two jobs side by side:
# - the host's 16 cores: issue 26's configurations without a slow rank (where `auto` trailed
#   knapformer@g1n2), now that no step waits for a plan worker's start, in two lanes of 2 CPU ranks
#   (the GPU hidden; run7's four lanes moved `off` itself by up to 20%), again until the deadline;
# - the GPU (4 host threads): `bench train --ranks 1 --flux-dims`, whose step 1 waited 0.42 s for the
#   plan worker in the seventh session, and `bench flux` at FLUX.1 [dev]'s full width and depth
#   (19 + 38 blocks, 12B parameters, their gradients too) on kf_mixed_res x1/32 (~2.1k tokens).
#   run: carry [".whl"], command "bash docs/bench/gpu/run9.sh", timeout_s 420
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
deadline=$((SECONDS + 360))
source "$REPO/docs/bench/gpu/matrix.sh"
lane() { local name=$1; shift; for round in 1 2 3 4 5; do matrix "$name" "$round" "$@"; done; }
{
lane A kf_mixed_res:0.25 kf_image_video:0.25 kf_lowres:0.25 &
lane B kf_mixed_res:1 kf_image_video:1 kf_lowres:1 &
export OMP_NUM_THREADS=4
section train_1rank 70 $knap bench train --ranks 1 --flux-dims --mix kf_mixed_res --token-scale 1 --steps 9 \
  --modes off,auto --json train_1rank.json
section flux_full 260 $knap bench flux --flux-dims --mix kf_mixed_res --token-scale 0.03125 --dtype bfloat16 --repeats 2
while [ -n "$(jobs -r)" ]; do sleep 10; pack; done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
