#!/usr/bin/env bash
# eagle3-train through the DeepSpeed launcher and a hostfile (ssh to every host listed):
#
#   launch/train_deepspeed.sh launch/hostfile.example data=/shared/x/std target=/models/llama out=/shared/x/train
#
# The hostfile lists one host per line with its GPU count: `node-01 slots=8`. --no_local_rank keeps
# the launcher from adding a --local_rank argument, which Hydra would reject; ranks come from the
# environment the launcher sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR).
set -euo pipefail
hostfile=$1
shift
exec deepspeed --hostfile "$hostfile" --no_local_rank --master_port "${MASTER_PORT:-29500}" \
  --module eagle3_train.training.trainer "$@"
