#!/usr/bin/env bash
# The fourth lent-GPU call (2026-11-26): which lengths cuDNN's attention backward fails on, and
# bench flux with SDPA's other kernels (run3.sh's bench flux failed inside cuDNN's backward).
#   run: carry [".whl"], command "bash docs/bench/gpu/run4.sh"
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=/tmp/results; mkdir -p "$R"; cd "$R" || exit 1  # outside $OUT: only 8 files come back
knap="python3 -m deepspeed_knap.cli"  # a word list: timeout runs commands, not functions
pack() { tar czf "$OUT/results.tmp" -C "$R" . && mv "$OUT/results.tmp" "$OUT/results.tgz"; }
section() {  # section NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$name.log" 2>&1; local rc=$?
  grep -v "WARNING\|kept in float32\|truncated because\|UserWarning\|return func" "$name.log" | tail -25
  echo "== $name: rc $rc, $((SECONDS - t0)) s"; pack
}
{
section cudnn_probe 50 python3 "$OLDPWD/docs/bench/gpu/cudnn_probe.py" 256,274,364,458,512,1000,1024,4097,4608
section flux_x1 45 $knap bench flux --mix kf_mixed_res --token-scale 1 --heads 24 --head-dim 128 \
  --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section flux_image_video 40 $knap bench flux --mix kf_image_video --token-scale 0.25 --heads 24 --head-dim 128 \
  --layers 2 --single-layers 4 --dtype bfloat16 --repeats 3
section flux2_edit 40 $knap bench flux --family flux2 --mix flux2_edit --token-scale 0.25 --heads 48 --head-dim 128 \
  --layers 1 --single-layers 2 --dtype bfloat16 --repeats 3
} 2>&1 | tee "$OUT/log"
