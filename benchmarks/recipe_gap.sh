#!/usr/bin/env bash
# Where the held-out prompts lose τ against the synthesized eval split (issue #13): after a recipe run
# (recipe_big_gpu.sh, GAP=1), eval its exported draft twice more:
#   eval_bf16/   the same 37 held-out prompts with the target in bfloat16 (as served) instead of fp32;
#   eval_fresh/  FRESH (128) conversations the target synthesizes with the recipe's own settings but
#                another seed (never trained on), the kept set, fp32 (the run of 2026-11-30 used every
#                conversation of its chunks that passed the per-turn filters: 170; before
#                STARTER_WORDS, the recipe's default since then, was set).
# eval_fresh close to training's simulated τ on its eval split: the draft decodes as it was scored,
# and the held-out gap is the prompts'. eval_fresh well below it: decoding and scoring disagree.
#
#   RUN=/tmp/w/run bash benchmarks/recipe_gap.sh
set -euo pipefail
RUN=${RUN:?set RUN to the recipe RUN_DIR}
PROMPTS=$(python3 -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")
TARGET=${TARGET:-embedded}
# eagle3-eval exits 1 when a turn diverged from plain greedy; in bf16 a near-tie at the threshold can
# (the report counts it), and the fresh-prompt eval must still run
python3 -m eagle3_train.evaluation.eval draft="$RUN/export" target="$TARGET" engine=sglang prompts="$PROMPTS/heldout.jsonl" \
  k=5 max_new_tokens=128 dtype=bfloat16 batch_size=37 out="$RUN/eval_bf16" \
  || grep -q '"lossless": "diverged"' "$RUN/eval_bf16/report.json"
python3 -m data_prep.prepare target="$TARGET" synthesize="${FRESH:-128}" out="$RUN/fresh" seed=100000 \
  synth.system_prompts_file="$PROMPTS/synth_systems.txt" synth.keep_system_prompt=false \
  synth.example_prompts_file="$PROMPTS/train.jsonl" synth.starter_words="${STARTER_WORDS:-1}" synth.chunk_size="${FRESH:-128}" \
  regen.max_new_tokens="${NEW_TOKENS:-128}" regen.batch_size=512 regen.batching="${GEN_BATCHING:-graph}" \
  save_conversations="$RUN/fresh/fresh.jsonl.gz"
# the kept conversations (one user turn each): eagle3-eval sends their user turns, the target answers
python3 -m eagle3_train.evaluation.eval draft="$RUN/export" target="$TARGET" engine=sglang prompts="$RUN/fresh/fresh.jsonl.gz" \
  k=5 max_new_tokens=128 dtype=float32 batch_size=64 out="$RUN/eval_fresh"
