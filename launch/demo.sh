#!/usr/bin/env bash
# The README's main command (`make demo`): the pipeline on the embedded SmolLM2-135M-Instruct
# target, on CPU. Every stage reuses finished output, so a second run skips what is done.
#
#   RUN_DIR=runs/demo bash launch/demo.sh
set -euo pipefail
RUN_DIR=${RUN_DIR:-runs/demo}
PROMPTS=$(python -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")
mkdir -p "$RUN_DIR"

echo "== prepare: the target regenerates the assistant turns of the shipped prompts"
eagle3-prepare target=embedded input="$PROMPTS/train.jsonl" out="$RUN_DIR/prepared" \
  regenerate=true limit="${DEMO_PROMPTS:-96}" regen.max_new_tokens=128 regen.batch_size=48

echo "== dump: hidden states of HF layers [2, 15, 27] (the default for N=30) and the final state"
eagle3-dump target=embedded data="$RUN_DIR/prepared" out="$RUN_DIR/dump" dtype=float32 \
  max_tokens_per_batch=4096

echo "== standardize: aux_hidden = cat(hidden.2, hidden.15, hidden.27); draft vocab from the training split"
eagle3-standardize dumps="[$RUN_DIR/dump]" out="$RUN_DIR/std" draft_vocab_size=8192 eval_fraction=0.1

echo "== train: the draft head on the standardized data (CPU, fp32)"
eagle3-train data="$RUN_DIR/std" target=embedded out="$RUN_DIR/train" \
  train.epochs="${DEMO_EPOCHS:-4}" train.lr=1e-3 train.warmup_steps=5 train.max_tokens_per_batch=2048 \
  train.log_every=10

echo
echo "Prepared conversations: $RUN_DIR/prepared; hidden states: $RUN_DIR/dump; training data: $RUN_DIR/std;"
echo "the trained head: $RUN_DIR/train/checkpoints (metrics in $RUN_DIR/train/metrics.jsonl)."
echo "The next stages (export, eval) are not built yet: the demo stops here."
