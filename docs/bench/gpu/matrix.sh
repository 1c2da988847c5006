# Sourced by run5.sh and run6.sh: `matrix LANE ROUND MIX:SCALE[:slow]...` runs issue 26's must-show
# configurations one after another on 2 CPU ranks (the GPU hidden), each once, until $deadline.
matrix() {
  local lane=$1 round=$2; shift 2
  for cfg in "$@"; do
    IFS=: read -r mix scale slow <<< "$cfg"
    local left=$((deadline - SECONDS)); [ "$left" -gt 20 ] || return
    local name="m_${mix}_${scale}${slow:+_slow}_r$round"
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout "$left" $knap bench train --ranks 2 --mix "$mix" \
      --token-scale "$scale" --steps 17 --modes off,knapformer@g1n2,knapformer@g2n1,auto --online \
      ${slow:+--slow-rank 1:2} --json "$name.json" > "$name.log" 2>&1
    echo "lane $lane: $name rc $? at $SECONDS s"
  done
}
