#!/usr/bin/env bash
# The data recipe for SmolLM2-135M-Instruct (the embedded target) on one or two GPUs: the target
# writes N conversations itself (eagle3-prepare synthesize=N, steered by
# data_prep/prompts/synth_systems.txt, answered greedily), then trains online with the target in the
# loop (SOURCE=offline: dump + standardize first; ttt 5 = the chain length it is evaluated with,
# target-initialised lm_head), exports, checks and evals on the shipped
# held-out prompts (chain k=5, greedy, 128 new tokens, fp32: the lossless check is exact).
#
#   bash launch/recipes/smollm2_synth.sh                          # all GPUs of this machine
#   NGPU=1 N=16384 EPOCHS=4 RUN_DIR=runs/s16k bash launch/recipes/smollm2_synth.sh
#
# Measured with these defaults at N=32768 on one H200 (tests/benchmarks/results/recipe_online_h200x2.json):
# tau 2.53 on the held-out prompts (vLLM 0.26 serving the export: 2.53), lossless, 15.0 minutes end to
# end (synthesis 7.4, online training 6.6, export + check + eval 1.0); the same conversations on two
# H200s, 12 epochs of 64k-token batches: 2.51 (training 5.6 minutes). The default N=65536 on two GPUs
# (about 16 minutes: synthesis as long as 32768 on one, training 2 x the tokens at 1.8 x the tokens/s)
# is not measured; tau grew 0.2-0.3 per doubling of conversations. Earlier settings, measured at
# tau 2.40 (recipe_synth_h200x2.json):
#   N=32768 SOURCE=offline BATCH_TOKENS=65536 LR=3e-3 EPOCHS=10 INTERMEDIATE=1536 GEN_BATCH=1024 GEN_RANKS_PER_GPU=1 EXAMPLES=
#
# Every stage reuses finished output, so a rerun continues where a crash stopped. Stage times go to
# $RUN_DIR/timings.jsonl. Variables (default): N (65536), NGPU (all GPUs), RUN_DIR, EPOCHS (8), LR
# (2e-3), TTT (5), BATCH_TOKENS (32768 x NGPU, global: divided by NGPU per rank; the online step's time
# hardly depends on its tokens, so each GPU takes 32k), INTERMEDIATE (3072: the draft
# MLP width), DRAFT_VOCAB (8192), NEW_TOKENS (128: reply length), GEN_BATCH (2048: prompts generated
# together per process, also the synthesis chunk size), GEN_BATCHING (padded: regen.batching, or static
# | continuous), GEN_RANKS_PER_GPU (2: synthesis processes per GPU), EXAMPLES (data_prep/prompts/
# train.jsonl: user prompts shown as examples when the target writes its questions, synth.example_prompts_file;
# '' for none), SOURCE (online: the target in the
# training loop; offline: dump + standardize first), TARGET (embedded), DUMP_EXTRA / TRAIN_EXTRA (more
# eagle3-dump / eagle3-train overrides), UNTIL=standardize (offline: stop once the training data is
# ready, e.g. to train several variants of it).
set -euo pipefail
if [ "${UNTIL:-}" = standardize ] && [ "${SOURCE:-online}" = online ]; then
  echo "smollm2_synth.sh: UNTIL=standardize needs SOURCE=offline (online training has no dump or standardize)" >&2
  exit 2
