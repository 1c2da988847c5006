#!/usr/bin/env bash
# The fourteenth lent-GPU call (2026-11-28, an H200): the price of a decode (VAE decode seconds of
# Wan 2.1, Wan 2.2, FLUX and Qwen-Image at their real widths, docs/bench/gpu/vae_decode.py), and what
# a calibration at start-up would cost (issue 46): `calibrate` at two lengths, FLUX.1 and Wan 14B dims.
#   run: carry [".whl"], command "bash docs/bench/gpu/run14.sh", timeout_s 420
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
section vae_decode 200 python3 "$REPO/docs/bench/gpu/vae_decode.py" --json vae_decode.json
section cal_flux_startup 60 $knap calibrate --flux-dims --dtype bfloat16 --seq-lens 1024,4096 --out cal_flux_startup.json
section cal_wan14b_startup 60 $knap calibrate --wan wan2.1-14b --dtype bfloat16 --seq-lens 1024,4096 --out cal_wan14b_startup.json
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
