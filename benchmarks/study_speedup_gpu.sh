#!/usr/bin/env bash
# Issues #35 and #34 in one lease of one H200, as one background job (run from the repository root
# after benchmarks/staging/gpu_stage.sh; benchmarks/staging/stage_vllm.sh and benchmarks/staging/stage_sglang.sh may finish while step 1 runs):
#   1. a draft to serve, and training options beside it: benchmarks/recipe_sweep_gpu.sh on STUDY_N
#      synthesized conversations with the recipe's head (draft vocab 16384, MLP 6144, lr 2e-3, EPOCHS), the
#      VARIANTS (name|overrides; default `base` alone) trained offline on the one GPU (MAX_JOBS at once),
#      each evaluated at 128 and 512 new tokens (#35's study proper: benchmarks/study35_gpu.sh);
#   2. #34 on the study's `base` draft (DRAFT= another export), the GPU otherwise idle: eagle3-bench
#      in vLLM, eager and with CUDA graphs (speedup_gpu.sh STEPS=bench), where vLLM is staged;
#   3. then side by side: eagle3-eval's STEPS3 (default "long tree": 512/1024 new tokens, the trees) |
#      SGLang serving chain-5 and two trees (STEPS=sglang; waits up to 10 minutes for its staging);
#   4. IDLE (default "moe") on the otherwise idle GPU, one at a time: geval (eagle3-eval decoder=graph at
#      batch 1 and 37, a timing) and moe (the MoE shape of the projection).
# Progress: $W/log; $W/done when finished. Every step keeps what it wrote whatever the later ones do;
# `bash benchmarks/study_speedup_gpu.sh bundle DIR` packs the small files (reports, logs,
# results) into DIR/results.tgz at any time, and the base draft's export (or DRAFT's) into
# DIR/draft.tgz.part-00, -01, ... (15 MiB each: `cat draft.tgz.part-* | tar xz` puts it back together).
#
#   W=/tmp/w setsid nohup bash benchmarks/study_speedup_gpu.sh > /dev/null 2>&1 < /dev/null &
#   (session 18: VARIANTS="base|
#   ema_0.999|train.ema_decay=0.999" STEPS3=tree IDLE="geval moe")
set -uo pipefail
W=${W:-/tmp/w}
REPO=$(pwd)
SITE=${SITE:-/tmp/site} VSITE=${VSITE:-/tmp/vsite} SGSITE=${SGSITE:-/tmp/sgsite}
if [ "${1:-}" = bundle ]; then
  out=${2:?usage: study_speedup_gpu.sh bundle DIR}
  (cd "$W" && find . \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name log -o -name '*.txt' \
    -o -name train_s -o -name '*.png' \) -size -8M -not -path '*/prepared/*' -not -path '*/dump/*' \
    \( -not -path '*/std*' -o -name manifest.json \) -print0 | tar czf "$out/results.tgz" --null -T -)
  d=${DRAFT:-$W/study/run/curve/base/export}
  # the draft in parts of 15 MiB (a file that comes back is at most 16 MiB): cat draft.tgz.part-* | tar xz
  [ -f "$d/config.json" ] && tar czf - -C "$(dirname "$d")" "$(basename "$d")" | split -b 15M -d - "$out/draft.tgz.part-"
  exit 0
fi
mkdir -p "$W"
rm -f "$W/done"
export EAGLE3_CACHE=${EAGLE3_CACHE:-/tmp/e3cache} PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export PYTHONPATH=$SITE:$REPO
# shellcheck source=benchmarks/staging/engine_env.sh
source benchmarks/staging/engine_env.sh
{
  echo "== $(date +%T) 1. the draft (and VARIANTS)"
  W=$W/study N=${STUDY_N:-16384} EPOCHS=${EPOCHS:-6} LR=2e-3 DRAFT_VOCAB=16384 RECIPE_EXTRA="model.intermediate_size=6144" \
    TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-480} EVAL_LONG=512 VARIANTS="${VARIANTS:-base|}" \
    bash benchmarks/recipe_sweep_gpu.sh || echo "the study failed: exit $?"
  DRAFT=${DRAFT:-$W/study/run/curve/base/export}
  if compgen -G "$VSITE/.stage_vllm-*" > /dev/null; then
    echo "== $(date +%T) 2. #34 bench in vLLM ($DRAFT)"
    "${vllm_env[@]}" W="$W/speedup" DRAFT="$DRAFT" STEPS=bench BENCH_EXTRA="${BENCH_EXTRA:-}" bash benchmarks/speedup_gpu.sh
  else
    echo "== $(date +%T) 2. vLLM is not staged: no bench"
  fi
  echo "== $(date +%T) 3. ${STEPS3:-long tree} | SGLang"
  W="$W/speedup" DRAFT="$DRAFT" STEPS="${STEPS3:-long tree}" bash benchmarks/speedup_gpu.sh &
  for _ in $(seq 1 40); do compgen -G "$SGSITE/.stage_sglang-*" > /dev/null && break; sleep 15; done
  if compgen -G "$SGSITE/.stage_sglang-*" > /dev/null; then
    "${sglang_env[@]}" W="$W/speedup_sglang" DRAFT="$DRAFT" STEPS=sglang SGLANG_MEM=0.3 \
      SGLANG_CONCURRENCY="${SGLANG_CONCURRENCY:-[1]}" bash benchmarks/speedup_gpu.sh
  else
    echo "SGLang is not staged: skipped"
  fi
  wait
  for step in ${IDLE:-moe}; do
    echo "== $(date +%T) 4. $step, the GPU otherwise idle"
    W="$W/speedup" STEPS="$step" DRAFT="$DRAFT" bash benchmarks/speedup_gpu.sh
  done
  echo "== $(date +%T) all done"
  touch "$W/done"
} >> "$W/log" 2>&1
