#!/usr/bin/env bash
# Recipe options for the embedded target, measured on one synthesized dataset (issue #13), in one
# background job on a GPU machine staged with benchmarks/staging/gpu_stage.sh: the recipe's synthesis, dump and
# standardize (benchmarks/smollm2_synth.sh UNTIL=standardize), then every VARIANT trained on it
# at once (benchmarks/scaling_curve.sh, round-robin over the GPUs, TRAIN_TIMEOUT each),
# exported and evaluated (eagle3-eval, chain k=5, greedy, the held-out prompts); beside them the
# conversations are saved as one .jsonl.gz, so a later sweep can start from them (SYNTH_FILE) instead
# of synthesizing again. Results: $W/sweep.json; progress: $W/log.
#
#   W=/tmp/w N=32768 EPOCHS=6 TRAIN_TIMEOUT=720 VARIANTS="$(cat variants.txt)" bash benchmarks/recipe_sweep_gpu.sh
set -euo pipefail
W=${W:-/tmp/w}
N=${N:-32768}
mkdir -p "$W"
PROMPTS=$(python3 -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")
{
  echo "== $(date +%T) data: $N conversations"
  if [ -n "${SYNTH_FILE:-}" ]; then  # conversations saved by an earlier sweep: prepare, dump, standardize
    NGPU=$(nvidia-smi -L | wc -l)
    python3 -m data_prep.prepare target="${TARGET:-embedded}" input="$SYNTH_FILE" out="$W/run/prepared" limit="$N" progress=false
    python3 -m torch.distributed.run --nproc_per_node "$NGPU" -m data_prep.dump target="${TARGET:-embedded}" \
      data="$W/run/prepared" out="$W/run/dump" dtype=bfloat16 progress=false
  else
    RUN_DIR="$W/run" N="$N" UNTIL=standardize SOURCE=offline bash benchmarks/smollm2_synth.sh
    mkdir -p "$W/convs" && cp -r "$W/run/prepared/synth" "$W/convs/"  # the same chunks: nothing is generated again
    python3 -m data_prep.prepare target="${TARGET:-embedded}" synthesize="$N" out="$W/convs" progress=false \
      synth.system_prompts_file="$PROMPTS/synth_systems.txt" synth.keep_system_prompt=false synth.chunk_size="${GEN_BATCH:-2048}" \
      regen.max_new_tokens="${NEW_TOKENS:-128}" regen.batch_size="${GEN_BATCH:-2048}" \
      save_conversations="$W/synth_$N.jsonl.gz" > "$W/convs.log" 2>&1 &
  fi
  echo "== $(date +%T) variants"
  POINTS="" VARIANT_N="$N" bash benchmarks/scaling_curve.sh "$W/run"
  wait
  python3 -m benchmarks.scaling_results "$W/run" "$W/sweep.json" "$W/sweep.png" \
    --what "recipe options on $N synthesized conversations (benchmarks/recipe_sweep_gpu.sh); eagle3-eval chain k=5 greedy 128 new tokens fp32 on the 37 held-out prompts; several trainings share each GPU" \
    --machine "$(nvidia-smi -L | wc -l) x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo "== $(date +%T) all done"
} >> "$W/log" 2>&1