fi
N=${N:-65536}
NGPU=${NGPU:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
[ "$NGPU" -ge 1 ] || NGPU=1  # no GPU: one process on the CPU
RUN=${RUN_DIR:-runs/smollm2_synth}
PROMPTS=$(python3 -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")
mkdir -p "$RUN"
run() {  # run <stage> <command...>: time it, record it
  local stage=$1; shift
  local t0; t0=$(date +%s.%N)
  echo "== $stage: $*"
  "$@"
  python3 -c "import json,sys; print(json.dumps({'stage': sys.argv[1], 'seconds': round(float(sys.argv[3]) - float(sys.argv[2]), 1)}))" \
    "$stage" "$t0" "$(date +%s.%N)" >> "$RUN/timings.jsonl"
}
dist() { if [ "$NGPU" -gt 1 ]; then python3 -m torch.distributed.run --nproc_per_node "$NGPU" "$@"; else python3 "$@"; fi; }
GEN_BATCH=${GEN_BATCH:-2048}
GEN_PROCS=$((NGPU * ${GEN_RANKS_PER_GPU:-2}))  # synthesis ranks may share a GPU (generation is bound by per-step overhead)
gen_dist() { if [ "$GEN_PROCS" -gt 1 ]; then python3 -m torch.distributed.run --nproc_per_node "$GEN_PROCS" "$@"; else python3 "$@"; fi; }

EXAMPLES=${EXAMPLES-$PROMPTS/train.jsonl}  # example user prompts shown when the target writes questions ('' for none)
SYNTH_EXTRA=()
if [ -n "$EXAMPLES" ]; then SYNTH_EXTRA+=("synth.example_prompts_file=$EXAMPLES"); fi
run synthesize gen_dist -m data_prep.prepare target="${TARGET:-embedded}" synthesize="$N" out="$RUN/prepared" \
  synth.system_prompts_file="$PROMPTS/synth_systems.txt" synth.keep_system_prompt=false synth.chunk_size="$GEN_BATCH" \
  "${SYNTH_EXTRA[@]}" \
  regen.max_new_tokens="${NEW_TOKENS:-128}" regen.batch_size="$GEN_BATCH" regen.batching="${GEN_BATCHING:-padded}"
RECIPE_TRAIN="train.ttt_length=${TTT:-5} train.epochs=${EPOCHS:-8} train.lr=${LR:-2e-3} train.warmup_steps=30 \
train.max_tokens_per_batch=$(( ${BATCH_TOKENS:-$((32768 * NGPU))} / NGPU )) train.eval_every=500 train.keep_best=true train.log_every=50 \
model.lm_head_init=target model.intermediate_size=${INTERMEDIATE:-3072}"
if [ "${SOURCE:-online}" = online ]; then  # the target runs in the training loop: no dump, no standardize
  # shellcheck disable=SC2086  # RECIPE_TRAIN and TRAIN_EXTRA are lists of overrides
  run train dist -m eagle3_train.trainer source=online data="$RUN/prepared" target="${TARGET:-embedded}" out="$RUN/train" \
    online.draft_vocab_size="${DRAFT_VOCAB:-8192}" online.eval_fraction=0.02 $RECIPE_TRAIN ${TRAIN_EXTRA:-}
else
  # shellcheck disable=SC2086  # DUMP_EXTRA is a list of overrides
  run dump dist -m data_prep.dump target="${TARGET:-embedded}" data="$RUN/prepared" out="$RUN/dump" dtype=bfloat16 ${DUMP_EXTRA:-}
  run standardize python3 -m data_prep.standardize dumps="[$RUN/dump]" out="$RUN/std" \
    draft_vocab_size="${DRAFT_VOCAB:-8192}" eval_fraction=0.02 ${MAX_SAMPLES:+max_samples=$MAX_SAMPLES}
  [ "${UNTIL:-}" = standardize ] && exit 0
  # shellcheck disable=SC2086  # RECIPE_TRAIN and TRAIN_EXTRA are lists of overrides
  run train dist -m eagle3_train.trainer data="$RUN/std" target="${TARGET:-embedded}" out="$RUN/train" $RECIPE_TRAIN ${TRAIN_EXTRA:-}
fi
run export python3 -m eagle3_train.export run="$RUN/train" out="$RUN/export" engines=[sglang,vllm]
run check python3 -m eagle3_train.check draft="$RUN/export" target="${TARGET:-embedded}"
run eval python3 -m eagle3_train.eval draft="$RUN/export" target="${TARGET:-embedded}" engine=sglang \
  prompts="$PROMPTS/heldout.jsonl" k=5 max_new_tokens=128 dtype=float32 batch_size=37 out="$RUN/eval"
python3 - "$RUN" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
r = json.loads((run / "eval" / "report.json").read_text())
t = [json.loads(l) for l in (run / "timings.jsonl").read_text().splitlines()]
print(f"tau {r['tau']:.3f}, acceptance {[round(a, 3) for a in r['acceptance_per_position']]}, "
      f"lossless {r.get('lossless')}; stages {[(x['stage'], x['seconds']) for x in t]}")
PY
