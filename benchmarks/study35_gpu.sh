#!/usr/bin/env bash
# Issue #35's study, one background job on a GPU machine staged with benchmarks/staging/gpu_stage.sh: the one-GPU recipe
# (benchmarks/smollm2_synth.sh: synthesis, online training, export, check, eval) at N conversations, once
# as it is (`base`) and once per lever with one thing changed, each evaluated with eagle3-eval chain k=5,
# greedy, fp32 on the held-out prompts at 128 new tokens (the recipe's own eval) and at EVAL_LONG.
#
# VARIANTS (default: the lines of benchmarks/study35_variants.txt named by ONLY, a regex; all without it),
# one per line, name|VAR=value|FROM: the recipe's environment that the lever changes (OWN_REPEATS=8,
# TRAIN_EXTRA="train.ema_decay=0.999", NEW_TOKENS=256, DRAFT_VOCAB=32768, ...; several levers at once joined
# by ';': OWN_REPEATS=8;TRAIN_EXTRA=train.schedule=wsd) and, where the lever leaves
# the synthesis as it is, FROM: the variant whose synthesized conversations it trains on (its prepared
# directory is linked, so the recipe skips the synthesis; the settings that synthesis was made with,
# FROM's PREPARE_EXTRA, NEW_TOKENS, ... (SYNTH_VARS), come first in its change, or the recipe would refuse
# the directory as made otherwise: `stack|OWN_REPEATS=8|turns_2` adds own prompts to the two-turn
# conversations). Training is online, as the recipe's: nothing is dumped, so the disk holds only the
# prepared conversations (a first version dumped each variant offline: five 16k-conversation dumps and
# their standardized copies did not fit the H200 machine's 64 GB).
#
# Every variant's whole recipe holds one of SLOTS (default 4) slots (lock files), so at most that many
# synthesize or train on the GPU at once (an online training of the recipe's head holds ~28.5 GB of an H200:
# five at once ran out of memory, four fit); minutes are while sharing it, not solo figures. A
# variant whose eval exists is not run again (the study resumes). Results: $W/study35.json (a row per variant
# and the table the docs show: python3 -m benchmarks.study35_results); progress: $W/log; $W/done at the end.
#
#   W=/tmp/ws N=16384 ONLY='^(base|own_x8|ema|cosine|sure|sampled)' setsid nohup bash benchmarks/study35_gpu.sh > /dev/null 2>&1 < /dev/null &
# A CPU dry run (minutes; a 32k-token batch of the recipe's head was OOM-killed on a 24 GB machine, hence BATCH_TOKENS):
#   W=/tmp/ws N=6 EPOCHS=1 NEW_TOKENS=8 BATCH_TOKENS=2048 EVAL_LONG= EVAL_EXTRA="limit=2" ONLY='^(base|own_x8|cosine)' \
#   TRAIN_EXTRA_ALL="train.max_steps=2" bash benchmarks/study35_gpu.sh
# PLAN=1: check the variant lines and print each one's whole change (name|change|FROM), run nothing.
set -uo pipefail
W=${W:-/tmp/ws}
N=${N:-16384}
mkdir -p "$W"
rm -f "$W/done" "$W"/*.failed
mkdir -p "$W/slots"
SLOTS=${SLOTS:-4}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

in_slot() {  # in_slot <command...>: run it holding one of the SLOTS lock files in $W/slots (waits for one)
  while :; do
    for s in $(seq 1 "$SLOTS"); do
      local rc=0
      flock -n -E 75 "$W/slots/$s" "$@" || rc=$?
      [ "$rc" -eq 75 ] || return "$rc"
    done
    sleep 5
  done
}
VARIANTS=${VARIANTS:-$(grep -E "${ONLY:-.}" benchmarks/study35_variants.txt)}
PROMPTS=$(python3 -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")

line_of() { grep -E "^$1\|" <<< "$VARIANTS" | head -1; }  # line_of <name>: that variant's line (empty: none)
SYNTH_VARS='PREPARE_EXTRA|NEW_TOKENS|GEN_BATCH|GEN_BATCHING|EXAMPLES|STARTER_WORDS|TARGET'  # what the synthesis reads
synthesis_of() {  # synthesis_of <name>: the synthesis settings of that variant and of those it trains on, VAR=value;...
  local assign from v out=() vars=()
  IFS='|' read -r _ assign from <<< "$(line_of "$1")"
  if [ -n "$from" ]; then v=$(synthesis_of "$from") && [ -n "$v" ] && out+=("$v"); fi
  IFS=';' read -ra vars <<< "$assign"
  for v in "${vars[@]}"; do [[ $v =~ ^($SYNTH_VARS)= ]] && out+=("$v"); done
  (IFS=';'; echo "${out[*]}")
}
whole_change() {  # whole_change <assign> <from>: FROM's synthesis settings, then the variant's own change
  local inherited=""
  [ -n "$2" ] && inherited=$(synthesis_of "$2")
  echo "${inherited}${inherited:+${1:+;}}$1"
}

variant() {  # variant <name> <VAR=value> <from>: the recipe with that change, then the longer evals
  local name=$1 assign=$2 from=$3 run=$W/$1
  [ -f "$run/eval/report.json" ] && { echo "$name: finished earlier"; return; }
  if [ -n "$from" ]; then  # the synthesized conversations of $from, finished, read as this run's
    until [ -f "$W/$from/prepared/manifest.json" ] || [ -f "$W/$from.failed" ]; do sleep 10; done
    [ -f "$W/$from.failed" ] && { echo "$name: $from failed before its synthesis was done"; touch "$W/$name.failed"; return; }
    mkdir -p "$run" && ln -sfn "$W/$from/prepared" "$run/prepared"
  fi
  mkdir -p "$run" && echo "${assign:-—}" > "$run/change.txt" && echo "${from:-}" > "$run/from.txt"
  echo "== $(date +%T) $name: the recipe with ${assign:-nothing changed}${from:+, on the synthesis of $from}"
  # the study's settings, then the variant's change (later: it replaces them, e.g. EPOCHS=9 or its own
  # TRAIN_EXTRA in place of TRAIN_EXTRA_ALL)
  local vars=() whole  # the change: VAR=value, or several joined by ';' (levers together), after FROM's synthesis
  whole=$(whole_change "$assign" "$from")
  [ -n "$whole" ] && IFS=';' read -ra vars <<< "$whole"
  in_slot env TRAIN_EXTRA="${TRAIN_EXTRA_ALL:-}" RUN_DIR="$run" N="$N" NGPU=1 SOURCE=online COMPILE="${COMPILE:-false}" \
    GEN_BATCH="${GEN_BATCH:-2048}" EPOCHS="${EPOCHS:-6}" "${vars[@]}" bash benchmarks/smollm2_synth.sh > "$W/$name.log" 2>&1 || {
    echo "$name: the recipe failed (see $W/$name.log)"; touch "$W/$name.failed"; return; }
  for long in ${EVAL_LONG-512}; do  # the same draft on longer replies, tau by reply position
    # shellcheck disable=SC2086  # EVAL_EXTRA is a list of overrides
    python3 -m eagle3_train.evaluation.eval draft="$run/export" target="${TARGET:-embedded}" engine=sglang \
      prompts="$PROMPTS/heldout.jsonl" k=5 max_new_tokens="$long" dtype=float32 batch_size=37 out="$run/eval_$long" \
      progress=false ${EVAL_EXTRA:-} > "$W/$name.eval_$long.log" 2>&1 || echo "$name: eval at $long new tokens failed (see $W/$name.eval_$long.log)"
  done
  echo "== $(date +%T) $name: done"
}

names=() line=0
while IFS='|' read -r name assign from; do  # every line checked before anything runs
  line=$((line + 1))
  [ -n "$name" ] || continue
  IFS=';' read -ra vars <<< "$assign"
  for v in "${vars[@]}"; do
    [[ $v =~ ^[A-Z_][A-Z0-9_]*= ]] || { echo "study35_gpu.sh: variant line $line ($name): change '$v' is not VAR=value" >&2; exit 2; }
  done
  if [ -n "$from" ] && [ -z "$(line_of "$from")" ]; then
    echo "study35_gpu.sh: variant line $line ($name): FROM '$from' names no variant of this study" >&2; exit 2
  fi
  seen=" $name " up=$from  # FROM's chain ends at a variant that synthesizes (a loop would wait forever)
  while [ -n "$up" ]; do
    [[ $seen == *" $up "* ]] && { echo "study35_gpu.sh: variant line $line ($name): FROM loops back through '$up'" >&2; exit 2; }
    seen+="$up " && IFS='|' read -r _ _ up <<< "$(line_of "$up")"
  done
done <<< "$VARIANTS"
if [ -n "${PLAN:-}" ]; then
  while IFS='|' read -r name assign from; do [ -n "$name" ] && echo "$name|$(whole_change "$assign" "$from")|$from"; done <<< "$VARIANTS"
  exit 0
fi
{
  echo "== $(date +%T) N=$N, SLOTS=$SLOTS; disk: $(df -h "$W" | tail -1)"
  while IFS='|' read -r name assign from; do
    [ -n "$name" ] || continue
    names+=("$name")
    variant "$name" "$assign" "$from" &
    sleep 2  # started in the order listed (slots are taken by whoever asks first once one is free)
  done <<< "$VARIANTS"
  wait
  python3 -m benchmarks.study35_results "$W" "${names[@]}"
  echo "== $(date +%T) all done; disk: $(df -h "$W" | tail -1)"
  touch "$W/done"
} >> "$W/log" 2>&1
