#!/usr/bin/env bash
# eagle3-dump from a served target: start the engine(s) for exactly this capture on this host
# (`eagle3-dump serve=true`), run CLIENTS client processes against them, stop the engine(s).
# Arguments are Hydra overrides of eagle3-dump, passed to the engine's process and to every client
# unchanged.
#
#   BACKEND=vllm   CLIENTS=4 launch/dump_served.sh target=<hf dir> data=runs/x/prepared out=runs/x/dump
#   BACKEND=sglang CLIENTS=4 launch/dump_served.sh target=<hf dir> data=... out=... \
#       server.url=http://127.0.0.1:30000 server.final_url=http://127.0.0.1:30001
#
# The engine must be installed on this host (vllm 0.33 / sglang 0.5.23 were read for its API); add
# its parallelism flags through ENGINE_ARGS (e.g. ENGINE_ARGS="--tensor-parallel-size 8"): they go
# into the engine commands as server.engine_args, which refuses what the dump cannot work with
# (SGLang's --pp-size > 1) before any engine starts. Give each engine its GPUs with ENGINE_DEVICES,
# one CUDA_VISIBLE_DEVICES list per engine separated by ';' (serve_devices) — SGLang's two servers
# must not share GPUs (e.g. ENGINE_DEVICES="0,1,2,3;4,5,6,7" ENGINE_ARGS="--tp-size 4"). Engine logs
# go to <out>/engine/<host>/engine<i>.log. An engine that stops early stops the clients too. To use
# engines already running elsewhere, skip this script: run `eagle3-dump backend=... server.url=...`
# on any hosts with client.rank / client.world_size.
# Stopped or killed, run the same command again: the clients resume after the stored samples. When it
# stops, a client still running STOP_GRACE_S (60) seconds after its SIGTERM is killed.
# Several hosts, each with its own engine: CLIENT_RANK_OFFSET and CLIENT_WORLD_SIZE place this host's
# clients among all of them (launch/slurm/dump_served.sbatch sets both).
set -euo pipefail
BACKEND=${BACKEND:-vllm}
CLIENTS=${CLIENTS:-1}
ENGINE_ARGS=${ENGINE_ARGS:-}
DUMP=${EAGLE3_DUMP:-eagle3-dump}

devices=()
IFS=';' read -r -a devices <<<"${ENGINE_DEVICES:-}"
serve_devices=()
if [ ${#devices[@]} -gt 0 ]; then
    serve_devices=("serve_devices=[$(printf "'%s'," "${devices[@]}" | sed 's/,$//')]")
fi
# (DUMP unquoted: it may be several words)
$DUMP backend="$BACKEND" serve=true "server.engine_args='$ENGINE_ARGS'" "${serve_devices[@]}" "$@" &
engines=$!
clients=()
stop() {  # SIGTERM: the engine process stops its servers before it exits
    kill "$engines" "${clients[@]}" 2>/dev/null || true
    # a client still running STOP_GRACE_S after (a SIGTERM that lands while Python imports can be
    # lost) is killed: clients resume after the stored samples; the engine process is only waited for
    local live=("${clients[@]}")
    for ((t = 0; t < ${STOP_GRACE_S:-60} && ${#live[@]} > 0; t++)); do
        sleep 1
        local next=()
        for p in "${live[@]}"; do ! kill -0 "$p" 2>/dev/null || next+=("$p"); done
        live=("${next[@]}")
    done
    [ ${#live[@]} -eq 0 ] || kill -KILL "${live[@]}" 2>/dev/null || true
    wait || true
}
trap stop EXIT

# The clients wait for the engines' /health themselves (client.wait_for_server_s).
OFFSET=${CLIENT_RANK_OFFSET:-0}
WORLD=${CLIENT_WORLD_SIZE:-$CLIENTS}
for ((r = 0; r < CLIENTS; r++)); do
    $DUMP backend="$BACKEND" client.rank=$((OFFSET + r)) client.world_size="$WORLD" "$@" &
    clients+=($!)
done

# Until every client is done; the engine process ending first (an engine died, or its options were
# refused) ends the dump: the clients would wait for servers that are gone.
status=0
running=("${clients[@]}")
while [ ${#running[@]} -gt 0 ]; do
    rc=0 ended=""
    wait -n -p ended "$engines" "${running[@]}" || rc=$?
    if [ "$ended" = "$engines" ]; then
        echo "dump_served.sh: the engine process ended (status $rc) before the clients; stopping them" >&2
        exit $((rc ? rc : 1))
    fi
    [ "$rc" -eq 0 ] || status=$rc
    left=()
    for p in "${running[@]}"; do [ "$p" = "$ended" ] || left+=("$p"); done
    running=("${left[@]}")
done
exit $status
