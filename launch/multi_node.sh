#!/usr/bin/env bash
# Several nodes listed in a DeepSpeed hostfile ("host slots=8" per line), started over passwordless ssh
# from the first node: HOSTFILE=hostfile launch/multi_node.sh train.py --deepspeed_config ds_config.json
set -euo pipefail
HOSTFILE=${HOSTFILE:-hostfile}
MASTER_ADDR=${MASTER_ADDR:-$(head -n1 "$HOSTFILE" | awk '{print $1}')}
exec deepspeed --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" "$@"
