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

echo
echo "Prepared conversations are in $RUN_DIR/prepared (manifest.json, dataset/)."
echo "The next stages (dump, standardize, train, export, eval) are not built yet:"
echo "the demo stops after prepare."
