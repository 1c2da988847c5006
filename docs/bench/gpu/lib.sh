# Sourced by run2.sh to run6.sh (the lent-GPU calls): install the carried wheels, then `section NAME
# SECONDS COMMAND...` runs one step under its own time limit, prints the end of its log, and packs
# every result so far into $OUT/results.tgz, so a call cut off at its limit still returns what ran.
# $knap is the CLI as a word list (timeout runs commands, not shell functions).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
REPO=$PWD
R=/tmp/results; mkdir -p "$R"; cd "$R" || exit 1  # outside $OUT: only 8 files come back from it
knap="python3 -m deepspeed_knap.cli"
pack() { tar czf "$OUT/results.tmp" -C "$R" . && mv "$OUT/results.tmp" "$OUT/results.tgz"; }
section() {
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$name.log" 2>&1; local rc=$?
  grep -v "WARNING\|kept in float32\|truncated because\|UserWarning\|return func" "$name.log" | tail -40
  echo "== $name: rc $rc, $((SECONDS - t0)) s"; pack
}
