#!/usr/bin/env bash
# The fifteenth lent-GPU call (2026-11-28, an H200, after run14.sh, whose calibrations gave two
# lengths where calibrate needs four): what a calibration at start-up would cost (issue 46), the
# whole `calibrate` command's seconds at four lengths up to 8,192 tokens, FLUX.1 and Wan 14B dims,
# and with the per-degree emulation (--degrees 2,4,8) at FLUX.1's.
#   run: carry [".whl"], command "bash docs/bench/gpu/run15.sh", timeout_s 300
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
section cal_flux_startup 90 $knap calibrate --flux-dims --dtype bfloat16 --seq-lens 1024,2048,4096,8192 --out cal_flux_startup.json
section cal_wan14b_startup 90 $knap calibrate --wan wan2.1-14b --dtype bfloat16 --seq-lens 1024,2048,4096,8192 --out cal_wan14b_startup.json
section cal_flux_degrees 90 $knap calibrate --flux-dims --dtype bfloat16 --seq-lens 1024,2048,4096,8192 --degrees 2,4,8 --out cal_flux_degrees.json
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
