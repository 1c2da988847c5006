#!/usr/bin/env bash
# The third lent-GPU call (2026-11-26), after run2.sh found the plan worker dead in every
# non-editable install (fixed) and bench flux failing in cuBLAS: the GPU tests again, bench flux
# with blocking launches and its traceback, the one-rank overheads with a live worker, Wan on NCCL.
#   run: carry [".whl"], command "bash docs/bench/gpu/run3.sh"
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# tests/support/launch.py runs the deepspeed launcher beside sys.executable
ln -sf /tmp/site/bin/deepspeed "$(dirname "$(python3 -c 'import sys; print(sys.executable)')")/deepspeed"
R=/tmp/results; mkdir -p "$R"; cd "$R" || exit 1  # outside $OUT: only 8 files come back
knap="python3 -m deepspeed_knap.cli"  # a word list: timeout runs commands, not functions
pack() { tar czf "$OUT/results.tmp" -C "$R" . && mv "$OUT/results.tmp" "$OUT/results.tgz"; }
section() {  # section NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$name.log" 2>&1; local rc=$?
  grep -v "WARNING\|kept in float32\|truncated because\|UserWarning\|return func" "$name.log" | tail -40
  echo "== $name: rc $rc, $((SECONDS - t0)) s"; pack
}
{
section gpu_tests 150 bash -c "cd $OLDPWD && python3 -m pytest -m gpu -q -rA -p no:cacheprovider"
section flux_debug 60 env CUDA_LAUNCH_BLOCKING=1 $knap --debug bench flux --mix kf_mixed_res --token-scale 1 --heads 24 \
  --head-dim 128 --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section flux_quarter 40 $knap bench flux --mix kf_mixed_res --token-scale 0.25 --heads 24 --head-dim 128 \
  --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section train_1rank 60 $knap bench train --ranks 1 --flux-dims --mix kf_mixed_res --token-scale 1 --steps 9 \
  --modes off,auto --json train_1rank.json --plot train_1rank.png
section train_wan_1rank 60 $knap bench train --ranks 1 --family wan --mix wan_image_video --token-scale 0.05 --steps 5 \
  --modes off,auto --json train_wan_1rank.json
section generate_1rank 40 $knap bench generate --ranks 1 --heads 24 --head-dim 128 --dtype bfloat16 \
  --modes balanced,no-reuse,unbalanced --json generate_1rank.json
section generate_wan_1rank 60 $knap bench generate --ranks 1 --family wan --dtype bfloat16 \
  --modes balanced,unbalanced,pipeline --json generate_wan_1rank.json
} 2>&1 | tee "$OUT/log"
