#!/usr/bin/env bash
# torchrun for any eagle3_train stage module: one process per GPU, any number of nodes.
#
#   launch/torchrun.sh <module> <hydra overrides...>
#
# NNODES (1), NPROC_PER_NODE (1), MASTER_ADDR (localhost), MASTER_PORT (29500) and RDZV_ID come
# from the environment; on several nodes, run the same command on every node.
set -euo pipefail
module=$1
shift
exec torchrun \
  --nnodes "${NNODES:-1}" \
  --nproc_per_node "${NPROC_PER_NODE:-1}" \
  --rdzv_backend c10d \
  --rdzv_endpoint "${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}" \
  --rdzv_id "${RDZV_ID:-$module}" \
  -m "$module" "$@"
