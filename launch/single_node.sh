#!/usr/bin/env bash
# One node, all its GPUs: launch/single_node.sh train.py --deepspeed_config ds_config.json [args...]
# NUM_GPUS (default: every GPU) sets how many ranks start; on a machine without GPUs they are CPU ranks.
set -euo pipefail
exec deepspeed ${NUM_GPUS:+--num_gpus "$NUM_GPUS"} --master_port "${MASTER_PORT:-29500}" "$@"
