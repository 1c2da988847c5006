#!/usr/bin/env bash
# The nineteenth lent-GPU call (2026-11-28, an H200): run18 again with the start-up timer of d715882
# (the copy's whole time plus overhead_s, where run18's timed the blocks alone), the online refit's
# model error per step at FLUX.1's width, the timing's cost at the families' full configs (run17's
# script, current timer), doctor's start-up section for Wan 14B, and the GPU tests (issue 46).
#   run: carry [".whl"], command "bash docs/bench/gpu/run19.sh", timeout_s 420
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
train="$knap bench train --ranks 1 --flux-dims --token-scale 0.5 --modes off"
section train_startup 90 $train --steps 6 --startup-calibration --json train_startup.json
section train_prior 80 $train --steps 6 --json train_prior.json
section train_online 100 $train --steps 10 --online --startup-calibration --json train_online.json
section startup_default 120 python3 "$REPO/docs/bench/gpu/startup_calibration.py" --json startup_default.json
section gpu_tests 120 bash -c "cd $REPO && python3 -m pytest -m gpu -q -p no:cacheprovider"
section doctor_wan 100 $knap doctor --out doctor_wan --family wan
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
