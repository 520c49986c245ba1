#!/usr/bin/env bash
# Issue #13's end-to-end recipe run as one background job on a 2-GPU machine staged with
# benchmarks/staging/gpu_stage.sh (run from the repository root, PYTHONPATH and EAGLE3_CACHE set, the GGUF
# conversion cache warmed in one process first): benchmarks/smollm2_synth.sh with its defaults
# (or the variables given), GPU use sampled every 10 s beside it. If the synthesis fails with the
# graph decoder it starts over with transformers' generate; if online training fails, the same conversations are
# trained offline (dump with fp8 storage, standardize), so the run still ends in a τ; a compiled
# run (the recipe's default on a GPU) is first retried with COMPILE=false. GAP=1: then
# recipe_gap.sh's two extra evals (bf16 target; fresh synthesized prompts).
#
#   W=/tmp/w setsid nohup bash benchmarks/recipe_big_gpu.sh > /dev/null 2>&1 < /dev/null &
# Results under $W: result.json (benchmarks/recipe_results.py: everything below in one file), run/
# (timings.jsonl, eval/report.json, train/), gpu.csv; the log: $W/log.
set -uo pipefail
W=${W:-/tmp/w}
# why dynamo compiles a function again, if it does (one note per recompile, in the log)
export TORCH_LOGS=${TORCH_LOGS-recompiles}
mkdir -p "$W"
nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 10 > "$W/gpu.csv" 2>/dev/null &
smi=$!
{
  echo "== $(date +%T) recipe: N=${N:-default} SOURCE=${SOURCE:-online}"
  if ! RUN_DIR="$W/run" bash benchmarks/smollm2_synth.sh; then
    if [ ! -f "$W/run/prepared/manifest.json" ] && [ "${GEN_BATCHING:-graph}" != padded ]; then
      echo "== $(date +%T) synthesis failed: again with transformers' generate (GEN_BATCHING=padded, 2 processes per GPU)"
      rm -rf "$W/run/prepared"  # its chunks were made with the other batching: a different request
      # exported: the later retries must ask prepare for these same conversations
      export GEN_BATCHING=padded GEN_RANKS_PER_GPU=2 GEN_BATCH=2048
      RUN_DIR="$W/run" bash benchmarks/smollm2_synth.sh && recovered=1
    fi
    if [ -z "${recovered:-}" ] && [ -f "$W/run/prepared/manifest.json" ] && [ ! -f "$W/run/train/manifest.json" ] \
        && [ "${COMPILE:-true}" = true ]; then
      # (the failed attempt's minutes are in the log's clock times, not in timings.jsonl)
      echo "== $(date +%T) compiled training failed: the same conversations again with COMPILE=false"
      rm -rf "$W/run/train"
      export COMPILE=false
      RUN_DIR="$W/run" bash benchmarks/smollm2_synth.sh && recovered=1
    fi
    if [ -z "${recovered:-}" ] && [ "${SOURCE:-online}" = online ] && [ -f "$W/run/prepared/manifest.json" ]; then
      echo "== $(date +%T) online run failed: training the same conversations offline (fp8 dump)"
      rm -rf "$W/run/train"
      RUN_DIR="$W/run" SOURCE=offline DUMP_EXTRA="storage=fp8 ${DUMP_EXTRA:-}" bash benchmarks/smollm2_synth.sh \
        || echo "offline run failed too"
    fi
  fi
  if [ -n "${GAP:-}" ] && [ -f "$W/run/eval/report.json" ]; then
    echo "== $(date +%T) gap evals (recipe_gap.sh)"
    RUN="$W/run" bash benchmarks/recipe_gap.sh || echo "gap evals failed"
  fi
  kill $smi 2>/dev/null
  python3 -m benchmarks.recipe_results "$W/run" "$W/result.json" --gpu-csv "$W/gpu.csv" \
    --machine "$(nvidia-smi -L | wc -l) x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), NGPU=${NGPU:-all}" \
    --what "issue #13: benchmarks/smollm2_synth.sh end to end (benchmarks/recipe_big_gpu.sh), N=${N:-default} SOURCE=${SOURCE:-online}, single run, seed 0; eagle3-eval chain k=5 greedy 128 new tokens fp32 on the 37 held-out prompts" \
    || echo "collecting the results failed"
  echo "== $(date +%T) all done"
} >> "$W/log" 2>&1
