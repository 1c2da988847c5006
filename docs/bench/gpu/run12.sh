#!/usr/bin/env bash
# The twelfth lent-GPU call (2026-11-28, an H200): the GPU tests, Wan 2.2 A14B's two experts at their
# real width (PackedWanExperts against diffusers per sample; T2V and I2V input widths, 2 blocks each),
# and the cost model calibrated for Wan 2.2 TI2V-5B's dims.
#   run: carry [".whl"], command "bash docs/bench/gpu/run12.sh", timeout_s 420
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L; git -C "$REPO" log --oneline -1 2>/dev/null
section gpu_tests 120 bash -c "cd $REPO && python3 -m pytest -m gpu -q -p no:cacheprovider tests"
section wan22_t2v 90 python3 "$REPO/docs/bench/gpu/wan22_experts.py" --blocks 2 --json wan22_t2v.json
section wan22_i2v 80 python3 "$REPO/docs/bench/gpu/wan22_experts.py" --blocks 2 --i2v --json wan22_i2v.json
section cal_wan5b 70 $knap calibrate --wan wan2.2-ti2v-5b --dtype bfloat16 --seq-lens 1024,4096,16384,32768,65536 \
  --repeats 3 --alltoall-gbps 150 --out cal_wan5b.json --plot cal_wan5b.png
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
