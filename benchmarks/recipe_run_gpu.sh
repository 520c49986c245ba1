#!/usr/bin/env bash
# eagle3-run as one detached job on a GPU machine lent for a while (its /tmp given back when idle):
#   bash benchmarks/recipe_run_gpu.sh start RUN_DIR recipe=smollm2 [overrides...]
#       copies the repository to /tmp/repo and starts `python3 -m eagle3_train.run ... out=RUN_DIR`
#   bash benchmarks/recipe_run_gpu.sh poll RUN_DIR SECONDS DEST
#       waits until the run ends or SECONDS pass, then packs what exists (run.jsonl, the log, the
#       reports, nvidia-smi's memory trace) into DEST; call it back to back until it prints "ended"
# Staging first: benchmarks/staging/gpu_stage.sh install (wheels and the embedded target).
set -euo pipefail
cmd=${1:?usage: recipe_run_gpu.sh start|poll ...}
run=${2:?run directory}
export PYTHONPATH=/tmp/site:/tmp/repo EAGLE3_CACHE=/tmp/e3cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 WANDB_MODE=disabled
case $cmd in
start)
  shift 2
  rm -rf /tmp/repo && mkdir -p /tmp/repo "$run" && cp -r . /tmp/repo/ && cd /tmp/repo
  setsid nohup nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 5 \
    > "$run.smi" 2>&1 < /dev/null &
  echo $! > "$run.smi.pid"
  setsid nohup bash -c "python3 -m eagle3_train.run out=$run $*; echo \$? > $run.rc" \
    > "$run.log" 2>&1 < /dev/null &
  echo "started: python3 -m eagle3_train.run out=$run $*"
  ;;
poll)
  secs=${3:?seconds}; dest=${4:?destination}
  end=$((SECONDS + secs))
  while [ ! -f "$run.rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
  mkdir -p "$dest"
  cp "$run.log" "$run.smi" "$dest/" 2>/dev/null || true
  [ -f "$run/run.jsonl" ] && cp "$run/run.jsonl" "$dest/"
  for f in "$run"/eval/report.json "$run"/check/*.json "$run"/export/config.json "$run"/train/*.json; do
    [ -f "$f" ] && cp "$f" "$dest/$(basename "$(dirname "$f")")_$(basename "$f")"
  done
  tail -n 15 "$run.log"
  if [ -f "$run.rc" ]; then
    kill "$(cat "$run.smi.pid")" 2>/dev/null || true
    echo "ended: rc=$(cat "$run.rc")"
  else
    echo "running"
  fi
  ;;
*) echo "usage: recipe_run_gpu.sh start|poll ..." >&2; exit 2 ;;
esac
