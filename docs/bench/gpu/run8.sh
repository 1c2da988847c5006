#!/usr/bin/env bash
# The eighth lent-GPU call (2026-11-26, ninth session, after run7.sh):
# - the GPU: bench flux once its count of saved activations no longer leaks them (run7's packed
#   'before MiB' held 14.4 GiB of diffusers' activations), and FLUX.2 flux2_edit at x1/4, which ran
#   out of memory in run6 (diffusers' leaked activations were still allocated then);
# - the host's 16 cores: issue 26's auto against knapformer@g1n2 at x1/4 with three lanes of 2 CPU
#   ranks (run7 had four, whose scatter hid a few percent), each mix over and over until the deadline.
#   run: carry [".whl"], command "bash docs/bench/gpu/run8.sh", timeout_s 300
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
deadline=$((SECONDS + 255))
pair() {
  local mix=$1 round=1
  while [ $((deadline - SECONDS)) -gt 45 ]; do
    local name="p_${mix}_r$round"
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout $((deadline - SECONDS)) $knap bench train --ranks 2 --mix "$mix" \
      --token-scale 0.25 --steps 17 --modes off,knapformer@g1n2,auto --online --json "$name.json" > "$name.log" 2>&1
    echo "$name rc $? at $SECONDS s"; round=$((round + 1))
  done
}
{
pair kf_mixed_res & pair kf_image_video & pair kf_lowres &
flux="--heads 24 --head-dim 128 --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3"
section flux_iv 70 $knap bench flux --mix kf_image_video --token-scale 0.25 $flux
section flux2_edit_quarter 150 $knap --debug bench flux --family flux2 --mix flux2_edit --token-scale 0.25 \
  --heads 48 --head-dim 128 --layers 1 --single-layers 2 --dtype bfloat16 --repeats 3
while [ -n "$(jobs -r)" ]; do sleep 10; pack; done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
