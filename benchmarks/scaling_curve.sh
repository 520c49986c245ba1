#!/usr/bin/env bash
# The data-scaling curve and the recipe-options table (not part of the suite): from one dump of
# synthesized conversations (benchmarks/smollm2_synth.sh, which also trains the largest point),
# standardize the first n conversations for each n in POINTS, train each with the recipe's options
# and evaluate it (EVAL_LONG="512 1024": also at those reply lengths, with tau by reply position);
# VARIANTS train the same data (n = VARIANT_N) with one option changed. Runs share the GPUs (a head
# this small leaves a GPU mostly idle), round-robin.
#
#   POINTS="2048 4096 8192 16384" bash benchmarks/scaling_curve.sh runs/smollm2_synth
#   POINTS="" VARIANT_N=32768 VARIANTS="a|train.lr=1e-3" TRAIN_TIMEOUT=600 bash benchmarks/scaling_curve.sh RUN
#
# MAX_JOBS (4 per GPU) trainings run at once, the rest wait for a free slot: seven at once on one
# H200 ran four out of memory (recipe_study35_h200.json: with the recipe's 6144-wide MLP and 32k-token
# batches a run holds 20-30 GB, the ttt unroll's activations). RECIPE_EXTRA adds overrides to every run's recipe (issue #35's study: "model.intermediate_size=6144",
# the launch recipe's MLP width). TRAIN_TIMEOUT (seconds, 0: none) stops a training that runs past it; under keep_best its best
# checkpoint so far is still exported and evaluated (the run's train.log says it was stopped).
#   python3 -m benchmarks.scaling_results runs/smollm2_synth out.json out.png
set -euo pipefail
RUN=${1:?usage: scaling_curve.sh RUN_DIR}
POINTS=${POINTS-"2048 4096 8192 16384"}  # set but empty: no curve, variants only
VARIANT_N=${VARIANT_N:-8192}
NGPU=${NGPU:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
[ "$NGPU" -ge 1 ] || NGPU=1  # no GPU: one process on the CPU
PROMPTS=$(python3 -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")
RECIPE="train.ttt_length=${TTT:-5} train.epochs=${EPOCHS:-4} train.lr=${LR:-3e-3} train.warmup_steps=30 \
train.max_tokens_per_batch=${BATCH_TOKENS:-32768} train.eval_every=100 train.keep_best=true train.log_every=20 \
model.lm_head_init=target ${RECIPE_EXTRA:-}"
# name|overrides that replace the recipe's (later overrides win)
VARIANTS=${VARIANTS:-"lm_head_random|model.lm_head_init=random
lm_head_frozen|model.freeze_lm_head=true
aux_norm|model.aux_norm=true
epochs_8|train.epochs=8
warmup_0|train.warmup_steps=0
ttt_7|train.ttt_length=7"}
mkdir -p "$RUN/curve"

for n in $(printf "%s\n" $POINTS "$VARIANT_N" | sort -un); do  # one standardized copy per n (CPU work, in parallel)
  [ -f "$RUN/curve/std_$n/manifest.json" ] && continue
  python3 -m data_prep.standardize dumps="[$RUN/dump]" out="$RUN/curve/std_$n" draft_vocab_size="${DRAFT_VOCAB:-8192}" \
    eval_fraction=0.02 max_samples="$n" progress=false workers=4 > "$RUN/curve/std_$n.log" 2>&1 &
done
wait

one() {  # one <name> <n> <gpu> [overrides...]: train, export, eval; a refused export is recorded, not fatal
  local name=$1 n=$2 gpu=$3; shift 3
  local d="$RUN/curve/$name"
  mkdir -p "$d"
  echo "$RECIPE $*" > "$d/overrides.txt"
  local t0; t0=$(date +%s)
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpu timeout -s INT "${TRAIN_TIMEOUT:-0}" python3 -m eagle3_train.training.trainer data="$RUN/curve/std_$n" \
    target="${TARGET:-embedded}" out="$d/train" $RECIPE "$@" > "$d/train.log" 2>&1 || {
    local rc=$?
    if [ $rc -eq 124 ]; then echo "stopped by TRAIN_TIMEOUT=${TRAIN_TIMEOUT}s" >> "$d/train.log"; echo "$name: timed out"
    else echo "$name: training failed (see $d/train.log)"; return 0; fi
  }
  echo $(( $(date +%s) - t0 )) > "$d/train_s"
  if CUDA_VISIBLE_DEVICES=$gpu python3 -m eagle3_train.serving.export run="$d/train" out="$d/export" > "$d/export.log" 2>&1; then
    CUDA_VISIBLE_DEVICES=$gpu python3 -m eagle3_train.evaluation.eval draft="$d/export" target="${TARGET:-embedded}" engine=sglang \
      prompts="$PROMPTS/heldout.jsonl" k=5 max_new_tokens=128 dtype=float32 batch_size=37 out="$d/eval" progress=false \
      > "$d/eval.log" 2>&1 || echo "$name: eval exit $? (see $d/eval.log)"
    for long in ${EVAL_LONG:-}; do  # longer replies too (issue #35: tau at 512 new tokens), tau by reply position
      CUDA_VISIBLE_DEVICES=$gpu python3 -m eagle3_train.evaluation.eval draft="$d/export" target="${TARGET:-embedded}" engine=sglang \
        prompts="$PROMPTS/heldout.jsonl" k=5 max_new_tokens="$long" dtype=float32 batch_size=37 out="$d/eval_$long" progress=false \
        > "$d/eval_$long.log" 2>&1 || echo "$name: eval ($long new tokens) exit $? (see $d/eval_$long.log)"
    done
  else
    echo "$name: export refused (see $d/export.log)"
  fi
  echo "$name done"
}
MAX_JOBS=${MAX_JOBS:-$((4 * NGPU))}
slot() { while [ "$(jobs -rp | wc -l)" -ge "$MAX_JOBS" ]; do wait -n || true; done; }
i=0
for n in $POINTS; do
  slot
  one "n$n" "$n" $((i % NGPU)) & i=$((i + 1))
done
while IFS='|' read -r name overrides; do
  [ -n "$name" ] || continue
  slot
  # shellcheck disable=SC2086
  one "$name" "$VARIANT_N" $((i % NGPU)) $overrides & i=$((i + 1))
done <<< "$VARIANTS"
wait
