#!/usr/bin/env bash
# The README's main command (`make demo`): the pipeline on the embedded SmolLM2-135M-Instruct
# target, on CPU. Every stage reuses finished output, so a second run skips what is done.
#
#   RUN_DIR=runs/demo bash launch/demo.sh
set -euo pipefail
RUN_DIR=${RUN_DIR:-runs/demo}
PROMPTS=$(python -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")
mkdir -p "$RUN_DIR"

# The data: DEMO_CONVS conversations of data_prep/prompts/synth_smollm2.jsonl.gz, which the target
# wrote itself on a GPU (questions and greedy answers; the README gives the command that regenerates
# it), so the demo's CPU minutes go to the dump and training. DEMO_DATA=regen instead regenerates
# replies to the 280 shipped prompts here (DEMO_SAMPLED_PASSES=n adds n sampled passes of them).
DUMPS=()
if [ "${DEMO_DATA:-synth}" = synth ]; then
  echo "== prepare: ${DEMO_CONVS:-400} conversations the target wrote itself (shipped, compressed)"
  eagle3-prepare target=embedded input="$PROMPTS/synth_smollm2.jsonl.gz" out="$RUN_DIR/prepared" limit="${DEMO_CONVS:-400}"
  echo "== dump: hidden states of HF layers [2, 15, 27] (the default for N=30) and the final state"
  eagle3-dump target=embedded data="$RUN_DIR/prepared" out="$RUN_DIR/dump" dtype=float32 max_tokens_per_batch=4096
  DUMPS+=("$RUN_DIR/dump")
else
  PASSES=$((1 + ${DEMO_SAMPLED_PASSES:-0}))
  for ((i = 0; i < PASSES; i++)); do
    suffix=$([ "$i" -eq 0 ] && echo "" || echo "_s$i")
    sampling=$([ "$i" -eq 0 ] && echo "" || echo "regen.do_sample=true regen.temperature=0.8 seed=$i sample_id_offset=$((i * 1000000))")
    echo "== prepare${suffix}: the target regenerates the assistant turns of the shipped prompts ($([ "$i" -eq 0 ] && echo greedy || echo "sampled, seed $i"))"
    # shellcheck disable=SC2086  # $sampling is a list of overrides
    eagle3-prepare target=embedded input="$PROMPTS/train.jsonl" out="$RUN_DIR/prepared$suffix" \
      regenerate=true limit="${DEMO_PROMPTS:-280}" regen.max_new_tokens="${DEMO_NEW_TOKENS:-128}" regen.batch_size=64 $sampling
    echo "== dump${suffix}: hidden states of HF layers [2, 15, 27] (the default for N=30) and the final state"
    eagle3-dump target=embedded data="$RUN_DIR/prepared$suffix" out="$RUN_DIR/dump$suffix" dtype=float32 \
      max_tokens_per_batch=4096
    DUMPS+=("$RUN_DIR/dump$suffix")
  done
fi

echo "== standardize: aux_hidden = cat(hidden.2, hidden.15, hidden.27); draft vocab from the training split"
eagle3-standardize dumps="[$(IFS=,; echo "${DUMPS[*]}")]" out="$RUN_DIR/std" draft_vocab_size="${DEMO_DRAFT_VOCAB:-4096}" eval_fraction=0.05

echo "== train: the draft head on the standardized data (CPU, fp32)"
eagle3-train data="$RUN_DIR/std" target=embedded out="$RUN_DIR/train" \
  loop.epochs="${DEMO_EPOCHS:-6}" optim.lr="${DEMO_LR:-3e-3}" optim.warmup_steps=5 objective.ttt_length="${DEMO_TTT:-3}" \
  loop.max_tokens_per_batch=2048 loop.log_every=10 runtime.cache_target_gb="${DEMO_CACHE_GB:-4}"

echo "== export for SGLang and vLLM, check what each engine will capture, evaluate on held-out prompts"
eagle3-export run="$RUN_DIR/train" out="$RUN_DIR/export" engines=[sglang,vllm]
eagle3-check draft="$RUN_DIR/export" target=embedded
eagle3-eval draft="$RUN_DIR/export" target=embedded engine=sglang prompts="$PROMPTS/heldout.jsonl" \
  limit="${DEMO_EVAL_PROMPTS:-10}" max_new_tokens=64 k="${DEMO_K:-3}" dtype=float32 out="$RUN_DIR/eval"

echo
echo "== summary"
python - "$RUN_DIR" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
counts = [json.loads(m.read_text())["counts"] for m in sorted(run.glob("prepared*/manifest.json"))]
prep = {k: sum(c[k] for c in counts) for k in ("rows_written", "tokens", "loss_tokens")}
evals = [json.loads(l) for l in (run / "train" / "metrics.jsonl").read_text().splitlines() if "eval_acc" in l]
report = json.loads((run / "eval" / "report.json").read_text())
print(f"samples {prep['rows_written']}, tokens {prep['tokens']} ({prep['loss_tokens']} assistant)")
print("training eval accuracy per TTT step:", [round(a, 3) for a in evals[-1]["eval_acc"]])
print(f"eagle3-eval ({report['engine']}, HF layers {report['captured_hf_indices']}): tau {report['tau']:.2f}, "
      f"acceptance per position {[round(a, 3) for a in report['acceptance_per_position']]}, lossless {report['lossless']}")
print(f"artifacts under {run}: prepared*/ dump*/ std/ train/ export/ eval/")
PY
