#!/usr/bin/env bash
# The second lent-GPU run (2026-11-26), one call of the device tool, prioritised: each section has its
# own time limit and the results are packed after each, so a cut-off call still returns what ran.
#   run: carry [".whl"], command "bash docs/bench/gpu/run2.sh"
# Writes $OUT/log (everything printed) and $OUT/results.tgz (JSON, PNG, per-section logs).
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
section gpu_tests 130 bash -c "cd $REPO && python3 -m pytest -m gpu -q -rs -p no:cacheprovider"
section cal_wan14b 70 $knap calibrate --wan wan2.1-14b --dtype bfloat16 --seq-lens 1024,4096,16384,32768,65536 \
  --repeats 3 --alltoall-gbps 150 --out cal_wan14b.json --plot cal_wan14b.png
section train_1rank 80 $knap bench train --ranks 1 --flux-dims --mix kf_mixed_res --token-scale 1 --steps 9 \
  --modes off,auto --json train_1rank.json --plot train_1rank.png
section cal_flux_degrees 70 $knap calibrate --flux-dims --dtype bfloat16 --backend sdpa \
  --seq-lens 1024,2048,4096,8192,16384,32768 --repeats 3 --degrees 2,4,8 --alltoall-gbps 150 --out cal_flux_sdpa.json
section step_auto 60 $knap bench step --topology auto --gpus 8 --flux-dims --dtype bfloat16 --backend sdpa --token-scale 1 \
  --mix kf_image_video --steps 2 --calibration cal_flux_sdpa.json --json step_auto.json --plot step_auto.png
section step_g8n1 45 $knap bench step --topology g8n1 --flux-dims --dtype bfloat16 --backend sdpa --token-scale 1 \
  --mix kf_image_video --steps 2 --calibration cal_flux_sdpa.json --json step_g8n1.json
section flux_vs_diffusers 40 $knap bench flux --mix kf_mixed_res --token-scale 1 --heads 24 --head-dim 128 \
  --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section generate_1rank 40 $knap bench generate --ranks 1 --heads 24 --head-dim 128 --dtype bfloat16 \
  --modes balanced,no-reuse,unbalanced --json generate_1rank.json
section cal_wan1b 30 $knap calibrate --wan wan2.1-1.3b --dtype bfloat16 --seq-lens 1024,4096,16384,32768,65536 \
  --repeats 3 --alltoall-gbps 150 --out cal_wan1b.json
} 2>&1 | tee "$OUT/log"
