#!/usr/bin/env bash
# The sixteenth lent-GPU call (2026-11-28, an H200): what cost_model.startup_calibration costs at the
# real widths (FLUX.1 [dev], FLUX.2 [dev], Wan 14B, Qwen-Image; bf16; docs/bench/gpu/startup_calibration.py)
# at its default lengths and at longer ones, and the GPU tests (the timer's and the engine's included).
#   run: carry [".whl"], command "bash docs/bench/gpu/run16.sh", timeout_s 420
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
section startup_default 150 python3 "$REPO/docs/bench/gpu/startup_calibration.py" --json startup_default.json
section startup_long 150 python3 "$REPO/docs/bench/gpu/startup_calibration.py" --seq-lens 4096,8192,16384,32768 --json startup_long.json
section gpu_tests 100 bash -c "cd $REPO && python3 -m pytest -m gpu -q -p no:cacheprovider -x"
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
