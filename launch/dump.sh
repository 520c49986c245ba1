#!/usr/bin/env bash
# eagle3-dump under torchrun: one process per GPU, any number of nodes. Arguments are Hydra
# overrides, passed through unchanged.
#
#   1 GPU:          launch/dump.sh target=meta-llama/Llama-3.1-8B-Instruct data=runs/x/prepared out=runs/x/dump
#   8 GPUs:         NPROC_PER_NODE=8 launch/dump.sh target=... data=... out=...
#   4 nodes x 8:    on every node, the same command:
#                   NNODES=4 NPROC_PER_NODE=8 MASTER_ADDR=<node 0 host> launch/dump.sh target=... data=... out=...
#   70B, 2-way TP:  NPROC_PER_NODE=8 launch/dump.sh ... tp_size=2   (4 data-parallel groups of 2 GPUs)
#
# `out` (and `data`) must be on a filesystem every node sees. Killed or preempted, run the same
# command again: finished shards are kept and only the missing samples are computed.
set -euo pipefail
exec "$(dirname "$0")/torchrun.sh" data_prep.dump "$@"
