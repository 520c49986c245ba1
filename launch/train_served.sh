#!/usr/bin/env bash
# eagle3-train source=served across hosts: engine hosts serve the target (vLLM, SGLang) and return
# its states; trainer hosts train the draft on them. Arguments are eagle3-train's Hydra overrides,
# the same on both sides (source=served is added).
#
#   ROLE=engine  launch/train_served.sh target=<hf dir> data=<prepared> out=<run> engine.files_dir=/shared/run/files \
#                engine.engine_args='--tensor-parallel-size 8' engine.memory_fraction=null
#   ROLE=trainer ENGINE_HOSTS="gpu1 gpu2" launch/train_served.sh <the same overrides>
#
# ROLE=engine runs `eagle3-train source=served engine.serve=true`: it starts this host's replica(s)
# (the command(s) engine.print_launch=true shows: the capture's flags, engine.port,
# engine.engine_args), logs them under <out>/engine/<host>/ and waits on them; one that exits stops
# the rest, and SIGTERM stops them all. ROLE=trainer runs launch/train.sh (torchrun: NNODES,
# NPROC_PER_NODE, MASTER_ADDR as there) with engine.urls=[http://<host>:<engine.port>,...] for
# ENGINE_HOSTS and waits up to ENGINE_WAIT_S (1800) for them to load. engine.files_dir must be a
# directory every host sees at the same path (vLLM writes the states there; each file is deleted
# once read). Killed or preempted: submit the same command again (resume=auto); the engines need
# no state of their own.
set -euo pipefail
ROLE=${ROLE:?ROLE=engine or ROLE=trainer}
TRAIN=${EAGLE3_TRAIN:-eagle3-train}
here=$(dirname "$0")
case $ROLE in
engine)
    exec $TRAIN source=served engine.serve=true "$@"  # (TRAIN unquoted: it may be several words)
    ;;
trainer)
    port=8000
    for a in "$@"; do case $a in engine.port=*) port=${a#engine.port=} ;; esac; done
    urls=""
    for h in ${ENGINE_HOSTS:?ENGINE_HOSTS: the engine hosts, space-separated}; do
        urls+="${urls:+,}http://$h:$port"
    done
    exec "$here/train.sh" source=served "engine.urls=[$urls]" "engine.wait_for_server_s=${ENGINE_WAIT_S:-1800}" "$@"
    ;;
*)
    echo "ROLE must be engine or trainer, got $ROLE" >&2
    exit 2
    ;;
esac
