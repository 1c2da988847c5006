#!/usr/bin/env bash
# Prepared for a later lent GPU, not yet run (the loans were paused when it was ready, 2026-11-28):
# the start-up calibration's timing cost at the families' full configs with time_lengths' leading run
# at the longest length dropped (each length keeps its own warm-up run), against f4ff88d's package,
# carried as gpu_old/ for the call only (mkdir gpu_old && git archive f4ff88d deepspeed_knap | tar x
# -C gpu_old; remove it after); interleaved. On 2 CPU cores (--tiny) the change took a third off.
#   run: carry [".whl"], command "bash docs/bench/gpu/run22.sh", timeout_s 200
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
{
nvidia-smi -L
for run in 1 2; do
  section startup_new_$run 60 python3 "$REPO/docs/bench/gpu/startup_calibration.py" --json startup_new_$run.json
  section startup_old_$run 60 env PYTHONPATH=/tmp/site:$REPO/gpu_old python3 "$REPO/docs/bench/gpu/startup_calibration.py" --json startup_old_$run.json
done
pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
