#!/usr/bin/env bash
# The seventeenth lent-GPU call (2026-11-28, an H200, after run16.sh): the start-up calibration's cost
# again with the timed copy built on the device (run16 built it on the host: FLUX.2's took 46 s) and
# Qwen-Image's synthetic grids kept float32 (run16's bfloat16 grids rounded 733 to 732 and failed).
#   run: carry [".whl"], command "bash docs/bench/gpu/run17.sh", timeout_s 300
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
section startup_default 200 python3 "$REPO/docs/bench/gpu/startup_calibration.py" --json startup_default.json
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
