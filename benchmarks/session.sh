#!/usr/bin/env bash
# One benchmark as a detached job on a GPU machine that is lent for a while and taken back when idle
# (its /tmp with it): start it, then poll with calls that follow each other without a pause; every poll
# packs what exists so far, so a machine taken back mid-run loses only what the last poll had not packed.
#
#   bash benchmarks/session.sh start NAME [vllm|sglang] -- COMMAND...   # from the repository root
#   bash benchmarks/session.sh poll NAME SECONDS DEST                    # until it prints "ended: rc=N"
#
# start: copies the repository to $S/repo (the working tree may be replaced by the next transfer), then
#   runs COMMAND in $S/out (relative paths land there) with setsid nohup, $S/repo on PYTHONPATH, in the
#   engine's environment when one is named (staging/engine_env.sh); its output in $S/log, nvidia-smi's
#   memory every 5 s in $S/smi.csv, its exit status in $S/rc; S=${SESSIONS:-/tmp/sessions}/NAME.
# poll: waits until the job ends or SECONDS pass, then packs $S's small files (JSON, JSONL, logs, text,
#   CSV, PNG under 8 MiB, none from prepared data or dumps) into DEST/NAME.tgz, and each draft
#   ($S/out/**/export) into DEST/NAME-exportI.tgz.part-NN of 15 MiB (cat them | tar xz).
# Staging first: benchmarks/staging/gpu_stage.sh install (and stage_vllm.sh / stage_sglang.sh for an engine).
set -euo pipefail
cmd=${1:?usage: session.sh start NAME [ENGINE] -- COMMAND... | poll NAME SECONDS DEST}
name=${2:?session name}
S=${SESSIONS:-/tmp/sessions}/$name
export PYTHONPATH=${SITE:-/tmp/site}:$S/repo EAGLE3_CACHE=${EAGLE3_CACHE:-/tmp/e3cache} HF_HUB_OFFLINE=1 \
  PYTHONUNBUFFERED=1 WANDB_MODE=disabled
case $cmd in
start)
  shift 2
  run=(env)
  if [ "${1:-}" != -- ]; then
    REPO=$S/repo source benchmarks/staging/engine_env.sh
    case $1 in vllm) run=("${vllm_env[@]}") ;; sglang) run=("${sglang_env[@]}") ;; *) echo "no engine $1" >&2; exit 2 ;; esac
    shift
  fi
  [ "${1:-}" = -- ] || { echo "session.sh start: the command follows --" >&2; exit 2; }
  shift
  rm -rf "$S" && mkdir -p "$S/repo" "$S/out" && cp -r . "$S/repo/"
  setsid nohup nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv,noheader -l 5 \
    > "$S/smi.csv" 2>&1 < /dev/null &
  echo $! > "$S/smi.pid"
  printf '%q ' "$@" > "$S/command.txt"
  (cd "$S/out" && setsid nohup bash -c "$(printf '%q ' "${run[@]}" "$@"); echo \$? > $S/rc" > "$S/log" 2>&1 < /dev/null &)
  echo "started: $(cat "$S/command.txt")"
  ;;
poll)
  secs=${3:?seconds}
  dest=${4:?destination}
  mkdir -p "$dest"
  pack() {
    (cd "$S" && find . -path ./repo -prune -o \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name log \
      -o -name '*.txt' -o -name '*.csv' -o -name '*.png' -o -name rc \) -size -8M -not -path '*/prepared/*' \
      -not -path '*/dump/*' -print0 | tar czf "$dest/.$name.tgz" --null -T -) && mv "$dest/.$name.tgz" "$dest/$name.tgz"
  }
  end=$((SECONDS + secs))
  pack
  while [ ! -f "$S/rc" ] && [ $SECONDS -lt $end ]; do
    sleep 5
    [ $((SECONDS % 60)) -lt 5 ] && pack
  done
  pack
  rm -f "$dest/$name"-export.tgz.part-*
  i=0
  find "$S/out" -type d -name export | while read -r d; do
    tar czf - -C "$S/out" "${d#"$S/out/"}" | split -b 15M -d - "$dest/$name-export$i.tgz.part-"
    i=$((i + 1))
  done
  tail -n 15 "$S/log"
  if [ -f "$S/rc" ]; then
    kill "$(cat "$S/smi.pid")" 2>/dev/null || true
    echo "ended: rc=$(cat "$S/rc")"
  else
    echo "running"
  fi
  ;;
*) echo "usage: session.sh start|poll ..." >&2; exit 2 ;;
esac
