#!/usr/bin/env bash
# eagle3-train under torchrun: one process per GPU, any number of nodes. Arguments are Hydra
# overrides, passed through unchanged.
#
#   1 GPU:        launch/train.sh data=runs/x/std target=<hf dir> out=runs/x/train
#   8 GPUs:       NPROC_PER_NODE=8 launch/train.sh data=... target=... out=... deepspeed=zero2
#   4 nodes x 8:  on every node, the same command:
#                 NNODES=4 NPROC_PER_NODE=8 MASTER_ADDR=<node 0 host> launch/train.sh data=... target=... out=...
#
# `data` and `out` must be on a filesystem every node sees. Killed or preempted, run the same
# command again: resume=auto continues from the last checkpoint at the same step and data position
# (keep NNODES x NPROC_PER_NODE x loop.grad_accum the same).
set -euo pipefail
exec "$(dirname "$0")/torchrun.sh" eagle3_train.training.trainer "$@"
