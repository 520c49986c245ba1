#!/usr/bin/env bash
# eagle3-dump from a served target: start the engine(s) for exactly this capture on this host,
# run CLIENTS client processes against them, stop the engine(s). Arguments are Hydra overrides of
# eagle3-dump, passed to the launch-command printer and to every client unchanged.
#
#   BACKEND=vllm   CLIENTS=4 launch/dump_served.sh target=<hf dir> data=runs/x/prepared out=runs/x/dump
#   BACKEND=sglang CLIENTS=4 launch/dump_served.sh target=<hf dir> data=... out=... \
#       server.url=http://127.0.0.1:30000 server.final_url=http://127.0.0.1:30001
#
# The engine must be installed on this host (vllm 0.33 / sglang 0.5.23 were read for its API); add
# its parallelism flags through ENGINE_ARGS (e.g. ENGINE_ARGS="--tensor-parallel-size 8"): they go
# into the printed engine commands as server.engine_args, which refuses what the dump cannot work
# with (SGLang's --pp-size > 1) before any engine starts. Give
# each engine its GPUs with ENGINE_DEVICES, one CUDA_VISIBLE_DEVICES list per engine separated by
# ';' — SGLang's two servers must not share GPUs (e.g. ENGINE_DEVICES="0,1,2,3;4,5,6,7"
# ENGINE_ARGS="--tp-size 4"). Engine logs go to $LOGDIR/engine<i>.log. To use engines already running elsewhere, skip this script:
# run `eagle3-dump backend=... server.url=...` on any hosts with client.rank / client.world_size.
# Stopped or killed, run the same command again: the clients resume after the stored samples.
# Several hosts, each with its own engine: CLIENT_RANK_OFFSET and CLIENT_WORLD_SIZE place this host's
# clients among all of them (launch/slurm/dump_served.sbatch sets both).
set -euo pipefail
BACKEND=${BACKEND:-vllm}
CLIENTS=${CLIENTS:-1}
LOGDIR=${LOGDIR:-.}
ENGINE_ARGS=${ENGINE_ARGS:-}
DUMP=${EAGLE3_DUMP:-eagle3-dump}

# The engine commands are the printed lines before "# then" (backslash continuations joined).
launch=$($DUMP backend="$BACKEND" print_launch=true "server.engine_args='$ENGINE_ARGS'" "$@")
echo "$launch"
mapfile -t engines < <(printf '%s\n' "$launch" | awk '/^# then/ {exit} /^#/ {next}
    {line = line $0; if (sub(/\\$/, "", line)) next; print line; line = ""}')

pids=()
cleanup() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT
IFS=';' read -r -a devices <<<"${ENGINE_DEVICES:-}"
for i in "${!engines[@]}"; do
    if [ -n "${devices[$i]:-}" ]; then
        CUDA_VISIBLE_DEVICES=${devices[$i]} bash -c "${engines[$i]}" >"$LOGDIR/engine$i.log" 2>&1 &
    else
        bash -c "${engines[$i]}" >"$LOGDIR/engine$i.log" 2>&1 &
    fi
    pids+=($!)
done

# The clients wait for the engines' /health themselves (client.wait_for_server_s).
OFFSET=${CLIENT_RANK_OFFSET:-0}
WORLD=${CLIENT_WORLD_SIZE:-$CLIENTS}
clients=()
for ((r = 0; r < CLIENTS; r++)); do
    $DUMP backend="$BACKEND" client.rank=$((OFFSET + r)) client.world_size="$WORLD" "$@" &
    clients+=($!)
done
status=0
for p in "${clients[@]}"; do wait "$p" || status=$?; done
exit $status
