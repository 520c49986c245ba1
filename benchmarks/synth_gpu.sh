#!/usr/bin/env bash
# The GPU run behind issue #12/#13's numbers, in one background job (on a machine staged with
# benchmarks/staging/gpu_stage.sh): the synthesis throughput on one GPU, the recipe on all GPUs (its synthesis
# is the many-GPU throughput), the scaling curve and options table from the recipe's dump, the
# demo corpus, and the collected results. Progress: $W/log.
#
#   W=/tmp/w N=32768 bash benchmarks/synth_gpu.sh
set -euo pipefail
# the recipe as it was when this run was measured (its defaults have moved on since)
export SOURCE=offline GEN_BATCH=${GEN_BATCH:-1024} GEN_RANKS_PER_GPU=${GEN_RANKS_PER_GPU:-1} BATCH_TOKENS=${BATCH_TOKENS:-65536} \
  LR=${LR:-3e-3} INTERMEDIATE=${INTERMEDIATE:-1536}
W=${W:-/tmp/w}
N=${N:-32768}
BENCH_N=${BENCH_N:-4096}
DEMO_N=${DEMO_N:-2048}
mkdir -p "$W"
PROMPTS=$(python3 -c "import data_prep.prompts as p, os; print(os.path.dirname(p.__file__))")
SYN="synth.system_prompts_file=$PROMPTS/synth_systems.txt synth.keep_system_prompt=false synth.chunk_size=$GEN_BATCH \
regen.max_new_tokens=${NEW_TOKENS:-128} regen.batch_size=$GEN_BATCH"
{
  echo "== $(date +%T) synthesis on one GPU: $BENCH_N conversations"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 python3 -m data_prep.prepare target="${TARGET:-embedded}" synthesize="$BENCH_N" out="$W/bench1" $SYN progress=false
  echo "== $(date +%T) recipe on all GPUs: $N conversations"
  RUN_DIR="$W/run" N="$N" EPOCHS="${EPOCHS:-4}" bash benchmarks/smollm2_synth.sh &  # the curve's epochs
  recipe=$!
  while [ ! -f "$W/run/dump/manifest.json" ] && kill -0 $recipe 2>/dev/null; do sleep 5; done
  echo "== $(date +%T) dump done; demo corpus and scaling curve start beside the recipe's training"
  mkdir -p "$W/demo" && cp -r "$W/run/prepared/synth" "$W/demo/"  # the same chunks: nothing is generated again
  # shellcheck disable=SC2086
  python3 -m data_prep.prepare target="${TARGET:-embedded}" synthesize="$DEMO_N" out="$W/demo" $SYN progress=false \
    save_conversations="$W/synth_smollm2.jsonl.gz" || echo "demo corpus failed"
  bash benchmarks/scaling_curve.sh "$W/run" || echo "curve failed"
  wait $recipe || echo "recipe failed"
  python3 -m benchmarks.scaling_results "$W/run" "$W/scaling.json" "$W/scaling.png" \
    --what "synthesized conversations (benchmarks/smollm2_synth.sh), first n of one run; eagle3-eval chain k=5 greedy 128 new tokens fp32 on the 37 held-out prompts" \
    --machine "$(nvidia-smi -L | wc -l) x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo "== $(date +%T) eval benchmark"
  python3 -m benchmarks.bench_eval --draft "$W/run/export" --out "$W/eval_bench.json" --batch1-n 32 || echo "bench_eval failed"
  echo "== $(date +%T) all done"
} >> "$W/log" 2>&1
