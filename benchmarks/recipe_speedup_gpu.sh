#!/usr/bin/env bash
# Issue #34 on the recipe's own draft, one lease of one H200, as one background job (run from the
# repository root after benchmarks/staging/gpu_stage.sh; benchmarks/staging/stage_vllm.sh and benchmarks/staging/stage_sglang.sh may finish
# while the recipe runs):
#   1. the recipe at its one-GPU defaults (benchmarks/smollm2_synth.sh, N=73728; DRAFT=<an export>
#      skips it), its own timings and eval in $W/recipe;
#   2. eagle3-bench in vLLM with CUDA graphs, the GPU otherwise idle: concurrency 1/4/16/64, greedy and
#      at TEMPS (default [0,0.7]), 256 new tokens;
#   3. SGLang serving chain-5 and trees at concurrency 1 (speedup_gpu.sh STEPS=sglang): its acceptance
#      length next to eagle3-eval's tree tau, where /tmp/sgsite is staged.
# An engine not staged within STAGE_WAIT_S (600) seconds of its turn is skipped, said in the log. The
# recipe's variables pass through (OWN_REPEATS=8, TRAIN_EXTRA="train.ema_decay=0.999", ...).
# Progress: $W/log; $W/done when finished. `bash benchmarks/study_speedup_gpu.sh bundle DIR` with
# W and DRAFT=$W/recipe/export packs the results and the draft (in 15 MiB parts) at any time.
#
#   W=/tmp/w setsid nohup bash benchmarks/recipe_speedup_gpu.sh > /dev/null 2>&1 < /dev/null &
set -uo pipefail
W=${W:-/tmp/w}
mkdir -p "$W"
rm -f "$W/done"
export EAGLE3_CACHE=${EAGLE3_CACHE:-/tmp/e3cache} PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export PYTHONPATH=${SITE:-/tmp/site}:$(pwd)
# shellcheck source=benchmarks/staging/engine_env.sh
source benchmarks/staging/engine_env.sh
{
  if [ -z "${DRAFT:-}" ]; then
    echo "== $(date +%T) 1. the recipe (N=${N:-73728})"
    W="$W" N="${N:-73728}" STEPS=none bash benchmarks/speedup_gpu.sh
    DRAFT=$W/recipe/export
  fi
  staged() {  # staged <site> <name>: wait up to STAGE_WAIT_S (600) for an engine's staging, say if it never came
    local t=0
    until compgen -G "$1/.stage_$2-*" > /dev/null; do
      [ "$t" -ge "${STAGE_WAIT_S:-600}" ] && { echo "$2 is not staged: skipped"; return 1; }
      sleep 15; t=$((t + 15))
    done
  }
  if staged "$VSITE" vllm; then
    echo "== $(date +%T) 2. vLLM bench with CUDA graphs ($DRAFT)"
    "${vllm_env[@]}" W="$W" DRAFT="$DRAFT" MODES=graphs STEPS=bench BENCH_EXTRA="temperatures=${TEMPS:-[0,0.7]}" \
      bash benchmarks/speedup_gpu.sh
  fi
  if staged "$SGSITE" sglang; then
    echo "== $(date +%T) 3. SGLang chain-5 and trees"
    "${sglang_env[@]}" W="$W/sglang" DRAFT="$DRAFT" STEPS=sglang SGLANG_MEM=0.5 SGLANG_CONCURRENCY="[1]" \
      bash benchmarks/speedup_gpu.sh
  fi
  echo "== $(date +%T) all done"
  touch "$W/done"
} >> "$W/log" 2>&1
