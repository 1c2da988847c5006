#!/usr/bin/env bash
# The seventh lent-GPU call (2026-11-26, ninth session). Two jobs side by side:
# - the host's 16 cores: issue 26's must-show matrix at the eighth session's code (shared solves,
#   the kept a/b ratio, the frozen set-up), four lanes of 2 CPU ranks (the GPU hidden), the
#   configurations without a slow rank first in each lane, then again until the deadline. Does
#   `auto` still trail knapformer@g1n2 where each rank and plan worker has a core of its own?
# - the GPU: bench flux kf_image_video x1/4 again, now printing what is allocated before each model's
#   first run (`before MiB`), and FLUX.2 flux2_edit at half the tokens that ran out of memory.
#   run: carry [".whl"], command "bash docs/bench/gpu/run7.sh", timeout_s 540
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
deadline=$((SECONDS + 470))
source "$REPO/docs/bench/gpu/matrix.sh"
lane() { local name=$1; shift; for round in 1 2 3; do matrix "$name" "$round" "$@"; done; }
{
nproc; lscpu | grep -i "model name\|thread(s) per core\|core(s) per socket\|socket(s)"
lane A kf_mixed_res:0.25 kf_lowres:0.25 kf_image_video:1:slow &
lane B kf_image_video:0.25 kf_lowres:1 kf_mixed_res:1:slow &
lane C kf_mixed_res:1 kf_image_video:1 kf_lowres:0.25:slow &
lane D kf_lowres:1:slow kf_mixed_res:0.25:slow kf_image_video:0.25:slow &
flux="--heads 24 --head-dim 128 --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3"
section flux_iv 90 $knap bench flux --mix kf_image_video --token-scale 0.25 $flux
section flux2_edit_eighth 150 $knap --debug bench flux --family flux2 --mix flux2_edit --token-scale 0.125 \
  --heads 48 --head-dim 128 --layers 1 --single-layers 2 --dtype bfloat16 --repeats 3
while [ -n "$(jobs -r)" ]; do sleep 15; pack; done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
