#!/usr/bin/env bash
# The eleventh lent-GPU call (2026-11-26, thirteenth session): the host's 16 cores only, nothing on the
# GPU beside them (run10's GPU job made the host noisy). Issue 26's must-show matrix at 11ea790 (plans
# that move nothing skip the routes; the lengths in one all-gather), four lanes of 2 CPU ranks (the
# GPU hidden), each lane two configurations without a slow rank and one with, over and over until the
# deadline (the x1 rows without a slow rank got one or two runs; the x1/4 ones more in the next calls).
#   run: carry [".whl"], command "bash docs/bench/gpu/run11.sh", timeout_s 560
# Then, on the same warm machine, the three x1/4 rows without a slow rank in four lanes at once, twice:
#   source docs/bench/gpu/lib.sh; deadline=$((SECONDS + 290)); source $REPO/docs/bench/gpu/matrix.sh
#   for l in A B C D; do ( matrix $l 3 kf_lowres:0.25 kf_mixed_res:0.25 kf_image_video:0.25 ) & done; wait
# (the four lanes wrote the same names, so one run of each row survives as r3), and with the lanes
# named apart (deadline 150 s):
#   for l in 4 5 6 7; do ( matrix L$l $l kf_mixed_res:0.25 kf_image_video:0.25 kf_lowres:0.25 ) & done
# Summaries: cpu16_run11.txt; the table: docs/notes/benchmarks-2026.md (issue 26, thirteenth session).
source "$(dirname "$0")/lib.sh"  # the wheels, $knap, section
deadline=$((SECONDS + 480))
source "$REPO/docs/bench/gpu/matrix.sh"
lane() { local name=$1; shift; for round in 1 2 3 4; do matrix "$name" "$round" "$@"; done; }
{
nproc; lscpu | grep -i "model name\|thread(s) per core\|core(s) per socket\|socket(s)"; uptime
git -C "$REPO" log --oneline -1 2>/dev/null
lane A kf_mixed_res:0.25 kf_lowres:0.25 kf_image_video:1:slow &
lane B kf_image_video:0.25 kf_lowres:1 kf_mixed_res:1:slow &
lane C kf_mixed_res:1 kf_image_video:1 kf_lowres:0.25:slow &
lane D kf_lowres:1:slow kf_mixed_res:0.25:slow kf_image_video:0.25:slow &
while [ -n "$(jobs -r)" ]; do sleep 15; pack; done
uptime; pack; echo "done at $SECONDS s"
} 2>&1 | tee "$OUT/log"
