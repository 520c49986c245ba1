#!/usr/bin/env bash
# Issues #35 and #34 in one lease of one H200, as one background job (run from the repository root
# after launch/gpu_stage.sh, launch/stage_vllm.sh and, for the SGLang step, launch/stage_sglang.sh):
#   1. #35's study: tests/benchmarks/recipe_sweep_gpu.sh on STUDY_N synthesized conversations with the
#      recipe's head (draft vocab 16384, MLP 6144, lr 2e-3, EPOCHS), every line of
#      tests/benchmarks/study35_variants.txt (or VARIANTS) trained at once on the one GPU, each
#      evaluated at 128 and 512 new tokens;
#   2. #34 on the study's `base` draft (DRAFT= another export), the GPU otherwise idle: eagle3-bench
#      in vLLM, eager and with CUDA graphs (tests/benchmarks/speedup_gpu.sh STEPS=bench);
#   3. then side by side: eval at 512/1024 new tokens and the trees (STEPS="long tree") | SGLang
#      serving chain-5 and two trees (STEPS=sglang, where /tmp/sgsite is staged);
#   4. the MoE shape of the projection (bench_projection.py --shapes qwen3moe), the GPU idle again.
# Progress: $W/log; $W/done when finished. Every step keeps what it wrote whatever the later ones do;
# `bash tests/benchmarks/study_speedup_gpu.sh bundle DIR` packs the small files (reports, logs,
# results) into DIR/results.tgz at any time, and the base draft's export (or DRAFT's) into
# DIR/draft.tgz.part-00, -01, ... (15 MiB each: `cat draft.tgz.part-* | tar xz` puts it back together).
#
#   W=/tmp/w setsid nohup bash tests/benchmarks/study_speedup_gpu.sh > /dev/null 2>&1 < /dev/null &
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
# shellcheck source=launch/engine_env.sh
source launch/engine_env.sh
{
  echo "== $(date +%T) 1. #35 study"
  W=$W/study N=${STUDY_N:-16384} EPOCHS=${EPOCHS:-6} LR=2e-3 DRAFT_VOCAB=16384 RECIPE_EXTRA="model.intermediate_size=6144" \
    TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-480} EVAL_LONG=512 VARIANTS="${VARIANTS:-$(cat tests/benchmarks/study35_variants.txt)}" \
    bash tests/benchmarks/recipe_sweep_gpu.sh || echo "the study failed: exit $?"
  DRAFT=${DRAFT:-$W/study/run/curve/base/export}
  echo "== $(date +%T) 2. #34 bench in vLLM ($DRAFT)"
  "${vllm_env[@]}" W="$W/speedup" DRAFT="$DRAFT" STEPS=bench BENCH_EXTRA="${BENCH_EXTRA:-}" bash tests/benchmarks/speedup_gpu.sh
  echo "== $(date +%T) 3. long replies and trees | SGLang"
  W="$W/speedup" DRAFT="$DRAFT" STEPS="long tree" bash tests/benchmarks/speedup_gpu.sh &
  if [ -d "$SGSITE" ]; then
    "${sglang_env[@]}" W="$W/speedup_sglang" DRAFT="$DRAFT" STEPS=sglang SGLANG_MEM=0.3 \
      SGLANG_CONCURRENCY="${SGLANG_CONCURRENCY:-[1]}" bash tests/benchmarks/speedup_gpu.sh &
  fi
  wait
  echo "== $(date +%T) 4. the projection's MoE shape"
  W="$W" STEPS=moe DRAFT="$DRAFT" bash tests/benchmarks/speedup_gpu.sh
  echo "== $(date +%T) all done"
  touch "$W/done"
} >> "$W/log" 2>&1
