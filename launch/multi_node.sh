#!/usr/bin/env bash
# Several nodes listed in a DeepSpeed hostfile ("host slots=8" per line), started over passwordless ssh
# from the first node: HOSTFILE=hostfile launch/multi_node.sh train.py --deepspeed_config ds_config.json
# DeepSpeed's runner takes the first active host of the hostfile as the master (its comments, and
# hosts --include/--exclude leave out, skipped) at the first address `hostname -I` gives there; set
# MASTER_ADDR where that is not the one the nodes reach each other by (a docker bridge, a second NIC).
# The ranks get only the environment DeepSpeed's runner forwards (NCCL_*, PYTHON*, UCX_*, MV2_*,
# MLFLOW_*): put others they need (DEEPSPEED_TIMEOUT, DEEPSPEED_KNAP_*, HF_*, TRANSFORMERS_*) in
# ./.deepspeed_env or ~/.deepspeed_env, one NAME=value per line (no blank or comment lines: DeepSpeed
# splits every line at its first "=").
set -euo pipefail
HOSTFILE=${HOSTFILE:-hostfile}
exec deepspeed --hostfile "$HOSTFILE" ${MASTER_ADDR:+--master_addr "$MASTER_ADDR"} --master_port "${MASTER_PORT:-29500}" "$@"
