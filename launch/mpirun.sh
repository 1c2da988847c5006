#!/usr/bin/env bash
# Any MPI launcher: NP=32 HOSTS=node1:8,node2:8,node3:8,node4:8 launch/mpirun.sh train.py --deepspeed_config ds.json
# Ranks are discovered through mpi4py (deepspeed.init_distributed with auto_mpi_discovery). `python -m mpi4py`
# makes an uncaught exception on one rank abort every rank instead of leaving the others waiting.
set -euo pipefail
exec mpirun -n "${NP:?set NP to the number of ranks}" ${HOSTS:+-hosts "$HOSTS"} \
    -env MASTER_PORT "${MASTER_PORT:-29500}" python -m mpi4py "$@"
